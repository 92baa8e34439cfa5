"""The evaluation, top to bottom: candidate process → correctness → timing → statistics → guards → verdict.

The process running this is the judge. It never imports candidate code: the candidate
runs in a child process of its own, the baseline in two others that never saw the
candidate (one to compare against, one as the A/A control that measures the noise
floor). The judge draws the secret seed, generates the same inputs as the children to
compute references the children never see, checks every output it fetches, measures
its own round trips, and decides. Whatever a child does (crash, hang, exit, print,
lie), the evaluation completes with a verdict.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runners.harness import arena as inputs_arena
from runners.harness import dsl as dsls
from runners.harness import e2e_command as declared_e2e
from runners.harness import collective, device_memory, endtoend, imports, new_shapes, protected, roofline
from runners.harness.children import (
    BASELINE,
    CANDIDATE,
    CallFailed,
    Child,
    ChildFailure,
    ChildrenFeed,
    Limits,
    Watch,
    thread_count,
)
from runners.harness.correctness import Feed
from runners.harness.observe import GpuProbe
from runners.harness.correctness import call_failure, check_correctness, replay_checks, revalidate
from runners.harness.dispatch import SizedResult, dispatch_range, size_axis
from runners.harness.machine import machine_state
from runners.harness.memo import NO_MEMO, Memo
from runners.harness.measure import (
    CONTROL,
    Measurement,
    batch_capacity,
    clock_disagreement,
    clock_excess,
    measure_workload,
    median_overhead,
)
from runners.harness.result import EvaluationResult, Guard, Stage, WorkloadResult
from runners.harness.seeds import derive_seed, draw_secret_seed
from runners.harness.sizes import secret_workloads, sizes_along
from runners.harness.stats import MIN_NOISE_FLOOR, compare, noise_floors
from runners.ops import DISTRIBUTIONS, Op, Workload, get_op
from runners.space import read_literals

DSLS = dsls.DSLS
# CPU a stopped jail may show between two readings from outside: the kernel's
# accounting of a stopped thread does not move, so anything above rounding ran.
IDLE_CPU_MS = 0.5
# A speedup above this over the baseline is flagged for scrutiny (reward-hacks.md).
PLAUSIBLE_SPEEDUP = 10.0
# Why a run whose times say nothing (interpreted Triton on a CPU) is checked and not timed.
_NOT_TIMED = ("not timed: the kernel ran in Triton's CPU interpreter, whose times say nothing "
              "about a GPU; judged on correctness only (time it on a GPU)")
# Guards whose failure means the outputs were not right (or never came).
_CORRECTNESS_GUARDS = frozenset({"loads", "correctness", "output-type", "inputs-unchanged",
                                 "deterministic", "timed-outputs", "aliasing"})


class UsageError(ValueError):
    """The evaluation was asked for wrongly; nothing about the candidate is known."""


def _checked_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda: CUDA is not available here (torch {torch.__version__})")
        return "cuda"
    raise UsageError(f"unknown device {device!r} (known: cpu, cuda)")


def _candidate_file(op: Op, candidate_path: str | os.PathLike[str]) -> Path:
    if str(candidate_path) == "baseline":
        return op.baseline_path
    path = Path(candidate_path)
    if not path.is_file():
        raise UsageError(f"candidate file not found: {path}")
    return path.resolve()


def _child_cpus(threads: int) -> list[int] | None:
    """The cores every child runs on: the same ones for all. The children are called one
    at a time, so sharing costs nothing, and a core that runs slower (another tenant on
    its host, a busy sibling) slows every side alike instead of the one process the
    scheduler kept there: unpinned, A/A processes differed by up to 36%."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    available = sorted(os.sched_getaffinity(0))
    return available[-threads:]


def _judge_cpus(child_cpus: list[int] | None) -> set[int] | None:
    """The cores the judge's own thread keeps to while it evaluates: none of the
    children's, so its reading of a child from outside while that child works never
    takes the child's core. None where the children have every core."""
    if not hasattr(os, "sched_getaffinity") or not child_cpus:
        return None
    others = set(os.sched_getaffinity(0)) - set(child_cpus)
    return others or None


