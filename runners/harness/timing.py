"""How a child times one call, on CPU or CUDA. Runs in the child, never in the judge.

The clock is taken when this module is imported, before the worker imports the
candidate: a candidate that later replaces time.perf_counter_ns does not change it, and
`Integrity` notices the replacement. None of that is the boundary: the candidate owns
this process, so the judge bounds every reported time by its own clock and the CPU time
it reads from outside (measure.py). Every call goes through the same `run` whether it
is a correctness check, a warm-up or a timed call; the child cannot tell them apart.

A request runs a batch of calls, each on its own input set (its own slot), and reports
their total: the judge times short calls in batches, so that a time that is a lie shows
on its clock as many times over as the batch is long, while the harness's own cost of a
request is paid once (runners.harness.measure).

On a CPU the outputs of the last KEPT_OUTPUTS requests stay alive through the next one,
so the judge can see that a call does not write into an earlier output (an output that
aliases another is right when read and wrong after the next call). Before each call an
older one is poisoned in place and dropped, and memory of its size is poisoned too (all bits set: NaN as a float, -1
as an index), so a candidate that returns `torch.empty` memory hoping it still holds an
earlier answer returns NaN instead.

CUDA: every input set is captured once into a CUDA graph (production replays graphs; a
candidate that cannot be captured is rejected) and each call is a replay, with the L2
flushed by writing twice its size before it; the persisting-L2 limit is reset to 0
before each request. The events bracket each replay on the GPU's own clock: the GPU is
held busy while the host queues the first call's start event, replay and end event, and
then by each next call's flush, which takes the GPU longer than the host takes to queue
that call, so no host latency (the graph launch, a synchronize returning) falls between
them; a capture joins every side stream it forks, so the end event follows all of the
call's work. A device-wide synchronize ends the request.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ContextManager, Protocol

import torch

_perf_counter_ns = time.perf_counter_ns

# cudaLimitPersistingL2CacheSize in the CUDA runtime's cudaLimit enum.
_CUDA_LIMIT_PERSISTING_L2 = 0x06

LaunchCounter = Callable[[], ContextManager[Any]]


class CaptureError(Exception):
    """forward ran eagerly but could not be captured into a CUDA graph."""


class Runner(Protocol):
    forward: Callable[..., Any]
    # The outputs of the last request's calls, in order, and their slots.
    last_outputs: list[Any]
    last_slots: list[str]
    # The aten ops the last load or run ran beside its DSL launches (None: not recorded).
    last_torch_ops: dict[str, int] | None

    def prepare(self, slot: str, args: tuple[Any, ...]) -> int | None: ...

    def load_step(self, slot: str, step: Callable[[], Any], output: Any) -> None: ...

    def run(self, slots: list[str], *, poison: bool = True) -> tuple[float, int | None]: ...

    def drop(self, slot: str) -> None: ...

    def describe(self) -> str | None: ...


@contextlib.contextmanager
def no_counter() -> Iterator[Any]:
    yield None


def _not_loaded(*args: Any) -> Any:
    raise RuntimeError("no candidate is loaded")


def _count(counted: Any) -> int | None:
    count = getattr(counted, "count", None)
    return count if isinstance(count, int) else None


def _torch_ops(counted: Any) -> dict[str, int] | None:
    """The aten ops a call ran beside its DSL launches, by name (runners.harness.dsl)."""
    ops = getattr(counted, "torch_ops", None)
    return dict(ops) if isinstance(ops, dict) else None


def _fewest(counts: list[int | None]) -> int | None:
    """A batch's launches as the DSL check reads one call's: the call that launched least."""
    known = [count for count in counts if count is not None]
    return min(known) if known else None


def _nbytes(value: Any) -> int:
    return value.untyped_storage().nbytes() if type(value) is torch.Tensor else 0


def _poison_storage(value: Any) -> None:
    """All bits set over the output's whole storage, so whatever the next call does not
    write reads as NaN (floats) or -1 (indices)."""
    if type(value) is torch.Tensor and value.untyped_storage().nbytes():
        raw = torch.empty(0, dtype=torch.uint8, device=value.device)
        raw.set_(value.untyped_storage())
        raw.fill_(255)


KEPT_OUTPUTS = 2


class CpuRunner:
    def __init__(self, counter: LaunchCounter) -> None:
        self.forward: Callable[..., Any] = _not_loaded
        self.counter = counter
        self.slots: dict[str, tuple[Any, ...]] = {}
        # End-to-end decode steps (zero-argument callables), timed like a forward call.
        self.steps: dict[str, Callable[[], Any]] = {}
        self.last_outputs: list[Any] = []
        self.last_slots: list[str] = []
        self.last_torch_ops: dict[str, int] | None = None
        self._kept: list[Any] = []
        self._last_nbytes = 0

    def prepare(self, slot: str, args: tuple[Any, ...]) -> int | None:
        """The arguments of the slot's calls: views on memory the judge rewrites before
        every call (runners.harness.arena)."""
        self.slots[slot] = args
        self.last_torch_ops = None
        return None

    def load_step(self, slot: str, step: Callable[[], Any], output: Any) -> None:
        """A prepared decode step: `run(slot)` then calls it eagerly, on the same clock."""
        self.slots[slot] = ()
        self.steps[slot] = step

    def run(self, slots: list[str], *, poison: bool = True) -> tuple[float, int | None]:
        self.last_outputs, self.last_slots = [], []
        elapsed, launches, torch_ops = 0, [], {}
        for slot in slots:
            took, counted = self._call(slot, kept=KEPT_OUTPUTS * len(slots), poison=poison)
            elapsed += took
            launches.append(_count(counted))
            for name, count in (_torch_ops(counted) or {}).items():
                torch_ops[name] = max(count, torch_ops.get(name, 0))
        # A step's launches are not a forward call's: the DSL check counts calls only.
        step = any(slot in self.steps for slot in slots)
        self.last_torch_ops = None if step else torch_ops or None
        return elapsed / 1e6, None if step else _fewest(launches)

    def _call(self, slot: str, *, kept: int, poison: bool) -> tuple[int, Any]:
        """One call, in ns: the outputs of the last `kept` calls stay alive through it.
        With `poison` (correctness calls), no earlier answer is left where its output
        may land. A timed call is not poisoned: its inputs are new, so an earlier answer
        is a wrong one, and work of the harness's around a timed call is time a candidate
        that undid it could claim."""
        args = self.slots[slot]
        call = self.steps.get(slot, self.forward)
        while len(self._kept) > kept:
            # Poisoned where it lies, then freed (a fresh block of the same size may not
            # be the one it was freed from: free memory of its size is poisoned too).
            dropped = self._kept.pop(0)
            if poison:
                _poison_storage(dropped)
        if poison:
            # Whichever block the allocator hands out next, no earlier answer is left in
            # it. Of the last output's size: the block a stale answer would sit in (before
            # the first call, the largest argument's). Not the largest argument's every
            # call: filling a large cache (the paged ops') costs the same work whatever it
            # holds, but how many of its pages fault depends on the heap the kernel left,
            # so the harness's own cost before the call would differ between kernels
            # (runners.harness.measure's clock check compares it).
            size = self._last_nbytes or max(0, *(_nbytes(arg) for arg in args))
            torch.empty(size, dtype=torch.uint8).fill_(255)
        with self.counter() as counted:
            # A collection inside the call would be charged to whoever was running.
            gc.disable()
            try:
                start = _perf_counter_ns()
                output = call(*args)
                elapsed = _perf_counter_ns() - start
            finally:
                gc.enable()
        self.last_outputs.append(output)
        self.last_slots.append(slot)
        self._kept.append(output)
        self._last_nbytes = _nbytes(output)
        return elapsed, counted

    def drop(self, slot: str) -> None:
        self.slots.pop(slot, None)
        self.steps.pop(slot, None)
        if slot in self.last_slots:
            self.last_outputs, self.last_slots = [], []
        for output in self._kept:
            _poison_storage(output)
        self._kept.clear()

    def describe(self) -> str | None:
        return None


class _PersistingL2:
    """Sets the persisting-L2 limit back to 0 before each call: lines a candidate marked
    persisting would survive the flush (llm.c PR #851 reported 4x the card's bandwidth)."""

    def __init__(self) -> None:
        self.problem: str | None = None
        self._set_limit: Any = None
        self._reset_lines: Any = None
        library = _cudart()
        if library is None:
            self.problem = "the CUDA runtime library (libcudart) could not be loaded"
            return
        self._set_limit = library.cudaDeviceSetLimit
        self._set_limit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self._set_limit.restype = ctypes.c_int
        self._reset_lines = getattr(library, "cudaCtxResetPersistingL2Cache", None)
        # Zero from the start, before the configuration watch takes its first reading:
        # a device whose default limit is not zero (11,796,480 bytes on an H200) would
        # otherwise show the harness's own first reset as a change the candidate made.
        self.reset()

    def reset(self) -> None:
        if self._set_limit is None:
            return
        status = self._set_limit(_CUDA_LIMIT_PERSISTING_L2, 0)
        if status != 0 and self.problem is None:
            self.problem = f"cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0) returned {status}"
        if self._reset_lines is not None:
            self._reset_lines()


def persisting_l2_limit() -> int | None:
    """The persisting-L2 limit in bytes now (the configuration watch compares it); None
    where the CUDA runtime cannot be asked."""
    library = _cudart()
    if library is None:
        return None
    value = ctypes.c_size_t(0)
    library.cudaDeviceGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    library.cudaDeviceGetLimit.restype = ctypes.c_int
    status = library.cudaDeviceGetLimit(ctypes.byref(value), _CUDA_LIMIT_PERSISTING_L2)
    return value.value if status == 0 else None


def _cudart() -> ctypes.CDLL | None:
    # By soname first: the one torch loaded is returned. Else the path torch loaded it from.
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libcudart.so" in path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


def first_cause(error: BaseException) -> str:
    """Ending a broken capture raises "operation failed due to a previous error during
    capture"; the error that says what the candidate did is the one it interrupted."""
    while error.__context__ is not None:
        error = error.__context__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass
class _Captured:
    # graph.replay for a captured forward call; a decode step's own replay for the
    # end-to-end check (runners.e2e.step captures the whole step in one graph).
    replay: Callable[[], Any]
    output: Any
    launches: int | None
    step: bool = False
    # Recorded around the eager call and the capture: the graph replays torch's kernels.
    torch_ops: dict[str, int] | None = None
    # The start and end events the graph itself records around the call (external
    # events, nodes of the graph): the GPU runs them right before and after the call's
    # kernels whatever the host is doing, so a call's time never holds a launch's
    # latency and the GPU need not be held while the host queues a request.
    events: tuple[Any, Any] | None = None


class CudaRunner:
    def __init__(self, counter: LaunchCounter) -> None:
        self.forward: Callable[..., Any] = _not_loaded
        self.counter = counter
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.l2_bytes = getattr(properties, "L2_cache_size", 0) or 64 * 2**20
        self.persisting_l2 = _PersistingL2()
        # Around a decode step, whose graph runners.e2e.step captured: recorded by the host.
        self.step_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        # One memory pool per group of slots (a workload's pool of input sets): safe
        # because replays never overlap and every captured output is kept alive.
        self.pools: dict[str, Any] = {}
        self.slots: dict[str, _Captured] = {}
        # Per slot, the shared memory each call's output is copied to once it is timed
        # (runners.harness.device_memory.Shared), for the judge to read.
        self.staging: dict[str, Any] = {}
        self.last_outputs: list[Any] = []
        self.last_slots: list[str] = []
        self.last_torch_ops: dict[str, int] | None = None

    def prepare(self, slot: str, args: tuple[Any, ...]) -> int | None:
        """Captures the slot's call: every later call replays it, on the inputs the judge
        wrote into the captured input buffers (a server replays one graph a batch size
        with new inputs every step)."""
        group = slot.split(":", 1)[0]
        pool = self.pools.setdefault(group, torch.cuda.graph_pool_handle())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with contextlib.ExitStack() as counting:
            counted = counting.enter_context(self.counter())
            # One eager call first, on a side stream as torch asks: it compiles DSL
            # kernels and initialises libraries, which capture cannot do.
            with torch.cuda.stream(side):
                self.forward(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            events = (torch.cuda.Event(enable_timing=True, external=True),
                      torch.cuda.Event(enable_timing=True, external=True))
            try:
                with torch.cuda.graph(graph, pool=pool):
                    events[0].record()
                    output = self.forward(*args)
                    events[1].record()
                    # The rest of the graph is the harness's, not counted as the call's:
                    # the output's copy for the judge. In the graph, a request costs the
                    # host one launch a call, so the GPU, not the host, sets its pace
                    # even for calls of a few microseconds.
                    counting.close()
                    self._stage(slot, output)
            except Exception as error:
                raise CaptureError(first_cause(error)) from None
        torch.cuda.synchronize()
        self.slots[slot] = _Captured(graph.replay, output, _count(counted),
                                     torch_ops=_torch_ops(counted), events=events)
        self.last_torch_ops = self.slots[slot].torch_ops
        return self.slots[slot].launches

    def _stage(self, slot: str, output: Any) -> None:
        """A contiguous copy of the output where the judge reads it: after the end event,
        so it is not timed, and before the reply, so it is inside the judge's clock.
        Captured into the call's graph (prepare), or run after a decode step's replay."""
        staging = self.staging.get(slot)
        if (staging is None or type(output) is not torch.Tensor or not output.is_cuda
                or output.layout != torch.strided
                or output.numel() * output.element_size() > staging.size):
            return
        staging.tensor(output.dtype, output.shape).copy_(output)

    def load_step(self, slot: str, step: Callable[[], Any], output: Any) -> None:
        """A decode step already captured (runners.e2e.step): each run is one replay of it."""
        torch.cuda.synchronize()
        self.slots[slot] = _Captured(step, output, None, step=True)

    def run(self, slots: list[str], *, poison: bool = True) -> tuple[float, int | None]:
        """Replays each slot's graph in turn, each call timed by the events its graph
        records. Nothing of the harness's runs on the GPU between the calls but each
        output's copy for the judge, a node of the same graph after the call's end
        event: the judge flushed the L2 before the request (from its own process,
        runners.harness.observe.GpuProbe), and anything the harness did here that the
        candidate's code could undo would be time it could claim. `poison` (for
        correctness calls) first sets every bit of the outputs' memory."""
        if len(set(slots)) != len(slots):
            raise ValueError("a request names each slot once: its graph's events time one call")
        batch = [self.slots[slot] for slot in slots]
        self.last_outputs, self.last_slots = [], []
        self.persisting_l2.reset()
        if poison:
            for captured in batch:
                _poison_storage(captured.output)
        torch.cuda.synchronize()
        timed = []
        for slot, captured in zip(slots, batch, strict=True):
            if captured.events is None:
                start, end = self.step_events
                start.record()
                captured.replay()
                end.record()
                timed.append((start, end))
                self._stage(slot, captured.output)
            else:
                captured.replay()  # its output's copy for the judge is in the graph
                timed.append(captured.events)
        torch.cuda.synchronize()
        self.last_outputs = [captured.output for captured in batch]
        self.last_slots = list(slots)
        self.last_torch_ops = batch[-1].torch_ops
        elapsed = sum(start.elapsed_time(end) for start, end in timed)
        return elapsed, _fewest([captured.launches for captured in batch])

    def drop(self, slot: str) -> None:
        captured = self.slots.pop(slot, None)
        staging = self.staging.pop(slot, None)
        if staging is not None:
            staging.close()
        if slot in self.last_slots:
            self.last_outputs, self.last_slots = [], []
        if captured is not None and captured.step:
            del captured
            torch.cuda.empty_cache()  # a step's weights and graph pool are large
            return
        group = slot.split(":", 1)[0]
        if group in self.pools and not any(name.split(":", 1)[0] == group for name in self.slots):
            del self.pools[group]
            # The next workload's inputs may need what this one's graphs held; a
            # fraction of the device is all a child gets.
            torch.cuda.empty_cache()

    def describe(self) -> str | None:
        if self.persisting_l2.problem:
            return f"the persisting-L2 limit could not be reset: {self.persisting_l2.problem}"
        return (f"L2 flushed by the judge writing {2 * self.l2_bytes / 2**20:.0f} MiB before each request; "
                "persisting-L2 limit reset to 0; calls replayed from CUDA graphs")


def make_runner(device: str, counter: LaunchCounter) -> Runner:
    """Made before the candidate is imported; its `forward` is set once it is."""
    return CudaRunner(counter) if device == "cuda" else CpuRunner(counter)


class Integrity:
    """Remembers the objects the measurement relies on and names any later replaced.

    Catches the o3-style hack of patching the timer or the synchronisation (METR's o3
    report): whatever the candidate swaps after import is named in the next answer.
    """

    def __init__(self) -> None:
        self._watched: list[tuple[str, object, str, object]] = []

    def watch(self, owner: object, names: list[str], label: str) -> None:
        for name in names:
            if hasattr(owner, name):
                self._watched.append((f"{label}.{name}", owner, name, getattr(owner, name)))

    def watch_module(self, module: ModuleType) -> None:
        names = [name for name, value in vars(module).items()
                 if callable(value) and not name.startswith("__")]
        self.watch(module, names, module.__name__)

    def replaced(self) -> list[str]:
        return [label for label, owner, name, original in self._watched
                if getattr(owner, name, None) is not original]


def watch_measurement(integrity: Integrity, device: str) -> None:
    integrity.watch(time, ["perf_counter_ns", "perf_counter", "monotonic"], "time")
    integrity.watch_module(sys.modules[__name__])
    if device == "cuda":
        integrity.watch(torch.cuda, ["synchronize", "graph", "_sleep"], "torch.cuda")
        integrity.watch(torch.cuda.Event, ["record", "elapsed_time", "synchronize"], "torch.cuda.Event")
        integrity.watch(torch.cuda.CUDAGraph, ["replay"], "torch.cuda.CUDAGraph")
