"""The end-to-end check: does the candidate make a whole decode step faster or slower?

After the kernel timing, for an op the synthetic decode step dispatches
(`runners.e2e.step.DISPATCHED_OPS`), every child builds the step for each end-to-end
point with its own forward dispatched in: the candidate's process with the candidate,
the two baseline processes (which never imported the candidate) with the kept kernel
the evaluation already times against. Every side uses the same seed, so the weights
and caches are identical. The judge then times the steps alternately through the same
requests, rounds and clock code as the kernel calls (`measure.measure_step`): eager at
the small shape on the CPU, one CUDA-graph replay per step on CUDA. The second baseline
process is the A/A control again, so "significant" means beyond this run's noise floor.

The paged indexer ops run the decode loop instead (`runners.e2e.model.PagedDecodeLoop`):
each timed call is K decode steps (`Op.decode_steps`) over paged caches whose contexts
grow by a token every step, and the report gives decode tokens per second beside the
time per call: whatever a kernel pays per new length, it pays in every step here.

Points: the indexer ops run the step at every declared (context length, batch) of their
workloads. rmsnorm declares token counts, not contexts, so its step runs at one fixed
context, the smallest context the indexer op declares on that device (2048 on cpu, 4096
on cuda), at each declared batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runners.e2e import step as e2e_step
from runners.e2e.model import SHAPES
from runners.harness.children import BASELINE, CANDIDATE, CallFailed, Child, ChildFailure
from runners.harness.measure import CONTROL, measure_step
from runners.harness.result import Guard, WorkloadResult
from runners.harness.seeds import derive_seed
from runners.harness.stats import MIN_NOISE_FLOOR, combined_delta, compare, noise_floors
from runners.ops import Op, Workload, get_op

# The CPU step is there so CI runs the code path, not to measure much: a small budget.
CPU_BUDGET_S = 0.25
# How far (relative L2) a sequence's output of the step with the candidate dispatched
# may lie from the kept kernel's, and the check fails when more than half the batch's
# sequences lie further. A kernel's rounding moves a sequence far less; a top-k that
# breaks a near-tie otherwise moves only that sequence (they are independent through
# the step), sometimes far: an honest indexer on the CPU shape (160 sequences, 40
# seeds) lay 0.8% away at the median, 2.9% at the 95th percentile and 34.5% at worst,
# never more than one of a batch of 4 beyond 5% (on the H200 shape, 4 of 64 at most). A
# norm skipped inside the step moved every sequence 11-81% on the CPU and 14-32% on the
# H200 (docs/benchmarks.md, "The step's output, sequence by sequence").
STEP_OUTPUT_DIFFERENCE = 0.05
HEADLINE = "geometric mean over points"


@dataclass(frozen=True)
class Point:
    context_length: int
    batch: int

    @property
    def label(self) -> str:
        return f"ctx={self.context_length}, batch {self.batch}"


def dispatched(op: Op) -> bool:
    return op.name in e2e_step.DISPATCHED_OPS


def points(op: Op, workloads: list[Workload], device: str,
           batch_sizes: list[int] | None) -> list[Point]:
    """The (context length, batch) points the step runs at, in order."""
    found = {(w.params["context_length"], w.params["batch"]) for w in workloads
             if "context_length" in w.params and "batch" in w.params}
    if not found:  # rmsnorm: one fixed model context, the declared batch sizes
        context = min(get_op("dsa_indexer_topk").default_context_lengths(device))
        batches = batch_sizes if batch_sizes is not None else op.default_batch_sizes(device)
        found = {(context, batch) for batch in batches}
    return [Point(context, batch) for context, batch in sorted(found)]


def check(
    op: Op,
    workloads: list[Workload],
    kernel_results: list[WorkloadResult],
    sides: Mapping[str, Child],
    *,
    device: str,
    batch_sizes: list[int] | None,
    secret_seed: int,
    budget_s: float,
    meaningful: bool,
    say: Callable[[str], None],
) -> tuple[dict[str, Any] | None, Guard]:
    """Times every point; returns the `e2e` JSON (None when it could not be measured)
    and the `e2e` guard (or the guard of a candidate process that died doing it)."""
    budget = min(budget_s, CPU_BUDGET_S) if device == "cpu" else budget_s
    measured = []
    differences = {}
    for point in points(op, workloads, device, batch_sizes):
        try:
            times, outputs = measure_step(
                sides, context_length=point.context_length, batch=point.batch,
                # The same on every side: identical weights and caches.
                seed=derive_seed(secret_seed, "e2e", point.context_length, point.batch),
                budget_s=budget, output_bytes=_output_bound(point, device))
        except CallFailed as failure:
            return None, call_failed(op, failure, point)
        except ChildFailure as failure:
            if failure.role == CANDIDATE:
                return None, Guard(failure.guard, "fail", failure.detail)
            return None, not_run(op, failure.detail)
        differences[point], problem = step_output_difference(outputs, point)
        if problem is not None:
            return None, problem
        measured.append((point, times))
        say(f"timed the decode step at {point.label}: {len(times[CANDIDATE].reported)} samples a side")
    steps = op.decode_steps[device] if op.decode_steps else None
    found = _report(measured, secret_seed=secret_seed, device=device, meaningful=meaningful,
                    steps=steps)
    for row, (point, _) in zip(found["points"], measured, strict=True):
        row["output_difference"] = differences[point]
    return found, guard(found, workloads, kernel_results)


def _output_bound(point: Point, device: str) -> int:
    """More bytes than the step's output (a hidden vector per token, two tokens a
    sequence at most) can take: a larger one is not the step's."""
    return 2 * point.batch * SHAPES[device].hidden * 8


