"""What a candidate's process may not do, set up by the child before it imports the candidate.

Two layers:
- OS resource limits hold whatever the code does: CPU time, file size, no core dumps,
  and on CPU an address-space cap (CUDA maps a huge virtual range, so there the caps are
  the judge's timeouts and torch's allocator fraction instead).
- A Python audit hook refuses opening network connections, starting programs,
  signalling other processes, reading other processes' /proc entries, and writing
  outside the child's own directory. (Python raises no audit event for starting a
  thread; the worker counts live threads after each call instead.)

The hook is a tripwire for ordinary Python, not a jail: native code (ctypes, a compiled
extension) can go around it, so it also refuses looking up the libc functions that would
do the same things. Every refusal is recorded, so the judge can report it even when the
candidate catches the PermissionError and carries on.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import shutil
import sys
from pathlib import Path
from typing import Any

# Programs the DSL compilers start on CUDA: Triton runs ptxas (bundled) and a C compiler
# for its launcher, asks ldconfig where libcuda is and `file` what the interpreter is
# (platform.architecture); CuTe may run nvdisasm. Each can write files wherever its
# arguments say, so allowing them lets a candidate do as much: only an OS-level jail
# (another user, a mount namespace) closes that.
_COMPILER_NAMES = ("ptxas", "ptxas-blackwell", "cuobjdump", "nvdisasm", "nvcc")
_SYSTEM_PROGRAMS = ("/sbin/ldconfig", "/usr/sbin/ldconfig", "/sbin/ldconfig.real")
_HOST_TOOLS = ("cc", "gcc", "clang", "c++", "g++", "clang++", "file")

# libc entry points that start programs, signal, trace or open sockets: looked up through
# ctypes, they would bypass every check below.
_NATIVE_DENIED = frozenset({
    "system", "popen", "fork", "vfork", "clone", "clone3", "execv", "execve", "execvp",
    "execvpe", "execl", "execlp", "execle", "fexecve", "posix_spawn", "posix_spawnp",
    "kill", "killpg", "tgkill", "tkill", "sigqueue", "ptrace", "process_vm_readv",
    "process_vm_writev", "socket", "connect", "bind", "sendto", "syscall", "prctl",
    "setsid", "unshare", "setns", "pthread_create",
})

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

# Audit events whose listed arguments are paths that get written to.
_WRITING_EVENTS: dict[str, tuple[int, ...]] = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.utime": (0,), "os.truncate": (0,), "os.setxattr": (0,),
    "os.removexattr": (0,), "os.chflags": (0,), "os.lchflags": (0,), "os.lchmod": (0,),
    "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "shutil.rmtree": (0,),
    "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
    "shutil.move": (0, 1), "shutil.chown": (0,),
}
_PROGRAM_EVENTS = ("subprocess.Popen", "os.exec", "os.posix_spawn")
_ALWAYS_REFUSED = frozenset({
    "os.system", "os.fork", "os.forkpty", "os.spawn", "os.startfile", "pty.spawn",
    "sys.addaudithook",
})
_ALLOWED_SOCKET_EVENTS = frozenset({"socket.gethostname"})
_SIGNAL_EVENTS = ("os.kill", "os.killpg")


def limit_memory(memory_bytes: int) -> None:
    """An address-space cap on a CPU child, on top of what it already maps (torch is
    loaded). CUDA maps a huge virtual range, so there the caps are the judge's timeouts
    and torch's allocator fraction instead. The jail set every other limit."""
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))


def allowed_programs(dsl: str) -> frozenset[str]:
    """Real paths of the compilers a DSL may start; plain torch needs none."""
    if dsl == "torch":
        return frozenset()
    found: list[str | None] = [*_SYSTEM_PROGRAMS, os.environ.get("CC"), os.environ.get("CXX")]
    found += [shutil.which(name) for name in _HOST_TOOLS + _COMPILER_NAMES]
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "bin"
        found += [str(bundled / name) for name in _COMPILER_NAMES]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            found += [str(Path(root) / "bin" / name) for name in _COMPILER_NAMES]
    return frozenset(os.path.realpath(path) for path in found if path and os.path.isfile(path))


