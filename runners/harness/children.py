"""The judge's side of a child process: start it, ask it things, end it, say how it died.

Each child is a fresh interpreter (`launch.py`, which becomes `python -m
runners.harness.worker`) in a new session
(so its whole process group can be killed), in a fresh temporary directory as its
working directory, home and cache, with a clean environment. It talks to the judge only
through a private pipe pair passed by descriptor; its stdout and stderr are a log the
judge never parses. Every request has a timeout and the evaluation an overall deadline;
a child that misses one is killed, and its failure is told as a guard, not an exception
that ends the evaluation.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

import runners
from runners.harness import wire
from runners.harness.candidate import shorten

_PROJECT_ROOT = Path(runners.__file__).resolve().parent.parent
_LAUNCHER = Path(__file__).resolve().parent / "launch.py"
# Passed through from the judge's environment when set: where the GPU and its libraries
# are, and the multicast switches a shared GPU host relies on.
_INHERITED = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH",
              "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
              "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
_STARTUP_S = 120.0  # trusted part of the start: the interpreter, torch, the op

BASELINE = "baseline"
CANDIDATE = "candidate"


@dataclass(frozen=True)
class Limits:
    """Time and memory a child gets. Tests shrink them; the defaults suit a GPU host."""

    import_s: float = 120.0  # importing the candidate (a DSL may compile at import)
    call_s: float = 120.0  # one request; the first call of a DSL kernel compiles it
    total_s: float = 1800.0  # the whole evaluation
    memory_bytes: int = 4 * 2**30  # CPU: address space on top of what torch already maps
    gpu_fraction: float = 0.25  # CUDA: one child's share of device memory (three run)
    file_bytes: int = 2**30  # largest file a child may write (caches included)


class ChildFailure(Exception):
    """The process itself failed: it died, hung, or broke the protocol. It cannot go on."""

    def __init__(self, guard: str, detail: str, role: str = CANDIDATE) -> None:
        super().__init__(detail)
        self.guard = guard
        self.detail = detail
        self.role = role


class CallFailed(Exception):
    """The process answered that what it was asked to do failed (e.g. forward raised)."""

    def __init__(self, kind: str, error: str, role: str = CANDIDATE, during: str = "") -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error
        self.role = role
        self.during = during


@dataclass
class Reply:
    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    round_trip_ms: float


class Requester(Protocol):
    """What the judge's checks need from a side: a request and its reply."""

    def request(self, do: str, during: str, *, max_bytes: int = 0, **fields: Any) -> Reply: ...


@dataclass
class Watch:
    """What the child's watchdog reported over the whole run: refusals and replacements."""

    refused: list[str]
    replaced: set[str]
    launches: list[int]
    extra_threads: int = 0
    # Per recorded call, the aten ops it ran beside its DSL launches, by name.
    torch_ops: list[dict[str, int]] = field(default_factory=list)
    # Setting -> "setting: before → after", the latest reading of each changed setting.
    config_changed: dict[str, str] = field(default_factory=dict)


