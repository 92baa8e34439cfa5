"""What a jailed child may see and do, decided by the judge before the child starts.

The plan is data (JSON on the launcher's command line), so the child's side only carries
it out: which paths it sees (read-only, at their own paths), which device nodes, which
folder it may write (its scratch directory), which programs it may start, whether it
may start processes at all, which cores it runs on and which limits it has.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import site
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import runners

PROJECT_ROOT = Path(runners.__file__).resolve().parent.parent
# Unprivileged identity of every jailed child when the judge is root ("nobody").
NOBODY = 65534

# The system's own trees: libraries, the dynamic loader's configuration, time zones.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Device nodes a process may use: the null and random devices, and the GPU's.
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_GPU_DEVICE_PREFIX = "nvidia"
# Programs the DSL compilers start (Triton: ptxas and a C compiler for its launcher,
# ldconfig to find libcuda, `file` for platform.architecture; CuTe DSL: ptxas and
# nvdisasm). Plain torch starts none.
_COMPILER_NAMES = ("ptxas", "ptxas-blackwell", "cuobjdump", "nvdisasm", "nvcc")
_HOST_TOOLS = ("cc", "gcc", "c++", "g++", "clang", "clang++", "as", "ld", "ld.bfd",
               "ld.gold", "collect2", "file")
# What a C compiler driver runs of its own, found by asking it (-print-prog-name).
_COMPILER_PARTS = ("cc1", "cc1plus", "collect2", "lto-wrapper", "as", "ld")
_SYSTEM_PROGRAMS = ("/sbin/ldconfig", "/usr/sbin/ldconfig", "/sbin/ldconfig.real",
                    "/usr/sbin/ldconfig.real")


@dataclass
class Plan:
    scratch: str  # the one folder the child may write, at its own path
    root: str  # an empty folder the jail's root file system is built on
    argv: list[str]  # the program the jail becomes (the worker)
    readable: list[str]  # paths seen read-only, at their own paths
    devices: list[str]  # device nodes bound in /dev
    hidden: list[str] = field(default_factory=list)  # folders inside `readable`, shown empty
    programs: list[str] = field(default_factory=list)  # real paths of programs it may start
    may_fork: bool = False  # whether it may start processes at all
    cpus: list[int] | None = None  # its cores once it runs
    # The cores it may use while the harness starts (torch's import, in parallel with
    # the other children's): the worker narrows itself to `cpus` before any candidate
    # code exists, and from then on the supervisor lets it narrow further, never widen.
    start_cpus: list[int] | None = None
    cpu_seconds: int = 3600
    file_bytes: int = 2**30
    uid: int | None = None  # None: keep the judge's (an unprivileged judge)
    gid: int | None = None
    # The ranks of a collective op share one jail: its first process starts the other
    # ranks - 1 itself, before any candidate code exists, and they talk over the jail's
    # own loopback (IP sockets allowed; its network namespace holds nothing else).
    ranks: int = 1
    loopback: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(**json.loads(text))


def _existing_real(paths: Iterable[str | os.PathLike[str] | None]) -> list[str]:
    found = []
    for path in paths:
        if not path:
            continue
        text = os.fspath(path)
        if os.path.lexists(text):
            found.append(os.path.abspath(text))
            real = os.path.realpath(text)
            if real != os.path.abspath(text) and os.path.exists(real):
                found.append(real)
    return found


def _python_paths(environment: Mapping[str, str]) -> list[str]:
    """Where this interpreter, its standard library and its packages live. Not sys.path
    as a whole: it holds the folder the judge was started from, which may be any."""
    entries = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
               os.path.dirname(os.path.realpath(sys.executable)), sys.executable,
               *site.getsitepackages(), site.getusersitepackages()]
    entries += environment.get("PYTHONPATH", "").split(os.pathsep)
    return [entry for entry in entries if entry]


def _outside(paths: list[str], private: list[str]) -> list[str]:
    """Paths that hold none of `private` (the folders of the children themselves): a
    parent of one would show every child's folder, and the whole of /tmp."""
    return [path for path in paths if path != "/" and not any(
        folder == path or folder.startswith(path.rstrip("/") + "/") for folder in private)]