def step_output_difference(outputs: Mapping[str, Any], point: Point) -> tuple[float | None, Guard | None]:
    """How far the step's output with the candidate dispatched lies from the kept
    kernel's (the median over its sequences of their relative L2 distances, the same
    weights and caches on every side), and the guard that fails when most sequences lie
    further than an honest kernel's rounding can take them: a
    kernel that computes less only inside the step (where no forward call of its is
    read) moves the end-to-end figure, not the kernel's verdict."""
    baseline, control, candidate = outputs[BASELINE], outputs[CONTROL], outputs[CANDIDATE]
    if baseline is None or control is None:
        return None, None  # nothing to compare against: the kept kernel's step says nothing
    where = f"the decode step at {point.label}"
    if candidate is None:
        return None, Guard("e2e", "fail", f"the output of {where} with the candidate dispatched "
                                          "could not be read where its reply said it was")
    if _beyond(sequence_differences(control, baseline)):
        return None, None  # the kept kernel's own step differs from itself: not comparable
    differences = sequence_differences(candidate, baseline)
    median = float(np.median(differences))
    if _beyond(differences):
        far = sum(d > STEP_OUTPUT_DIFFERENCE for d in differences)
        shown = "of another shape or dtype" if math.isinf(median) else (
            f"away from the kept kernel's in {far} of its {len(differences)} sequences "
            f"(median {100 * median:.3g}%, relative L2; an honest kernel's rounding keeps "
            f"most within {100 * STEP_OUTPUT_DIFFERENCE:g}%)")
        return median, Guard("e2e", "fail", (
            f"the output of {where} with the candidate dispatched is {shown}: inside the step "
            "it computes something else than the forward calls that were checked"))
    return median, None


def _beyond(differences: list[float]) -> bool:
    """More than half the sequences lie further than STEP_OUTPUT_DIFFERENCE."""
    return 2 * sum(d > STEP_OUTPUT_DIFFERENCE for d in differences) > len(differences)