def child_environment(scratch: Path, *, threads: int, extra: Mapping[str, str]) -> dict[str, str]:
    env = {name: os.environ[name] for name in _INHERITED if name in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    caches = scratch / "cache"
    env.update({
        "HOME": str(scratch), "TMPDIR": str(scratch), "XDG_CACHE_HOME": str(caches),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCH_EXTENSIONS_DIR": str(caches / "torch_extensions"),
        "CUTE_DSL_CACHE_DIR": str(caches / "cute_dsl"),
        # The project first, then whatever the judge was given: a DSL installed on
        # PYTHONPATH (CuTe DSL unpacked on a GPU host) must import in the children too.
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(
            [str(_PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1", "PYTHONUNBUFFERED": "1",
        # One string hash for every child: a hash drawn per process lays dicts and sets
        # out differently in each, and with them the memory a call touches.
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        # glibc hands freed blocks back to the kernel and maps fresh ones by default, so
        # every call of a few MiB paid for page faults: several times the kernel's own
        # time on CPU, and different in every process. Fixed thresholds keep freed
        # memory in the heap, in the baseline and the candidate alike.
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824",
    })
    env.update(extra)
    return env


class Child:
    def __init__(self, *, role: str, label: str, setup: dict[str, Any], limits: Limits,
                 deadline: float, env_extra: Callable[[Path], Mapping[str, str]],
                 watch: Watch | None = None) -> None:
        self.role = role
        self.label = label  # e.g. "candidate process", for the reader of a guard
        self.setup = setup
        self.limits = limits
        self.deadline = deadline
        # Shared by the processes of one side: what either was seen doing counts.
        self.watch = watch if watch is not None else Watch(refused=[], replaced=set(), launches=[])
        self.started: dict[str, Any] = {}
        self._seq = 0
        # One name length for every child: the environment's size moves the stack, and
        # the children should start from one memory layout (see the worker).
        self.scratch = Path(tempfile.mkdtemp(prefix="kernel-lab-child-"))
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        env = child_environment(self.scratch, threads=setup["threads"],
                                extra=env_extra(self.scratch))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-s", str(_LAUNCHER), f"{requests_read:05d}", f"{replies_write:05d}",
                 str(os.getpid())],
                pass_fds=(requests_read, replies_write), cwd=self.scratch, env=env,
                stdin=subprocess.DEVNULL, stdout=2, stderr=2, start_new_session=True,
            )
        finally:
            os.close(requests_read)
            os.close(replies_write)
        wire.write_message(self._requests, setup)

    # -- starting -------------------------------------------------------------------

    def wait_loaded(self) -> None:
        """Wait for the child to start and import the candidate; raises ChildFailure or CallFailed."""
        self.started = self._receive(_STARTUP_S, "starting (importing torch and the op)").header
        loaded = self._receive(self.limits.import_s, f"importing {Path(self.setup['candidate']).name}",
                               phase_guard="loads").header
        self._note(loaded)
        if not loaded.get("ok"):
            raise CallFailed("load", shorten(str(loaded.get("error", "it could not be loaded"))), self.role)

    # -- requests -------------------------------------------------------------------

    def request(self, do: str, during: str, *, max_bytes: int = 0, **fields: Any) -> Reply:
        """One request and its reply; CallFailed when the child says the call failed."""
        self._seq += 1
        started = time.perf_counter_ns()
        try:
            wire.write_message(self._requests, {"do": do, "seq": self._seq, "max_bytes": max_bytes,
                                                **fields})
        except (BrokenPipeError, OSError):
            raise self._died(during, phase_guard="process") from None
        reply = self._receive(self.limits.call_s, during, max_bytes=max_bytes, phase_guard="process")
        reply.round_trip_ms = (time.perf_counter_ns() - started) / 1e6
        if reply.header.get("seq") != self._seq:
            raise self._broken(during, "an answer to a request it was not asked")
        self._note(reply.header)
        if not reply.header.get("ok"):
            raise CallFailed(str(reply.header.get("kind", "raised")),
                             shorten(str(reply.header.get("error", "failed"))), self.role, during)
        return reply

    def _receive(self, timeout_s: float, during: str, *, max_bytes: int = 0,
                 phase_guard: str = "process") -> Reply:
        limit = min(timeout_s, self.deadline - time.monotonic())
        try:
            header, tensors = wire.read_message(self._replies, deadline=time.monotonic() + limit,
                                                max_bytes=max_bytes)
        except wire.ChannelTimeout:
            self.kill()
            overall = limit < timeout_s
            raise ChildFailure(phase_guard, (
                f"the {self.label} passed the evaluation's overall deadline of "
                f"{self.limits.total_s:g} s while {during}; it was killed" if overall else
                f"the {self.label} did not finish {during} within {timeout_s:g} s; it was killed"
            ), self.role) from None
        except wire.ChannelClosed:
            raise self._died(during, phase_guard=phase_guard) from None
        except wire.ProtocolError as error:
            raise self._broken(during, str(error)) from None
        return Reply(header, tensors, math.nan)

    def _note(self, header: dict[str, Any]) -> None:
        refused, replaced = header.get("refused"), header.get("replaced")
        if isinstance(refused, list):
            self.watch.refused += [shorten(str(item)) for item in refused[:20]]
        if isinstance(replaced, list):
            self.watch.replaced |= {shorten(str(item)) for item in replaced[:20]}
        threads = header.get("extra_threads")
        if isinstance(threads, int) and not isinstance(threads, bool):
            self.watch.extra_threads = max(self.watch.extra_threads, threads)
        launches = header.get("launches")
        if isinstance(launches, int) and not isinstance(launches, bool):
            self.watch.launches.append(launches)
        torch_ops = header.get("torch_ops")
        if isinstance(torch_ops, dict):
            self.watch.torch_ops.append({
                shorten(str(name)): count for name, count in list(torch_ops.items())[:100]
                if isinstance(count, int) and not isinstance(count, bool)})
        changed = header.get("config_changed")
        if isinstance(changed, list):
            for item in changed[:20]:
                text = shorten(str(item))
                self.watch.config_changed[text.split(":", 1)[0]] = text

    # -- ending ---------------------------------------------------------------------

    def _broken(self, during: str, why: str) -> ChildFailure:
        self.kill()
        return ChildFailure("protocol", f"the {self.label} broke the result protocol while "
                                        f"{during}: {why}; it was killed", self.role)

    def _died(self, during: str, *, phase_guard: str) -> ChildFailure:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.returncode
        self.kill()
        guard, how = _how_it_ended(code)
        return ChildFailure(guard or phase_guard, f"the {self.label} {how} while {during}", self.role)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def close(self) -> None:
        """End the child and everything it started, and remove its directory. Nothing
        is left to say, so it is killed rather than waited for."""
        for fd in (self._requests, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        self.kill()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _how_it_ended(code: int | None) -> tuple[str | None, str]:
    """(guard, how) for an exit code; guard None means the phase's own guard."""
    if code is None:
        return None, "stopped answering"
    if code >= 0:
        return None, f"exited with status {code} without answering"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGXCPU":
        return "resources", "used up its CPU-time limit (SIGXCPU)"
    if name == "SIGXFSZ":
        return "resources", "wrote a file larger than its limit (SIGXFSZ)"
    if name == "SIGKILL":
        return "resources", "was killed by SIGKILL (likely out of memory)"
    return None, f"died from {name}"
