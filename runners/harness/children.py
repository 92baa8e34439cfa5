"""The judge's side of a child process: start it, ask it things, end it, say how it died.

Each child is a fresh interpreter (`python -m runners.harness.worker`) in a jail of its
own (`runners.jail`: its own PID, mount, network and IPC namespaces, an unprivileged
identity, a read-only root with one writable scratch folder, a system-call filter whose
supervisor reports to the judge), with a clean environment. It talks to the judge only
through a private pipe pair passed by descriptor; its stdout and stderr are a log the
judge never parses. What the jail refused comes on a third pipe, from the supervisor,
which the child never holds. Every request has a timeout and the evaluation an overall
deadline; a child that misses one is killed, and its failure is told as a guard, not an
exception that ends the evaluation.
"""

from __future__ import annotations

import json
import math
import os
import select
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
from runners.harness import arena, wire
from runners.harness.candidate import shorten
from runners.harness.observe import GpuProbe, Outside, Settings, StopFailed
from runners.jail.plan import make_plan

_PROJECT_ROOT = Path(runners.__file__).resolve().parent.parent
# Passed through from the judge's environment when set: where the GPU and its libraries are.
_INHERITED = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH",
              "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES")
# NCCL's NVLink SHARP, torch's symmetric-memory multicast and NVSHMEM's, all off.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
_STARTUP_S = 120.0  # trusted part of the start: the interpreter, torch, the op
# How long the judge's clock waits after a reply for the worker to wait on its next
# request (an honest one does within microseconds) before it stops it where it is.
WAIT_READING_S = 0.5
# How long a kill waits for the worker to have exited (a GPU context of tens of GiB
# takes a moment to give back), after which it goes on regardless.
WORKER_EXIT_S = 10

BASELINE = "baseline"
CANDIDATE = "candidate"
# A fixed count so runs are comparable, and at most half the cores: with every core
# busy, one descheduled OpenMP worker stalls a whole call and swamps the timing.
MAX_THREADS = 4


def thread_count() -> int:
    """The threads every child of a run gets (torch's and OpenMP's)."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_THREADS, (available or 1) // 2))


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
    # The judge's own clock, from the request's first byte out to the reply's last in.
    round_trip_ms: float
    # CPU time the child's threads used between being resumed and stopped again,
    # read from outside (NaN for a child that is never stopped).
    cpu_ms: float = math.nan
    # On a GPU, how long a kernel of the judge's own waited for the GPU right after the
    # child was stopped (observe.GpuProbe): work the child left running shows here.
    idle_ms: float = math.nan


class Unreadable(Exception):
    """What the child described cannot be read from its memory."""


class Requester(Protocol):
    """What the judge's checks need from a side: a request and its reply."""

    def request(self, do: str, during: str, *, max_bytes: int = 0, **fields: Any) -> Reply: ...

    def read_output(self, facts: dict[str, Any], max_bytes: int) -> torch.Tensor | None: ...

    def read_inputs(self, entries: list[arena.Entry]) -> dict[str, torch.Tensor]: ...


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
    # What the jail's supervisor refused once the candidate could run, and the programs
    # it let start (a DSL's compilers).
    jail_refused: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    # CPU time the jail's threads used while the judge held it stopped, read from
    # outside: none, unless something of the candidate ran when nothing may.
    idle_cpu_ms: float = 0.0


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
    # Whatever the judge's environment or a DSL says: NVLink multicast can put a shared
    # host's GPUs out of service, so no child the harness starts may turn it on.
    env.update(MULTICAST_OFF)
    return env


def jail_messages(report: int, buffer: bytes) -> tuple[list[dict], bytes]:
    """What a jail's supervisor has written on `report` (non-blocking) since the last
    reading, after `buffer` (the last reading's partial line): its whole JSON lines that
    are objects, anything else skipped, and the partial line to keep for the next."""
    while True:
        try:
            chunk = os.read(report, 65536)
        except OSError:  # BlockingIOError: nothing more for now
            break
        if not chunk:
            break
        buffer += chunk
    *lines, buffer = buffer.split(b"\n")
    messages = []
    for line in lines:
        try:
            said = json.loads(line)
        except ValueError:
            continue
        if isinstance(said, dict):
            messages.append(said)
    return messages, buffer