def _gpu_paths(environment: Mapping[str, str]) -> list[str]:
    entries = [environment.get("CUDA_HOME"), environment.get("CUDA_PATH"), "/usr/local/cuda"]
    entries += environment.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    return [entry for entry in entries if entry]


def _devices(device: str) -> list[str]:
    found = [path for path in _DEVICES if os.path.exists(path)]
    if device == "cuda" and os.path.isdir("/dev"):
        found += sorted(f"/dev/{name}" for name in os.listdir("/dev") if name.startswith(_GPU_DEVICE_PREFIX))
    return found


@functools.cache
def _compiler_parts(compiler: str) -> tuple[str, ...]:
    """The programs a C compiler driver starts itself (cc1, collect2, …), as it names them."""
    found = []
    for part in _COMPILER_PARTS:
        try:
            named = subprocess.run([compiler, f"-print-prog-name={part}"], capture_output=True,
                                   text=True, timeout=10, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if named and os.sep in named:
            found.append(named)
    return tuple(found)


def compiler_programs(environment: Mapping[str, str]) -> list[str]:
    """Real paths of the programs the DSL compilers may start."""
    import importlib.util

    found: list[str | None] = [*_SYSTEM_PROGRAMS, environment.get("CC"), environment.get("CXX")]
    path = environment.get("PATH")
    found += [shutil.which(name, path=path) for name in _HOST_TOOLS + _COMPILER_NAMES]
    for compiler in ("cc", "gcc", "c++", "g++", environment.get("CC"), environment.get("CXX")):
        located = shutil.which(compiler, path=path) if compiler else None
        if located:
            found += _compiler_parts(os.path.realpath(located))
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "bin"
        found += [str(bundled / name) for name in _COMPILER_NAMES]
    for root in (environment.get("CUDA_HOME"), environment.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            found += [str(Path(root) / "bin" / name) for name in _COMPILER_NAMES]
    return sorted({os.path.realpath(item) for item in found if item and os.path.isfile(item)})


def make_plan(*, scratch: Path, root: Path, argv: list[str], files: Iterable[Path], dsl: str,
              device: str, environment: Mapping[str, str], cpus: list[int] | None,
              cpu_seconds: int, file_bytes: int, start_cpus: list[int] | None = None,
              ranks: int = 1) -> Plan:
    """The jail of one child: the system, Python and its packages, the project and the
    two kernel files read-only; its scratch folder writable; the compilers its DSL
    needs, and nothing else, startable. `ranks` > 1: one jail for a collective group's
    ranks, which share its scratch folder, its loopback and its IPC namespace."""
    compiles = dsl != "torch"
    readable = _outside(_existing_real([
        *_SYSTEM, *_python_paths(environment), PROJECT_ROOT,
        *(_gpu_paths(environment) if device == "cuda" else []), *(str(path) for path in files),
    ]), [os.path.realpath(scratch), os.path.realpath(root)])
    # The app's data (database, uploads, workspace, secrets) is never the child's to read.
    # Nor the project's shared kernel code: a child imports only the copy the judge read,
    # checked and hashed, bound among `files` (runners.harness.imports).
    hidden = _existing_real([PROJECT_ROOT / "var", environment.get("DATA_DIR"),
                             environment.get("KERNEL_WORKSPACE"),
                             PROJECT_ROOT / "runners" / "kernel_lib"])
    root_user = os.geteuid() == 0
    return Plan(
        scratch=str(scratch), root=str(root), argv=argv,
        readable=sorted(set(readable)),
        hidden=[path for path in sorted(set(hidden)) if any(
            path == top or path.startswith(top.rstrip("/") + "/") for top in readable)],
        devices=_devices(device),
        programs=compiler_programs(environment) if compiles else [],
        may_fork=compiles, cpus=cpus, start_cpus=start_cpus or cpus, cpu_seconds=cpu_seconds,
        file_bytes=file_bytes,
        uid=NOBODY if root_user else None, gid=NOBODY if root_user else None,
        ranks=ranks, loopback=ranks > 1,
    )