def sequence_differences(found: torch.Tensor, expected: torch.Tensor) -> list[float]:
    """Each sequence's (row's: the first dimension's) relative L2 distance; infinite for
    every one where the outputs are of other shapes or dtypes, or the found one is not
    finite."""
    rows = expected.shape[0] if expected.dim() > 1 else 1
    if found.shape != expected.shape or found.dtype != expected.dtype:
        return [math.inf] * rows
    found, expected = found.double().reshape(rows, -1), expected.double().reshape(rows, -1)
    if not bool(torch.isfinite(found).all()):
        return [math.inf] * rows
    norms = expected.norm(dim=1)
    return ((found - expected).norm(dim=1) / torch.where(norms > 0, norms, 1.0)).tolist()


def not_run(op: Op, detail: str) -> Guard:
    """The e2e guard when the check could not run through no fault of the candidate's
    (a baseline process failed in it). Where the check is the decode loop a server runs
    (Op.decode_steps: the serving-faithful ops), no win stands without it, so it fails
    and the result says why; elsewhere the synthetic step is a second opinion: a warning."""
    return Guard("e2e", "fail" if op.decode_steps else "warn", f"the end-to-end check could not run: {detail}")


def call_failed(op: Op, failure: CallFailed, point: Point) -> Guard:
    """The guard for a process that answered that the decode step failed."""
    where = f"the decode step at {point.label}"
    if failure.role != CANDIDATE:
        return not_run(op, f"the {failure.role} process failed {failure.during}: {failure.error}")
    if failure.kind == "capture":
        return Guard("e2e", "fail", f"breaks CUDA-graph capture of the decode step: {failure.error} ({where})")
    if failure.kind == "memory":
        return Guard("resources", "fail", f"ran out of memory in {where}: {failure.error}")
    return Guard("e2e", "fail", f"raises inside the decode step: forward raised {failure.error} ({where})")


def _report(measured: list, *, secret_seed: int, device: str, meaningful: bool,
            steps: int | None = None) -> dict[str, Any]:
    """The e2e JSON of the single-process step: each point's floor from its own A/A pair."""
    rngs = [np.random.default_rng(derive_seed(secret_seed, "e2e-bootstrap", p.context_length, p.batch))
            for p, _ in measured]
    floors = noise_floors([(t[BASELINE].reported, t[CONTROL].reported) for _, t in measured], rngs=rngs,
                          minimum=MIN_NOISE_FLOOR[device])
    # Both baseline processes are the baseline, as in the kernel timing.
    return report([(point, times[BASELINE].reported + times[CONTROL].reported, times[CANDIDATE].reported)
                   for point, times in measured],
                  floors=[floor.floor for floor in floors], rngs=rngs, secret_seed=secret_seed,
                  meaningful=meaningful, graphs=device == "cuda", steps=steps)


def report(samples: Sequence[tuple[Point, Sequence[float], Sequence[float]]], *,
           floors: Sequence[float], rngs: Sequence[np.random.Generator], secret_seed: int,
           meaningful: bool, graphs: bool, steps: int | None = None) -> dict[str, Any]:
    """The e2e JSON from each point's samples (ms per call: the baseline's, the
    candidate's), its noise floor and its bootstrap's generator; with `steps` (a decode
    loop's steps per call), each point also in decode tokens per second (batch × steps
    per call). `graphs`: whether each call was a CUDA-graph replay."""
    rows = []
    for (point, baseline, candidate), floor, rng in zip(samples, floors, rngs, strict=True):
        found = compare(baseline, candidate, rng=rng, noise=floor)
        rows.append({
            "context_length": point.context_length, "batch": point.batch,
            "baseline_ms": found.baseline_ms, "candidate_ms": found.candidate_ms,
            "delta_pct": 100 * (found.candidate_ms / found.baseline_ms - 1),
            "significant": found.significant and meaningful,
            "p_value": found.p_value, "noise_floor_pct": 100 * floor,
            "samples": len(candidate),
        })
        if steps is not None:
            tokens = point.batch * steps
            rows[-1].update(decode_steps=steps,
                            baseline_tokens_per_s=tokens / (found.baseline_ms / 1e3),
                            candidate_tokens_per_s=tokens / (found.candidate_ms / 1e3))
    # The headline is the geometric mean over the points (every declared size weighs the
    # same); each point is in `points`, with its own significance.
    total = combined_delta([(baseline, candidate) for _, baseline, candidate in samples],
                           rng=np.random.default_rng(derive_seed(secret_seed, "e2e-combined")))
    return {
        "baseline_ms": total.baseline_ms, "candidate_ms": total.candidate_ms,
        "delta_pct": 100 * total.delta,
        "delta_ci_pct": [100 * total.delta_ci[0], 100 * total.delta_ci[1]],
        "p_value": total.p_value, "headline": HEADLINE,
        "points": rows, "graphs": graphs, "decode_steps": steps,
    }