def _literal_params(source: str) -> dict[str, object] | None:
    # Read, never run: the judge does not execute candidate code, even to see PARAMS.
    try:
        params, _ = read_literals(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return params


def _verdict(result: EvaluationResult) -> str:
    """A win needs a dispatch range: somewhere the candidate is significantly faster and
    nowhere in that range significantly slower."""
    if not result.correct or any(guard.status == "fail" for guard in result.guards):
        return "rejected"
    return "win" if result.dispatch and result.timing_meaningful else "no-gain"


def _dispatch(op: Op, workloads: list[Workload], results: list[WorkloadResult],
              secret: list[Workload]) -> dict | None:
    """The sizes the candidate won at, every one checked and timed; the secret sizes
    checked for correctness between them (never timed: the range does not claim them);
    what a size inside that no process had seen cost on its first call; and the shape
    buckets the op calls kernels through, where it has them."""
    axis = size_axis(workloads[0].params) if workloads else None
    if axis is None:
        return None
    found = dispatch_range(axis, [
        SizedResult(workload.params[axis], result.speedup, result.significant)
        for workload, result in zip(workloads, results)
    ])
    if found is not None:
        inside = [size for size in sizes_along(axis, secret) if found["min"] <= size <= found["max"]]
        found["secret_sizes_checked"] = inside
        if inside:
            found["summary"] += (f"; also correct at {len(inside)} secret size"
                                 f"{'s' if len(inside) > 1 else ''} in between (not timed)")
        firsts = [result for workload, result in zip(workloads, results)
                  if found["min"] <= workload.params[axis] <= found["max"]
                  and result.first_call_ms is not None]
        if firsts:
            worst = max(firsts, key=lambda result: result.first_call_ms)
            found["new_size_first_call_ms"] = worst.first_call_ms
            found["new_size_first_call_baseline_ms"] = worst.first_call_baseline_ms
            found["summary"] += (f"; a new size's first call up to {worst.first_call_ms:.3g} ms "
                                 f"(kept kernel {worst.first_call_baseline_ms:.3g} ms)")
        buckets = op.buckets(workloads[0].device)
        if buckets:
            found["shape_buckets"] = buckets
            found["summary"] += "; called through shape buckets of " + " and ".join(
                f"{bucket:,} {'tokens' if name == 'context_length' else 'sequences'}"
                for name, bucket in buckets.items())
    return found


@dataclass
class _Run:
    """One evaluation in progress: what was asked, and the children started for it."""

    op: Op
    path: Path
    baseline_path: Path
    workloads: list[Workload]
    result: EvaluationResult
    limits: Limits
    budget_s: float
    deadline: float
    say: Callable[[str], None]
    # The required-DSL check of the source: (status, detail), None for plain torch.
    static: tuple[str, str] | None = None
    # The protected-settings check of the source against the kept kernel's (None: the
    # source is not Python).
    protected_settings: tuple[str, str] | None = None
    # The batch sizes asked for (None: the op's defaults), for the end-to-end points.
    batch_sizes: list[int] | None = None
    # Sizes drawn from the secret seed, checked for correctness beside the workloads.
    secret: list[Workload] = field(default_factory=list)
    # The unseen sizes beside the declared workloads, for the first-call guard.
    new_shapes: list[new_shapes.NewShape] = field(default_factory=list)
    # (what was seen, the problem or None) of the timing processes' threads in calls.
    threads_in_calls: tuple[str, str | None] | None = None
    # The cores every child runs on, chosen before the judge keeps to the others, and
    # every core the judge was given (a child's while it starts).
    child_cpus: list[int] | None = None
    start_cpus: list[int] | None = None
    # The candidate's cores, priority and limits that the kernel shows changed after
    # its timed calls (observe.Settings).
    outside_changes: list[str] = field(default_factory=list)
    # The user's own end-to-end command for the op (runners.harness.e2e_command), if any.
    e2e_command: str | None = None
    e2e_command_budget_s: float = declared_e2e.BUDGET_S
    children: list[Child] = field(default_factory=list)
    # The cascade's stage in progress (result.Stage): where a failure stops the run.
    stage: Stage = "static"
    # The timing processes (baseline, candidate, control), started once the first checked
    # call passed so that they start while the rest of correctness runs; None until then.
    timing: dict[str, Child] | None = None
    # Where the judge writes every call's inputs for the children (set in evaluate()):
    # on a CPU one arena they all map; on a GPU each child's own device memory.
    input_capacity: int = 0
    arena: inputs_arena.Arena | None = None
    gpu: GpuProbe | None = None
    feed: Feed | None = None
    # The shared code (runners.kernel_lib) the candidate and the kept kernel import, as
    # the judge read it: each child imports exactly those bytes (runners.harness.imports).
    shared: imports.Served | None = None
    # The inputs and references the judge keeps across a sweep's candidates (memo.Memo).
    memo: Memo = NO_MEMO

    def start(self, role: str, path: Path, dsl: str, watch: Watch | None = None) -> Child:
        setup = {
            "op": self.op.name, "device": self.result.device, "dsl": dsl,
            "candidate": str(path), "threads": self.result.threads,
            "cpus": self.child_cpus,
            # Every core the judge was given, while the child starts: three children
            # import torch at once.
            "start_cpus": self.start_cpus,
            "cpu_seconds": math.ceil(self.limits.total_s * (self.result.threads or 1)) + 10,
            "file_bytes": self.limits.file_bytes, "memory_bytes": self.limits.memory_bytes,
            "gpu_fraction": self.limits.gpu_fraction,
            "input_capacity": self.input_capacity,
            "arena_fd": self.arena.child_fd if self.arena is not None else None,
        }
        if self.shared is not None:
            setup["lib"] = str(self.shared.candidate_folder if role == CANDIDATE
                               else self.shared.kept_folder)
        label = {CANDIDATE: "candidate process", BASELINE: "baseline process",
                 CONTROL: "second baseline process"}[role]
        child = Child(role=role, label=label, setup=setup, limits=self.limits,
                      deadline=self.deadline,
                      env_extra=lambda scratch: dsls.child_environment(dsl, self.result.device, scratch),
                      watch=watch, gpu=self.gpu)
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in self.children:
            child.close()
        if self.arena is not None:
            self.arena.close()
        if self.shared is not None:
            self.shared.close()


def evaluate(
    op_name: str,
    candidate_path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    context_lengths: Iterable[int] | None = None,
    batch_sizes: Iterable[int] | None = None,
    time_budget_s: float = 1.0,
    progress: Callable[[str], None] | None = None,
    dsl: str = "torch",
    seed: int | None = None,
    limits: Limits | None = None,
    baseline: str | os.PathLike[str] | None = None,
    e2e_command: str | None = None,
    e2e_command_budget_s: float = declared_e2e.BUDGET_S,
    stop_at_static: bool = True,
    lib: str | os.PathLike[str] | None = None,
    baseline_lib: str | os.PathLike[str] | None = None,
    memo: Memo | None = None,
) -> EvaluationResult:
    """Evaluate a candidate file (or "baseline", for an A/A run) against the op's baseline.

    `stop_at_static=False` runs every later stage even for a source the static checks
    reject, as if a line had been hidden from them: the red team shows each runtime guard
    on its own that way, beside the static check that stops it first.

    `baseline` replaces the op's baseline.py as the kernel to time against (the kept
    kernel of the workspace's main line, so kept wins accumulate). `e2e_command` is the
    user's own end-to-end program for the op, run with the kept kernel and with the
    candidate within `e2e_command_budget_s` seconds (runners.harness.e2e_command).
    `lib` and `baseline_lib` are the lib folders whose shared code the candidate and the
    baseline import (runners.harness.imports; default: the shipped runners/kernel_lib/).
    `memo` keeps the inputs and references of `seed` for the next candidate that shares
    it (runners.harness.memo): a sweep passes the same seed and memo to every candidate.

    Raises UnknownOpError, WorkloadError or UsageError before anything runs when the
    request itself is wrong; anything wrong with the candidate is a `rejected` verdict.
    """
    started = time.monotonic()
    say = progress or (lambda message: None)
    op = get_op(op_name)
    kind = _checked_device(device)
    batch_sizes = None if batch_sizes is None else list(batch_sizes)
    workloads = op.workloads(kind, context_lengths, batch_sizes)
    path = _candidate_file(op, candidate_path)
    baseline_path = op.baseline_path if baseline is None else _candidate_file(op, baseline)
    if dsl not in DSLS:
        raise UsageError(f"unknown DSL {dsl!r} (known: {', '.join(DSLS)})")
    if not time_budget_s > 0:
        raise UsageError(f"the time budget must be positive, not {time_budget_s}")
    if not e2e_command_budget_s > 0:
        raise UsageError(f"the end-to-end command's budget must be positive, not {e2e_command_budget_s}")
    if op.world_size > 1 and (dsl != "torch" or e2e_command is not None):
        raise UsageError(f"{op.name} spans {op.world_size} ranks: its evaluation runs torch "
                         "candidates, without an end-to-end command, so far")
    limits = limits or Limits()
    source = path.read_text(encoding="utf-8", errors="replace")
    baseline_source = baseline_path.read_text(encoding="utf-8", errors="replace")
    try:
        kept_shared = imports.resolve(baseline_source, baseline_path.name, _lib_folder(baseline_lib))
    except imports.ImportRefused as refusal:
        raise UsageError(f"the baseline cannot be evaluated: {refusal}") from None

    result = EvaluationResult(
        op=op.name, device=kind, verdict="rejected", correct=False,
        workloads=[WorkloadResult(name=workload.name) for workload in workloads],
        candidate="baseline" if str(candidate_path) == "baseline" else str(path),
        dsl=dsl, params=_literal_params(source), threads=thread_count(),
        # Against a kept kernel the interpreter runs, a time means as little.
        timing_meaningful=(dsls.timings_meaningful(dsl, kind)
                           and dsls.timings_meaningful(dsls.written_in(baseline_source), kind)),
        seed=draw_secret_seed() if seed is None else seed,
    )
    # The cascade's static stage, once, whichever path judges the candidate next.
    try:
        shared = imports.resolve(source, path.name, _lib_folder(lib))
    except imports.ImportRefused as refusal:
        return _refused(result, [Guard("imports", "fail", str(refusal))], started)
    static, settings = _static_checks(source, baseline_source, dsl, shared, kept_shared)
    if shared:
        result.lib_files = [file.provenance() for file in shared]
        result.guards.append(Guard("imports", "pass", imports.summary(shared)))
    if op.world_size > 1:
        if stop_at_static and _fails_statically(static, settings):
            # As for one process: no rank group starts.
            return _refused(result, _static_guards(dsl, static, settings), started)
        return _evaluate_collective(op, path, baseline_path, workloads, result, settings,
                                    shared, kept_shared, budget_s=time_budget_s, limits=limits,
                                    started=started, say=say)
    run = _Run(op=op, path=path, baseline_path=baseline_path, workloads=workloads, result=result,
               limits=limits, budget_s=time_budget_s, deadline=started + limits.total_s, say=say,
               static=static, protected_settings=settings,
               batch_sizes=None if batch_sizes is None else sorted(set(batch_sizes)),
               e2e_command=e2e_command, e2e_command_budget_s=e2e_command_budget_s,
               memo=memo or NO_MEMO)
    if stop_at_static and _fails_statically(static, settings):
        # The cascade's first and cheapest stage: the source, read and never run, is
        # rejected before any process starts.
        result.guards += _static_guards(dsl, static, settings)
        result.error = next(guard.detail for guard in result.guards if guard.status == "fail")
        return _finish(result, run, started)
    if shared or kept_shared:
        run.shared = imports.Served(shared, kept_shared)
    # One thread here: the judge's idle OpenMP workers spin for a while after each of its
    # own torch calls (references, checks), stealing a core from the child being timed.
    run.secret = secret_workloads(op, kind, workloads, run.batch_sizes, result.seed)
    run.new_shapes = new_shapes.neighbours(op, kind, workloads, result.seed)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    previous_cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    run.child_cpus = _child_cpus(result.threads or 1)
    run.start_cpus = sorted(previous_cores) if previous_cores else None
    judge_cores = _judge_cpus(run.child_cpus)
    if judge_cores:
        os.sched_setaffinity(0, judge_cores)
    try:
        set_bytes = {workload.name: inputs_arena.stride(inputs_arena.layout(
            run.memo.inputs(op, workload, 0, DISTRIBUTIONS[0])))
            for workload in [*workloads, *run.secret, *(shape.workload for shape in run.new_shapes)]}
        run.input_capacity = batch_capacity(max(set_bytes.values()),
                                            max(set_bytes[workload.name] for workload in workloads))
        if kind == "cpu":
            run.arena = inputs_arena.Arena(run.input_capacity)
            run.input_capacity = run.arena.capacity
            run.feed = run.arena
        else:
            run.gpu = GpuProbe()
            run.feed = ChildrenFeed(run.children)
        candidate = _judge(run)
    finally:
        run.close()
        torch.set_num_threads(previous_threads)
        if kind == "cuda":
            torch.cuda.empty_cache()  # the references' memory, for the next evaluation's children
        if judge_cores and previous_cores:
            os.sched_setaffinity(0, previous_cores)
    result.guards += _watch_guards(run, candidate)
    if run.protected_settings is not None:
        result.guards.append(Guard("protected-settings", *run.protected_settings))
    if result.correct:
        result.dispatch = _dispatch(run.op, run.workloads, result.workloads, run.secret)
    return _finish(result, run, started)


def _static_checks(source: str, baseline_source: str, dsl: str, shared: list[imports.LibFile],
                   kept_shared: list[imports.LibFile]) -> tuple[tuple[str, str] | None,
                                                                tuple[str, str] | None]:
    """What the source and the shared files it imports say, read and never run: (the
    required-DSL check, None for plain torch; the protected-settings check, which also
    refuses a declared encoding other than UTF-8, None when it has nothing to say)."""
    static = dsls.static_check(source, dsl) if dsl != "torch" else None
    settings = protected.check(source, baseline_source)
    if shared:
        lib_dsl, lib_settings = imports.check(shared, dsl, kept=kept_shared)
        # The candidate's own failure first; else the first imported file's.
        static = static if static is None or static[0] == "fail" or lib_dsl is None else lib_dsl
        settings = settings if settings is None or settings[0] == "fail" or lib_settings is None \
            else lib_settings
    return static, settings


def _evaluate_collective(op: Op, path: Path, baseline_path: Path, workloads: list[Workload],
                         result: EvaluationResult, settings: tuple[str, str] | None,
                         shared: list[imports.LibFile], kept_shared: list[imports.LibFile], *,
                         budget_s: float, limits: Limits, started: float,
                         say: Callable[[str], None]) -> EvaluationResult:
    """An op across ranks (runners.harness.collective), once past the static stage: each
    side's ranks import the shared code it read, as one process would."""
    served = imports.Served(shared, kept_shared) if shared or kept_shared else None
    try:
        collective.evaluate(op, path, baseline_path, workloads, result, budget_s=budget_s,
                            limits=limits, deadline=started + limits.total_s, say=say,
                            settings=settings, shared=served)
    finally:
        if served is not None:
            served.close()
    result.machine = machine_state(result.device)
    result.duration_s = round(time.monotonic() - started, 3)
    return result


def _finish(result: EvaluationResult, run: _Run, started: float) -> EvaluationResult:
    result.verdict = _verdict(result)
    # Each stage runs only while no guard has failed, so the one in progress when the
    # run ended is where a rejected candidate was stopped.
    result.stopped_at = run.stage if result.verdict == "rejected" else None
    result.machine = machine_state(result.device)
    result.duration_s = round(time.monotonic() - started, 3)
    run.say(f"verdict: {result.verdict}"
            + (f" (stopped at {result.stopped_at})" if result.stopped_at else ""))
    return result


def _fails_statically(static: tuple[str, str] | None, settings: tuple[str, str] | None) -> bool:
    return any(check is not None and check[0] == "fail" for check in (static, settings))


def _static_guards(dsl: str, static: tuple[str, str] | None,
                   settings: tuple[str, str] | None) -> list[Guard]:
    """What the source alone says: the required DSL and the protected settings."""
    guards = []
    if static is not None:
        guards.append(_required_dsl(dsl, static, []))
    if settings is not None:
        guards.append(Guard("protected-settings", *settings))
    return guards


def _lib_folder(lib: str | os.PathLike[str] | None) -> Path:
    if lib is None:
        return imports.SHIPPED_LIB
    folder = Path(lib)
    if not folder.is_dir():
        raise UsageError(f"no lib folder at {folder}")
    return folder


def _refused(result: EvaluationResult, guards: list[Guard], started: float) -> EvaluationResult:
    """A candidate rejected before any process ran it: the cascade's static stage."""
    result.guards += guards
    result.error = next(guard.detail for guard in guards if guard.status == "fail")
    result.verdict = _verdict(result)
    result.stopped_at = "static"
    result.machine = machine_state(result.device)
    result.duration_s = round(time.monotonic() - started, 3)
    return result


def _judge(run: _Run) -> Child | None:
    """Runs the evaluation's steps in order; each failure becomes a guard and ends it."""
    result, say = run.result, run.say
    say(f"{run.op.name} on {result.device}: {len(run.workloads)} workloads, {result.threads} threads")
    run.stage = "load"
    candidate = run.start(CANDIDATE, run.path, result.dsl)
    try:
        candidate.wait_loaded()
    except CallFailed as failure:
        return _fail(result, candidate, Guard("loads", "fail", failure.error))
    except ChildFailure as failure:
        return _fail(result, candidate, Guard(failure.guard, "fail", failure.detail))
    result.guards.append(Guard("loads", "pass", f"{run.path.name} imports and defines forward()"))

    run.stage = "first-check"

    def first_passed() -> None:
        run.stage = "correctness"
        if result.timing_meaningful:
            # The timing processes import torch while the rest of correctness runs. They
            # load the candidate only once the checked process is gone (_time).
            run.timing = _start_timing_processes(run, candidate)

    try:
        result.guards += check_correctness(run.op, candidate, run.workloads, feed=run.feed,
                                           secret_seed=result.seed, progress=say,
                                           secret=run.secret, first_passed=first_passed,
                                           memo=run.memo)
    except ChildFailure as failure:
        return _fail(result, candidate, Guard(failure.guard, "fail", failure.detail))
    result.correct = not any(guard.status == "fail" for guard in result.guards)
    if not result.correct:
        result.error = next(guard.detail for guard in result.guards if guard.status == "fail")
        return candidate
    watch = candidate.watch
    if (watch.refused or watch.jail_refused or watch.idle_cpu_ms > IDLE_CPU_MS or watch.replaced
            or watch.extra_threads
            or watch.config_changed
            or (run.static and run.static[0] == "fail")
            or (run.protected_settings and run.protected_settings[0] == "fail")):
        # Already rejected, by what it tried or (when the static stage did not stop it)
        # by what it is written in; the guards are added once the run ends: timing it
        # would only cost time.
        return candidate
    if not result.timing_meaningful:
        result.guards.append(Guard("timing", "warn", _NOT_TIMED))
        say(f"not timed: {_NOT_TIMED}")
        return candidate

    run.stage = "timing"
    try:
        _time(run, candidate)
    except CallFailed as failure:
        if failure.role != CANDIDATE:
            guard = Guard("harness", "fail", f"the {failure.role} process failed: {failure.error}")
        elif failure.kind == "load":  # it imported once, for the checks, but not again
            guard = Guard("loads", "fail", f"{failure.error} (in the process it is timed in)")
        else:
            guard = call_failure(failure, "timed-calls", failure.during)
        _fail(result, candidate, _with_memory_holders(run, guard, failure.kind))
    except ChildFailure as failure:
        name = failure.guard if failure.role == CANDIDATE else "harness"
        _fail(result, candidate, _with_memory_holders(run, Guard(name, "fail", failure.detail)))
    return candidate


def _with_memory_holders(run: _Run, guard: Guard, kind: str | None = None) -> Guard:
    """`guard`, where it reports a process out of device memory, with who held the
    GPU's memory then: the paged ops' 256K timing ran out of it on the H200 in the kept
    kernel's processes, and the failure alone could not say whose it was."""
    if not run.result.device.startswith("cuda") or not (
            kind == "memory" or "out of memory" in guard.detail.lower()):
        return guard
    names = {os.getpid(): "the judge"} | {child.worker_pid: child.label for child in run.children
                                          if child.worker_pid is not None}
    return Guard(guard.name, guard.status, f"{guard.detail} ({device_memory.holders(names)})")


def _start_timing_processes(run: _Run, checked: Child) -> dict[str, Child]:
    """The kept kernel's two processes and the candidate's fresh one, started together so
    that they have one history. The candidate's is never the first to start: on a CPU
    the first of three processes ran apart from the next two; first, a baseline's luck
    widens the A/A floor instead. What the candidate's timing process does is watched
    with what the checked one did (one Watch)."""
    baseline_dsl = dsls.written_in(run.baseline_path.read_text(encoding="utf-8", errors="replace"))
    baseline = run.start(BASELINE, run.baseline_path, baseline_dsl)
    candidate = run.start(CANDIDATE, run.path, run.result.dsl, watch=checked.watch)
    control = run.start(CONTROL, run.baseline_path, baseline_dsl)
    return {BASELINE: baseline, CANDIDATE: candidate, CONTROL: control}


def _fail(result: EvaluationResult, candidate: Child, guard: Guard) -> Child:
    result.guards.append(guard)
    result.error = guard.detail
    if guard.name in _CORRECTNESS_GUARDS:
        result.correct = False
    return candidate


def _time(run: _Run, checked: Child) -> None:
    """Times every workload against two baseline processes; fills result.workloads.

    The candidate is timed in a fresh process of its own, started with the two baseline
    processes, and all three do the same things before the first timed call: the
    process that was checked has a history the baselines lack (fetched outputs, the
    allocations of every check), and on a CPU that history alone moved its times 5 to
    25% from theirs, an effect no A/A pair of baselines could measure. What the timing
    process does is watched with what the checked one did (one Watch).
    """
    result, say = run.result, run.say
    # Its memory and cores go to the processes being timed, and the candidate's code
    # never runs in two processes at once: the timing one loads it only now.
    checked.close()
    sides = run.timing or _start_timing_processes(run, checked)
    baseline, candidate, control = sides[BASELINE], sides[CANDIDATE], sides[CONTROL]
    baseline_dsl = baseline.setup["dsl"]
    for child in (baseline, candidate, control):
        child.wait_loaded()
    replay_checks([baseline, candidate, control], run.feed, run.op, run.workloads,
                  secret_seed=result.seed, memo=run.memo)
    measured: list[Measurement] = []
    for position, workload in enumerate(run.workloads):
        measurement = measure_workload(run.op, workload, position, sides, feed=run.feed,
                                       secret_seed=result.seed, budget_s=run.budget_s,
                                       capacity=run.input_capacity, memo=run.memo)
        problems = measurement.problems or revalidate(run.op, workload, measurement.observed, run.memo)
        if measurement.aliasing is not None:
            problems.append(Guard("aliasing", "fail", f"{measurement.aliasing} ({workload.name})"))
        if problems:
            result.guards += problems
            result.correct = False
            result.error = problems[0].detail
            return
        measured.append(measurement)
        say(f"timed {workload.name}: {len(measurement.times[CANDIDATE].reported)} samples a side")
    first_calls, problems = new_shapes.measure(
        run.op, run.new_shapes, sides,
        feed=run.feed, secret_seed=result.seed, device=result.device, memo=run.memo,
        steady={side: {w.name: statistics.median(m.times[side].round_trips) / m.times[side].batch
                       for w, m in zip(run.workloads, measured, strict=True)} for side in sides})
    if problems:
        result.guards += problems
        result.correct = False
        result.error = problems[0].detail
        return
    result.guards.append(Guard("aliasing", "pass", "every call returned memory of its own, "
                               "which no later call wrote") if result.device == "cpu" else Guard(
        "aliasing", "pass", "CUDA graphs: each replay writes its graph's own output, as a server expects"))
    hardware = roofline.hardware_key(result.device)
    result.workloads = _workload_results(run, measured, hardware)
    for workload in result.workloads:
        call = next((call for call in new_shapes.per_workload(first_calls)
                     if call.declared == workload.name), None)
        if call is not None:
            workload.first_call_shape = call.shape
            workload.first_call_ms, workload.first_call_baseline_ms = call.candidate_ms, call.baseline_ms
    result.guards.append(new_shapes.guard(run.op, first_calls))
    for workload in result.workloads:
        say(_progress_line(workload))
    result.guards += _timing_guards(run, measured, hardware)
    run.threads_in_calls = _threads_in_calls(candidate, [baseline, control],
                                             same_code=baseline_dsl == result.dsl)
    before, now = candidate.settings_before, candidate.settings_now()
    run.outside_changes = now.differences(before) if before is not None and now is not None else []
    if ((endtoend.dispatched(run.op) or run.e2e_command is not None)
            and not any(guard.status == "fail" for guard in result.guards)):
        run.stage = "end-to-end"
    if endtoend.dispatched(run.op) and not any(guard.status == "fail" for guard in result.guards):
        # The end-to-end check: only for a candidate still standing after the kernel timing;
        # one rejected before it keeps `e2e: null`.
        if result.device == "cuda":
            # The timing's inputs and readings back to the device: every side builds the
            # whole model's step next, and on an H100 the baseline's ran out of memory.
            torch.cuda.empty_cache()
        result.e2e, guard = endtoend.check(
            run.op, run.workloads, result.workloads, sides, device=result.device,
            batch_sizes=run.batch_sizes, secret_seed=result.seed, budget_s=run.budget_s,
            meaningful=result.timing_meaningful, say=say)
        result.guards.append(guard)
        if result.e2e is not None:
            say(f"end to end: {guard.detail}")
    if run.e2e_command is not None and not any(guard.status == "fail" for guard in result.guards):
        _run_e2e_command(run)


def _run_e2e_command(run: _Run) -> None:
    """The user's own end-to-end command; its report sits next to the built-in step's keys."""
    result = run.result
    report, guard = declared_e2e.check(
        run.e2e_command, op=run.op.name, candidate=run.path, baseline=run.baseline_path,
        secret_seed=result.seed, budget_s=run.e2e_command_budget_s, say=run.say)
    result.e2e = {**(result.e2e or {}), "command": report}
    result.guards.append(guard)
    run.say(f"end-to-end command: {guard.detail}")


def _workload_results(run: _Run, measured: list[Measurement],
                      hardware: str | None) -> list[WorkloadResult]:
    rngs = [np.random.default_rng(derive_seed(run.result.seed, "bootstrap", workload.name))
            for workload in run.workloads]
    floors = noise_floors([(m.times[BASELINE].reported, m.times[CONTROL].reported) for m in measured],
                          rngs=rngs, minimum=MIN_NOISE_FLOOR[run.result.device])
    results = []
    for workload, measurement, floor, rng in zip(run.workloads, measured, floors, rngs, strict=True):
        times = measurement.times
        excess = clock_excess(times[CANDIDATE], [times[BASELINE], times[CONTROL]],
                              device=run.result.device)
        # Both baseline processes are the baseline: one process's luck weighs half.
        baseline_samples = times[BASELINE].reported + times[CONTROL].reported
        found = compare(baseline_samples, times[CANDIDATE].reported, rng=rng, noise=floor.floor)
        results.append(WorkloadResult(
            name=workload.name,
            baseline_ms=found.baseline_ms,
            candidate_ms=found.candidate_ms,
            speedup=found.speedup,
            # A speedup is real only if it would still be, had the candidate lied by as
            # much as the clock check could have missed: no lie the judge's own clock
            # cannot see makes one.
            significant=(found.significant and run.result.timing_meaningful
                         and (excess is None or found.speedup < 1
                              or found.baseline_ms / (found.candidate_ms + excess.unseen_per_call_ms)
                              > 1 + floor.floor)),
            speedup_ci=list(found.speedup_ci),
            p_value=found.p_value,
            samples=len(times[CANDIDATE].reported),
            baseline_ci_ms=list(found.baseline_ci_ms),
            candidate_ci_ms=list(found.candidate_ci_ms),
            aa_speedup=floor.speedup,
            noise_floor=floor.floor,
            overhead_ms=median_overhead([times[CANDIDATE]]),
            baseline_overhead_ms=median_overhead([times[BASELINE], times[CONTROL]]),
            clock_excess_ms=excess.lower_ms if excess else None,
            clock_margin_ms=excess.margin_ms if excess else None,
            calls_per_request=times[CANDIDATE].batch,
            floor_ms=roofline.floor_ms(run.op, workload, hardware),
            roofline_fraction=roofline.achieved_fraction(run.op, workload, hardware,
                                                         found.candidate_ms),
        ))
    return results


def _progress_line(workload: WorkloadResult) -> str:
    low, high = workload.speedup_ci or (math.nan, math.nan)
    return (f"timing {workload.name}: baseline {workload.baseline_ms:.4g} ms, candidate "
            f"{workload.candidate_ms:.4g} ms, speedup {workload.speedup:.3f}x [{low:.3f}, {high:.3f}], "
            f"p={workload.p_value:.2g}, noise floor {100 * (workload.noise_floor or 0):.2g}%, "
            f"{workload.samples} samples each" + (" (significant)" if workload.significant else ""))


def _timing_guards(run: _Run, measured: list[Measurement], hardware: str | None) -> list[Guard]:
    guards = []
    disagreements = [f"{workload.name}: {problem}"
                     for workload, measurement in zip(run.workloads, measured, strict=True)
                     if (problem := clock_disagreement(
                         measurement.times[CANDIDATE],
                         [measurement.times[BASELINE], measurement.times[CONTROL]],
                         device=run.result.device))]
    guards.append(Guard("clock", "fail", disagreements[0]) if disagreements else Guard(
        "clock", "pass", "on the judge's own clock the candidate's calls take no longer beyond "
                         "their reported times than the baseline processes' do"))
    if hardware is not None:
        impossible = [
            f"impossible: {w.name}: {w.candidate_ms:.4g} ms is below the physical floor of "
            f"{w.floor_ms:.4g} ms" for w in run.result.workloads
            if w.floor_ms is not None and w.candidate_ms is not None and w.candidate_ms < w.floor_ms
        ]
        guards.append(Guard("roofline", "fail", impossible[0]) if impossible else Guard(
            "roofline", "pass", f"every workload above its physical floor on {hardware}"))
    guards.append(_plausibility(run.result.workloads))
    return guards


def _threads_in_calls(candidate: Child, baselines: list[Child], *,
                      same_code: bool) -> tuple[str, str | None]:
    """The threads each timing process ran while answering its calls, read from outside
    during them: the baselines, in the same DSL, show what the harness and torch start.
    Returns (what was seen, the problem or None)."""
    most = max(child.threads_in_calls for child in baselines)
    seen = candidate.threads_in_calls
    said = (f"threads during calls, read from outside: {seen} in the candidate's process, "
            f"at most {most} in the baselines'"
            + ("" if same_code else " (another DSL than the kept kernel's: not compared)"))
    if same_code and seen > most:
        return said, (f"threads during a call: the candidate's process ran {seen} threads "
                      f"while it answered its calls, the baseline processes at most {most} (read "
                      "from /proc during the calls): more than the harness gives it")
    return said, None


def _plausibility(workloads: list[WorkloadResult]) -> Guard:
    """Real kernel wins are rarely tenfold: one that is gets a human's eyes first."""
    implausible = [w for w in workloads if w.speedup is not None and w.speedup > PLAUSIBLE_SPEEDUP]
    if not implausible:
        return Guard("plausibility", "pass",
                     f"no workload more than {PLAUSIBLE_SPEEDUP:g}x faster than the baseline")
    shown = ", ".join(f"{w.name} {w.speedup:.1f}x" for w in implausible[:3])
    return Guard("plausibility", "warn",
                 f"needs scrutiny: more than {PLAUSIBLE_SPEEDUP:g}x faster than the baseline "
                 f"({shown}); check the guards and the diff before trusting it")


def _counted(actions: list[str], shown: int) -> str:
    """The first `shown` kinds of action, each with its count, and how many kinds more."""
    counts = Counter(actions)
    listed = "; ".join(action + (f" (×{count})" if count > 1 else "")
                       for action, count in list(counts.items())[:shown])
    return listed + (f"; and {len(counts) - shown} other kinds" if len(counts) > shown else "")


def _watch_guards(run: _Run, candidate: Child | None) -> list[Guard]:
    """What the candidate's process was seen doing, whatever stage the run ended at."""
    if candidate is None:
        return []
    watch = candidate.watch
    guards = []
    if watch.refused:
        guards.append(Guard("sandbox", "fail", f"refused: {_counted(watch.refused, 3)}"))
    elif candidate.started:
        guards.append(Guard("sandbox", "pass",
                            "no network, program, signal or outside write attempted"))
    if watch.idle_cpu_ms > IDLE_CPU_MS:
        guards.append(Guard("jail", "fail", f"the candidate's jail used {watch.idle_cpu_ms:.3g} ms "
                            "of CPU while the judge held it stopped (read from outside): "
                            "something of it escaped the stop"))
    elif watch.jail_refused:
        guards.append(Guard("jail", "fail", f"the jail refused: {_counted(watch.jail_refused, 6)}"))
    elif candidate.started:
        programs = Counter(Path(program).name for program in watch.ran)
        ran = (", ".join(f"{name} ×{count}" for name, count in sorted(programs.items()))
               if programs else "no program")
        guards.append(Guard("jail", "pass", "its own PID, mount, network and IPC namespaces, "
                            "unprivileged, read-only but for its folder: nothing refused, no "
                            f"CPU used while stopped between requests; started {ran}"))
    if watch.replaced:
        guards.append(Guard("evaluator-intact", "fail",
                            "the candidate replaced what the measurement relies on: "
                            + ", ".join(sorted(watch.replaced))))
    elif candidate.started:
        guards.append(Guard("evaluator-intact", "pass", "the clock and timing functions were left alone"))
    if watch.extra_threads > 0:
        guards.append(Guard("threads", "fail",
                            f"{watch.extra_threads} thread(s) the candidate started were still "
                            "running after forward returned: work finishing off the clock"))
    threads_seen, threads_problem = run.threads_in_calls or ("", None)
    if watch.config_changed or threads_problem or run.outside_changes:
        changes = (([threads_problem] if threads_problem else []) + run.outside_changes
                   + list(watch.config_changed.values()))
        more = f"; and {len(changes) - 3} more" if len(changes) > 3 else ""
        guards.append(Guard("config", "fail", "the candidate changed the configuration the "
                            "measurement depends on: " + "; ".join(changes[:3]) + more))
    elif candidate.started:
        guards.append(Guard("config", "pass", "environment, torch backend flags, threads, "
                            "denormals, graph and all-reduce settings, workloads and "
                            "tolerances: unchanged from before the import"
                            + (f"; {threads_seen}" if threads_seen else "")))
    cache = candidate.started.get("cache")
    if isinstance(cache, str):
        guards.append(Guard("cache-state", "warn" if "could not" in cache else "pass", cache))
    if run.static is not None:
        guards.append(_required_dsl(run.result.dsl, run.static, watch.launches, watch.torch_ops,
                                    run.op.dsl_torch_ops))
    return guards


def _required_dsl(dsl: str, static: tuple[str, str], launches: list[int],
                  torch_ops: Iterable[dict[str, int]] = (),
                  declared: frozenset[str] = frozenset()) -> Guard:
    """Did the DSL's kernels do the op's work? The torch fallback (reward-hacks.md): a DSL
    kernel defined but never launched, or launched for show while torch computes.

    `torch_ops` holds, per recorded call, the aten ops it ran outside DSL launches (none
    where the child recorded none); `declared` is the op's `dsl_torch_ops`, torch steps
    its DSL kernels may keep: those warn, any other torch compute fails.
    """
    status, detail = static
    if status == "fail":
        return Guard("required-dsl", "fail", detail)
    if not launches:
        return Guard("required-dsl", "pass" if status == "pass" else "warn",
                     f"{detail}; no call ran, so no launch was counted")
    if min(launches) == 0:
        return Guard("required-dsl", "fail",
                     f"a call launched no {dsl} kernel ({launches.count(0)} of {len(launches)} "
                     "calls ran on something else)")
    launched = (f"{detail}; every one of {len(launches)} counted calls launched {dsl} kernels "
                f"(at least {min(launches)})")
    computed = [dsls.torch_compute(ops) for ops in torch_ops]
    undeclared = [ops for ops in (Counter({name: count for name, count in call.items()
                                           if name not in declared}) for call in computed) if ops]
    if undeclared:
        allowed = (f"; the op lets its DSL kernels keep only {', '.join(sorted(declared))} in torch"
                   if declared else "")
        return Guard("required-dsl", "fail",
                     f"torch fallback: the call ran torch compute on the hot path "
                     f"({dsls.describe_ops(undeclared[0])}) beside its {dsl} kernels, in "
                     f"{len(undeclared)} of {len(computed)} recorded calls{allowed}")
    kept = [call for call in computed if call]
    if kept:
        return Guard("required-dsl", "warn",
                     f"{launched}; beside them torch computed {dsls.describe_ops(kept[0])} in "
                     f"{len(kept)} of {len(computed)} recorded calls, a step the op lets its DSL "
                     "kernels keep in torch for now")
    if computed:
        return Guard("required-dsl", "pass", f"{launched}, and none ran torch compute beside them")
    return Guard("required-dsl", "pass", launched)