class Child:
    def __init__(self, *, role: str, label: str, setup: dict[str, Any], limits: Limits,
                 deadline: float, env_extra: Callable[[Path], Mapping[str, str]],
                 watch: Watch | None = None, gpu: GpuProbe | None = None) -> None:
        self.role = role
        self.label = label  # e.g. "candidate process", for the reader of a guard
        self.setup = setup
        self.limits = limits
        self.deadline = deadline
        # Shared by the processes of one side: what either was seen doing counts.
        self.watch = watch if watch is not None else Watch(refused=[], replaced=set(), launches=[])
        self.started: dict[str, Any] = {}
        self._closed = False
        self._seq = 0
        # The worker's own process id (the supervisor is self.process), once reported,
        # and the judge's view of it from outside once the candidate is loaded.
        self.worker_pid: int | None = None
        self._worker_exit: int | None = None  # a pidfd: readable once the worker has exited
        self.outside: Outside | None = None
        self.settings_before: Settings | None = None
        self._arena_address: int | None = None
        self._cpu_when_stopped = 0
        # The most threads the worker was seen with while it answered a request.
        self.threads_in_calls = 0
        # On a GPU: the judge's own probe, the child's input memory and, per slot, the
        # memory its outputs are copied to, all mapped into the judge's context.
        self.gpu = gpu
        self._device_inputs: Any = None
        self._staging: dict[str, Any] = {}
        # Until the worker says it started, what the jail refused was the harness's own
        # start (torch probing cores, looking for libraries), not the candidate's.
        self.startup_refused: list[str] = []
        self.jail_error: str | None = None
        self._report_buffer = b""
        # One name length for every child: the environment's size moves the stack, and
        # the children should start from one memory layout (see the worker).
        self.scratch = Path(tempfile.mkdtemp(prefix="kernel-lab-child-"))
        self._root = Path(tempfile.mkdtemp(prefix="kernel-lab-root-"))
        requests_read, self._requests = os.pipe()
        # Its number in the child too (passed as is): the judge sees the worker wait on it.
        self._child_requests_fd = requests_read
        self._replies, replies_write = os.pipe()
        self._report, report_write = os.pipe()
        os.set_blocking(self._report, False)
        env = child_environment(self.scratch, threads=setup["threads"],
                                extra=env_extra(self.scratch))
        plan = make_plan(
            scratch=self.scratch, root=self._root,
            argv=[sys.executable, "-s", "-m", "runners.harness.worker", f"{requests_read:05d}",
                  f"{replies_write:05d}"],
            files=[Path(setup["candidate"]), *map(Path, (setup.get("others") or {}).values()),
                   *([Path(setup["lib"])] if setup.get("lib") else [])],
            dsl=setup["dsl"], device=setup["device"],
            environment=env, cpus=setup.get("cpus"), start_cpus=setup.get("start_cpus"),
            cpu_seconds=setup["cpu_seconds"],
            file_bytes=setup["file_bytes"])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-s", "-m", "runners.jail", plan.to_json(), str(report_write),
                 str(os.getpid())],
                pass_fds=(requests_read, replies_write, report_write,
                          *([setup["arena_fd"]] if setup.get("arena_fd") is not None else [])),
                cwd=self.scratch, env=env,
                stdin=subprocess.DEVNULL, stdout=2, stderr=2, start_new_session=True,
            )
        finally:
            os.close(requests_read)
            os.close(replies_write)
            os.close(report_write)
        wire.write_message(self._requests, setup)

    # -- starting -------------------------------------------------------------------

    def wait_loaded(self) -> None:
        """Wait for the child to start and import the candidate; raises ChildFailure or CallFailed."""
        self.started = self._receive(_STARTUP_S, "starting (importing torch and the op)").header
        # Every refusal of the harness's own start came before this reply: the supervisor
        # records a call before it answers it.
        self.read_jail_report()
        self.startup_refused, self.watch.jail_refused = self.watch.jail_refused, []
        if self.worker_pid is None:
            self.kill()
            raise ChildFailure("jail", f"the {self.label}'s supervisor never said which "
                                       "process it jailed", self.role)
        # The settings it has before the candidate exists: a change made while importing
        # is the candidate's too.
        self.settings_before = Outside(self.worker_pid).settings()
        # Only now may it import the candidate: whatever the jail refuses from here on is
        # the candidate's.
        self._send({"do": "load"}, "starting")
        arena_address = self.started.get("arena_address")
        self._arena_address = arena_address if isinstance(arena_address, int) else None
        if self.gpu is not None:
            self._device_inputs = self._take(self.started, "device_inputs", "starting")
        loaded = self._receive(self.limits.import_s, f"importing {Path(self.setup['candidate']).name}",
                               phase_guard="loads").header
        self._note(loaded)
        # From here on the candidate runs only inside a request.
        self.outside = Outside(self.worker_pid)
        self._stop(f"importing {Path(self.setup['candidate']).name}")
        self._cpu_when_stopped = self.outside.cpu_ns()
        if not loaded.get("ok"):
            raise CallFailed("load", shorten(str(loaded.get("error", "it could not be loaded"))), self.role)

    def _take(self, header: dict[str, Any], name: str, during: str) -> Any:
        """Maps device memory the child exported (its descriptor number in `header`)."""
        from runners.harness.device_memory import DeviceMemoryError, Shared

        fd, size = header.get(f"{name}_fd"), header.get(f"{name}_size")
        if not isinstance(fd, int) or not isinstance(size, int) or self.worker_pid is None:
            raise self._broken(during, f"no {name.replace('_', ' ')} memory was shared")
        try:
            return Shared.take(self.worker_pid, fd, size)
        except (DeviceMemoryError, OSError) as error:
            self.kill()
            raise ChildFailure("harness", f"the {self.label}'s device memory could not be "
                                          f"shared with the judge while {during}: {error}",
                               self.role) from None

    def write_inputs(self, entries: list[arena.Entry], inputs: dict[str, Any]) -> None:
        """On a GPU: a call's inputs, into the stopped child's own device memory."""
        for entry in entries:
            if entry.is_tensor:
                self._device_inputs.tensor(wire.DTYPES[entry.dtype], entry.shape,
                                           entry.offset).copy_(inputs[entry.name])
        torch.cuda.synchronize()

    def _count_threads(self) -> None:
        """While a request runs: how many threads the worker has, read from outside
        (a candidate that takes more only inside a call and ends them before it
        returns shows here, not between calls)."""
        threads = self.outside.threads() if self.outside is not None else None
        if threads is not None:
            self.threads_in_calls = max(self.threads_in_calls, threads)

    def _stop(self, during: str) -> None:
        assert self.outside is not None
        try:
            self.outside.stop()
        except StopFailed as error:
            self.kill()
            raise ChildFailure("process", f"the {self.label} could not be stopped after "
                                          f"{during}: {error}; it was killed", self.role) from None

    # -- reading from outside -------------------------------------------------------

    def read_output(self, facts: dict[str, Any], max_bytes: int) -> torch.Tensor | None:
        """The output a call's reply described, read from the stopped child's memory;
        None when it is larger than any right answer. Raises Unreadable."""
        span = strided_span(facts)
        if span is None:
            raise Unreadable("the reply does not describe a strided tensor")
        if span > max_bytes:
            return None
        if self.outside is None or not self.outside.stopped:
            raise Unreadable("the child is not stopped")
        dtype = wire.DTYPES[facts["dtype"]]
        if self.gpu is not None:
            staging = self._staging.get(facts.get("slot"))
            if staging is None or span > staging.size:
                raise Unreadable("the output was not staged where the judge reads it")
            raw = staging.bytes[:span].clone()
            return raw.view(dtype).as_strided(facts["shape"], facts["strides"])
        try:
            raw = self.outside.read(facts["address"], span) if span else bytearray()
        except OSError as error:
            raise Unreadable(f"the output's memory cannot be read ({error})") from None
        flat = (torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if span
                else torch.empty(0, dtype=dtype))
        return flat.as_strided(facts["shape"], facts["strides"])

    def read_inputs(self, entries: list[arena.Entry]) -> dict[str, torch.Tensor]:
        """The call's inputs as the child's own mapping holds them now: a page the
        candidate wrote is its private copy, and shows here."""
        if self.gpu is not None:
            return {entry.name: self._device_inputs.tensor(wire.DTYPES[entry.dtype], entry.shape,
                                                           entry.offset).clone()
                    for entry in entries if entry.is_tensor}
        if self.outside is None or self._arena_address is None:
            raise Unreadable("the child's inputs are not where it said they would be")
        found = {}
        for entry in entries:
            if not entry.is_tensor:
                continue
            try:
                raw = self.outside.read(self._arena_address + entry.offset, entry.nbytes)
            except OSError as error:
                raise Unreadable(f"input {entry.name} cannot be read ({error})") from None
            found[entry.name] = torch.frombuffer(raw, dtype=torch.uint8).view(
                wire.DTYPES[entry.dtype]).view(entry.shape)
        return found

    def settings_now(self) -> Settings | None:
        return self.outside.settings() if self.outside is not None else None

    # -- requests -------------------------------------------------------------------

    def request(self, do: str, during: str, *, max_bytes: int = 0, **fields: Any) -> Reply:
        """One request and its reply; CallFailed when the child says the call failed.

        Once the candidate is loaded, the jail runs only inside a request: resumed just
        before it, stopped as soon as the reply is in, so nothing of the candidate runs
        between requests and nothing the call returned changes before it is read."""
        self._seq += 1
        outside = self.outside
        cpu_before = outside.cpu_ns() if outside is not None else 0
        if self.gpu is not None and do == "run":
            self.gpu.flush()
        # The judge's clock starts before the child is woken: whatever it does once it
        # wakes (a handler of SIGCONT included) is inside the round trip.
        started = time.perf_counter_ns()
        if outside is not None:
            self.watch.idle_cpu_ms += max(0, cpu_before - self._cpu_when_stopped) / 1e6
            outside.resume()
        self._send({"do": do, "seq": self._seq, "max_bytes": max_bytes, **fields}, during)
        reply = self._receive(self.limits.call_s, during, max_bytes=max_bytes, phase_guard="process")
        if outside is not None:
            # The clock runs on until the worker waits for its next request: work done
            # after writing the reply is the request's. Then stop it before anything else.
            # One that never waits is stopped where it is after WAIT_READING_S, all of it
            # on the clock.
            outside.wait_reading(self._child_requests_fd, WAIT_READING_S)
        reply.round_trip_ms = (time.perf_counter_ns() - started) / 1e6
        if outside is not None:
            outside.halt()
        if self.gpu is not None and do == "run":
            # At once, before waiting for the stop: the sooner the probe is queued, the
            # less of any work left running on the GPU can end unseen.
            reply.idle_ms = self.gpu.idle_ms()
        if outside is not None:
            self._stop(during)
            self._count_threads()
            self._cpu_when_stopped = outside.cpu_ns()
            reply.cpu_ms = (self._cpu_when_stopped - cpu_before) / 1e6
        if reply.header.get("seq") != self._seq:
            raise self._broken(during, "an answer to a request it was not asked")
        if self.gpu is not None and do in ("prepare", "e2e_prepare", "drop"):
            # The judge's mapping keeps the child's memory alive: let go of a slot's once
            # the child has (a slot prepared again frees its earlier staging first).
            for slot in fields.get("slots", [fields.get("slot")]):
                old = self._staging.pop(slot, None)
                if old is not None:
                    old.close()
        if (do == "prepare" or (do == "e2e_prepare" and "staging_fd" in reply.header)) \
                and self.gpu is not None and reply.header.get("ok"):
            self._staging[fields["slot"]] = self._take(reply.header, "staging", during)
        self._note(reply.header)
        if not reply.header.get("ok"):
            raise CallFailed(str(reply.header.get("kind", "raised")),
                             shorten(str(reply.header.get("error", "failed"))), self.role, during)
        return reply

    def _receive(self, timeout_s: float, during: str, *, max_bytes: int = 0,
                 phase_guard: str = "process") -> Reply:
        limit = min(timeout_s, self.deadline - time.monotonic())
        try:
            header, tensors = wire.read_message(
                self._replies, deadline=time.monotonic() + limit, max_bytes=max_bytes,
                waiting=self._count_threads if self.outside is not None else None)
        except wire.ChannelTimeout:
            self.kill()
            overall = limit < timeout_s
            raise ChildFailure(phase_guard, (
                f"the {self.label} passed the evaluation's overall deadline of "
                f"{self.limits.total_s:g} s while {during}; it was killed" if overall else
                f"the {self.label} did not finish {during} within {timeout_s:g} s; it was killed"
            ), self.role) from None
        except wire.ChannelClosed:
            self._wait_for_report()
            if self.jail_error is not None:
                raise ChildFailure("jail", f"the {self.label}'s jail could not be built: "
                                           f"{self.jail_error}", self.role) from None
            raise self._died(during, phase_guard=phase_guard) from None
        except wire.ProtocolError as error:
            raise self._broken(during, str(error)) from None
        return Reply(header, tensors, math.nan)

    def _send(self, message: dict[str, Any], during: str) -> None:
        """A message to the worker; a child that is gone is reported as it ended."""
        try:
            wire.write_message(self._requests, message)
        except OSError:  # BrokenPipeError among them
            raise self._died(during, phase_guard="process") from None

    def read_jail_report(self) -> None:
        """Takes in whatever the jail's supervisor has said since the last reading."""
        messages, self._report_buffer = jail_messages(self._report, self._report_buffer)
        for said in messages:
            if isinstance(said.get("pid"), int) and self.worker_pid is None:
                self.worker_pid = said["pid"]
                try:  # its parent, the supervisor, has not reaped it: the number is its own
                    self._worker_exit = os.pidfd_open(self.worker_pid)
                except OSError:
                    pass
            if isinstance(said.get("refused"), str):
                self.watch.jail_refused.append(shorten(said["refused"]))
            if isinstance(said.get("ran"), str):
                self.watch.ran.append(shorten(said["ran"]))
            if isinstance(said.get("jail_error"), str):
                self.jail_error = shorten(said["jail_error"])

    def _note(self, header: dict[str, Any]) -> None:
        self.read_jail_report()
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

    def _wait_for_report(self) -> None:
        """The supervisor's last words, once the child's channel closed."""
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        poller = select.poll()
        poller.register(self._report, select.POLLIN | select.POLLHUP)
        poller.poll(100)
        self.read_jail_report()

    def kill(self) -> None:
        # The worker's group (its whole jail), then the supervisor's: the worker dies
        # with the supervisor anyway, and its PID namespace with it.
        for group in (self.worker_pid, self.process.pid):
            if group is None:
                continue
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait()
        self._wait_worker_gone()

    def _wait_worker_gone(self) -> None:
        """Waits until the worker itself has exited, not only the supervisor: a killed
        worker gives back its GPU memory while it exits, and the next evaluation's children
        (tens of GiB on a GPU) found it still held when this returned at once."""
        if self._worker_exit is None:
            return
        poller = select.poll()
        poller.register(self._worker_exit, select.POLLIN)
        poller.poll(WORKER_EXIT_S * 1000)
        os.close(self._worker_exit)
        self._worker_exit = None

    def close(self) -> None:
        """End the child and everything it started, and remove its directories. Nothing
        is left to say, so it is killed rather than waited for. Once: closed again (the
        checked process is closed before the timing starts, and with every other child at
        the end), it would close descriptor numbers that other children now hold."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._requests, self._replies, self._report):
            try:
                os.close(fd)
            except OSError:
                pass
        self.kill()
        if self.outside is not None:
            self.outside.close()
        for memory in [*self._staging.values(), *([self._device_inputs] if self._device_inputs else [])]:
            memory.close()
        self._staging.clear()
        self._device_inputs = None
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(self._root, ignore_errors=True)


class ChildrenFeed:
    """On a GPU: writes a call's inputs into each live child's device memory."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children

    def write(self, entries: list[arena.Entry], inputs: dict[str, Any]) -> None:
        for child in self.children:
            if child.outside is not None and child.process.poll() is None:
                child.write_inputs(entries, inputs)


def strided_span(facts: Any) -> int | None:
    """Bytes from a strided tensor's first element to just past its last, or None when
    the description is not one of a plain strided tensor."""
    if not isinstance(facts, dict) or facts.get("plain_tensor") is not True:
        return None
    shape, strides, address = facts.get("shape"), facts.get("strides"), facts.get("address")
    if (facts.get("dtype") not in wire.DTYPES or not isinstance(address, int)
            or not isinstance(shape, list) or not isinstance(strides, list)
            or len(shape) != len(strides) or len(shape) > wire.MAX_DIMENSIONS
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40
                       for n in shape + strides)):
        return None
    if math.prod(shape) == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(shape, strides))
    return (last + 1) * wire.DTYPES[facts["dtype"]].itemsize


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