def _kernel_win(point: dict[str, Any], workloads: list[Workload],
                results: list[WorkloadResult]) -> WorkloadResult | None:
    """The kernel workload to set against a point: its own if it won, else the best win."""
    wins = [(w, r) for w, r in zip(workloads, results, strict=True)
            if r.significant and r.speedup is not None and r.speedup > 1]
    same = [r for w, r in wins if w.params.get("context_length") == point["context_length"]
            and w.params.get("batch") == point["batch"]]
    if same:
        return same[0]
    return max((r for _, r in wins), key=lambda r: r.speedup, default=None)


def guard(report: dict[str, Any], workloads: list[Workload], results: list[WorkloadResult]) -> Guard:
    """The `e2e` guard of a timed step: it fails where the step is significantly slower
    end to end though the kernel won, and warns where neither won. The step is named by
    the report's `step` where it has one (the tensor-parallel step's), else "decode step";
    its floor is an A/A pair's where the report says so (`aa_floor`)."""
    name = report.get("step", "decode step")
    slower = [p for p in report["points"] if p["significant"] and p["delta_pct"] > 0]
    if slower:
        worst = max(slower, key=lambda p: p["delta_pct"])
        step = (f"the {name} is {worst['delta_pct']:.1f}% slower end to end at "
                f"ctx={worst['context_length']}, batch {worst['batch']}: {worst['candidate_ms']:.3g} ms "
                f"vs {worst['baseline_ms']:.3g} ms (p={worst['p_value']:.2g})")
        win = _kernel_win(worst, workloads, results)
        if win is not None:
            return Guard("e2e", "fail", f"kernel {win.speedup:.2f}× faster on {win.name}, but {step}")
        return Guard("e2e", "warn", f"{step}; the kernel did not win either")
    low, high = report["delta_ci_pct"]
    count = len(report["points"])
    faster = [p for p in report["points"] if p["significant"] and p["delta_pct"] < 0]
    floor = max(p["noise_floor_pct"] for p in report["points"])
    floor_name = "A/A noise floor" if report.get("aa_floor", True) else "the device's noise floor"
    verdict = (f"significantly faster at {len(faster)} of {count} points" if faster
               else f"no significant change at any point ({floor_name} up to {floor:.2g}%)")
    return Guard("e2e", "pass", (
        f"{name} {report['delta_pct']:+.1f}% end to end ({report['candidate_ms']:.3g} ms vs "
        f"{report['baseline_ms']:.3g} ms, " + (f"geometric mean over {count} points" if count > 1 else
                                               f"ctx={report['points'][0]['context_length']}, "
                                               f"batch {report['points'][0]['batch']}")
        + f"; 95% CI "
        f"[{low:+.1f}%, {high:+.1f}%]); {verdict}"
        + (_tokens(report) if report.get("decode_steps") else "")
        + ("; CUDA graphs" if report["graphs"] else "; eager")))


def _tokens(report: dict[str, Any]) -> str:
    """The decode loop's throughput at its longest context, candidate against kept."""
    point = max(report["points"], key=lambda p: (p["context_length"], p["batch"]))
    return (f"; decode loop of {report['decode_steps']} steps a call at ctx<={point['context_length']}, "
            f"batch {point['batch']}: {point['candidate_tokens_per_s']:,.0f} tokens/s against "
            f"{point['baseline_tokens_per_s']:,.0f}")