def preload(dsl: str) -> None:
    """Makes, before the hook is installed, the lookups a DSL would otherwise make by
    starting a program the hook refuses. Triton keys its compiled launchers by
    platform.architecture(), which runs `file` on the interpreter; its answer is cached,
    so asking once here keeps every later compile from starting it."""
    if dsl != "triton":
        return
    try:
        from triton.runtime.build import platform_key
    except ImportError:
        return
    platform_key()


class Sandbox:
    """The audit hook and its record of refusals. Install once; hooks cannot be removed."""

    def __init__(self, scratch: Path, programs: frozenset[str]) -> None:
        self._roots = (os.path.realpath(scratch),)
        self._programs = programs
        self._pid = os.getpid()
        self._refused: list[str] = []
        self._reported = 0

    def install(self) -> None:
        sys.addaudithook(self._hook)

    def new_refusals(self) -> list[str]:
        """Refusals since the last call: each is reported to the judge once."""
        fresh = self._refused[self._reported:]
        self._reported = len(self._refused)
        return fresh

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        reason = self._refusal(event, args)
        if reason is not None:
            self._refused.append(reason)
            raise PermissionError(f"refused by the harness sandbox: {reason}")

    def _refusal(self, event: str, args: tuple[Any, ...]) -> str | None:
        if event == "open":
            return self._open_refusal(*args[:3])
        if event in _WRITING_EVENTS:
            for index in _WRITING_EVENTS[event]:
                if index < len(args) and not self._inside(args[index]):
                    return f"{event} outside its directory: {_short(args[index])}"
            return None
        if event.startswith("socket."):
            return None if event in _ALLOWED_SOCKET_EVENTS else f"network access ({event} {_short(args)})"
        if event in _PROGRAM_EVENTS:
            return self._program_refusal(event, args)
        if event in _ALWAYS_REFUSED:
            return f"{event} {_short(args)}"
        if event in _SIGNAL_EVENTS and args and args[0] != self._pid:
            return f"{event}: signalling process {_short(args[0])}"
        if event in ("ctypes.dlsym", "ctypes.dlsym/handle") and len(args) > 1 and args[1] in _NATIVE_DENIED:
            return f"looking up the native function {args[1]!r} through ctypes"
        return None

    def _open_refusal(self, path: Any, mode: Any = None, flags: Any = None) -> str | None:
        if isinstance(path, int):
            return None  # an already-open descriptor: how it was opened was checked then
        text = _path_text(path)
        if text is None:
            return None
        real = os.path.realpath(text)
        if _other_process_entry(real, self._pid):
            return f"reading another process's {real}"
        writing = (isinstance(mode, str) and any(letter in mode for letter in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and real != os.devnull and not self._inside(text):
            return f"writing outside its directory: {real}"
        return None

    def _program_refusal(self, event: str, args: tuple[Any, ...]) -> str | None:
        program: Any = args[0] if args else None
        if event == "subprocess.Popen" and program is None and len(args) > 1:
            argv = args[1]
            program = argv if isinstance(argv, (str, bytes)) else (list(argv) or [None])[0]
        text = _path_text(program)
        resolved = None
        if text:
            found = text if os.sep in text else shutil.which(text)
            resolved = os.path.realpath(found) if found else None
        if resolved is not None and resolved in self._programs:
            return None
        return f"starting a program ({event} {_short(text or program)})"

    def _inside(self, path: Any) -> bool:
        if isinstance(path, int):
            return True
        text = _path_text(path)
        if text is None:
            return False
        real = os.path.realpath(text)
        return any(real == root or real.startswith(root + os.sep) for root in self._roots)


def _path_text(path: Any) -> str | None:
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        return None


def _other_process_entry(real: str, pid: int) -> bool:
    parts = real.split(os.sep)
    return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) != pid


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
