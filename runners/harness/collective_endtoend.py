"""The end-to-end check of a collective op: a tensor-parallel decode step across its ranks.

After the per-size timing, in the same two rank groups (no new processes), every rank
builds the decode step of runners.e2e.tensor_parallel: Megatron-style layers whose
row-parallel partial sums are all-reduced between layers, by the candidate's forward on
the candidate's side and by the baseline's on the baseline's. The judge draws the whole
model and its cache from the secret seed and sends each rank its own shard only, on its
own pipe: every side computes with the same weights, and no rank holds a peer's shard.
Then:

1. Correctness: for CHECKED_CALLS token batches of their own, every decode step's
   output on every rank against the exact step, which the judge computes itself
   (float64, the whole model on one rank: runners.e2e.tensor_parallel.exact_outputs).
   The op's own checks give every call a fresh tensor; inside the step every all-reduce
   is given the same buffer with new contents, call after call, as a serving engine's
   registered buffer or a CUDA graph's captured one is. An all-reduce that is right only
   on fresh tensors (attack: allreduce_stale_on_a_reused_buffer.py) is wrong here, and
   fails the `e2e` guard, naming the rank, the decode step and how far its output lay.
2. Timing: whole calls of the step (`decode_steps` steps each, two all-reduces a layer
   a step), the sides in alternating rounds on the judge's clock, the slowest rank
   deciding, each call from a token batch of its own; the outputs of a secret sample of
   rounds and of the last read back and checked as in 1 (runners.harness.rank_timing,
   as the per-size timing runs).
3. The report: the single-process end-to-end check's JSON (runners.harness.endtoend:
   baseline_ms, candidate_ms, delta_pct, one point at the step's context length and
   batch, decode tokens per second), with the step's shape under `tensor_parallel`, and
   its `e2e` guard: significance against the device's fixed noise floor, as the
   per-size timing has no A/A group either.

What the ranks say of themselves while they run the step (collectives counted, the
environment) goes to the same watch as their per-size calls, and the jail's network
counters are read around every request, for the same `moves-data` and `config` guards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runners.e2e.tensor_parallel import (
    DTYPE, SHAPES, TensorParallelShape, draw_tokens, draw_weights, exact_outputs,
)
from runners.harness import endtoend
from runners.harness.children import BASELINE, CANDIDATE, CallFailed
from runners.harness.endtoend import CPU_BUDGET_S, Point, sequence_differences
from runners.harness.rank_timing import SAMPLES_PER_ROUND, Round, time_rounds
from runners.harness.result import Guard, WorkloadResult
from runners.harness.seeds import derive_seed
from runners.harness.stats import MIN_NOISE_FLOOR
from runners.ops import Op, Workload

if TYPE_CHECKING:
    from runners.harness.collective import RankGroup, RanksWatch

STEP = "the tensor-parallel decode step"
# Calls whose outputs are checked before any timing, each from a token batch of its own.
CHECKED_CALLS = 2
# How far (relative L2) any sequence's output at any decode step, on any rank, may lie
# from the exact step's. bfloat16 rounding through the layers keeps an honest
# all-reduce's within 1.5% on the CPU shape (the worst sequence of the call, in each of
# 200 seeds of weights and tokens: 0.9-1.4%, whether the sum is rounded from float32 or
# added in bfloat16); an all-reduce that returns its first sum again on the reused
# buffer put its worst sequence 120-138% away, in every one of the 200.
STEP_OUTPUT_TOLERANCE = 0.05


def check(op: Op, groups: Mapping[str, RankGroup], watch: RanksWatch, *, workloads: list[Workload],
          kernel_results: list[WorkloadResult], device: str, secret_seed: int, budget_s: float,
          meaningful: bool, say: Callable[[str], None]) -> tuple[dict[str, Any] | None, Guard]:
    """Builds, checks and times the step on both sides; returns the `e2e` JSON (None when
    it was not timed) and the `e2e` guard. A rank that dies or hangs raises ChildFailure,
    as anywhere in the evaluation."""
    shape = SHAPES[device]
    weights = draw_weights(shape, derive_seed(secret_seed, "tensor-parallel weights"))
    try:
        for group in groups.values():
            group.build_step(shape, weights)
        wrong = check_step_outputs(groups[CANDIDATE], watch, shape, weights, secret_seed=secret_seed)
        if wrong:
            return None, _wrong(wrong)
        if not watch.moved_data_itself or watch.environment:
            return None, Guard("e2e", "fail", f"not timed: inside {STEP} the candidate's "
                                              "all-reduce did not move the data itself or changed "
                                              "the environment (moves-data, config)")
        say(f"{STEP}: every rank's output matches the exact step in {CHECKED_CALLS} calls")
        world_size = groups[CANDIDATE].world_size
        times, wrong = time_rounds(
            groups, watch, label=STEP,
            # As the single-process step: CI runs the code path on the CPU, GPUs measure.
            budget_s=min(budget_s, CPU_BUDGET_S) if device == "cpu" else budget_s,
            draw=functools.partial(_timing_round, shape, weights, secret_seed, world_size),
            # The judge's own draw of the rounds it reads, from a seed the ranks never see.
            picker=np.random.default_rng(derive_seed(secret_seed, "timed outputs", STEP)),
            run="step", forwards_per_call=shape.all_reduces_per_call)
    except CallFailed as failure:
        if failure.role == CANDIDATE:
            return None, Guard("e2e", "fail", f"raises inside {STEP}, while {failure.during}: "
                                              f"{failure.error}")
        return None, endtoend.not_run(op, f"the baseline failed while {failure.during}: {failure.error}")
    if wrong:
        return None, _wrong(wrong)
    report = _report(shape, times, secret_seed=secret_seed, device=device, meaningful=meaningful,
                     world_size=world_size)
    say(f"timed {STEP}: {report['points'][0]['samples']} samples a side")
    return report, endtoend.guard(report, workloads, kernel_results)


def check_step_outputs(candidate: RankGroup, watch: RanksWatch, shape: TensorParallelShape,
                       weights: Mapping[str, torch.Tensor], *, secret_seed: int) -> list[str]:
    """Every rank's outputs of CHECKED_CALLS calls of the built step, each from a token
    batch of its own, against the exact step; what was wrong, one line each."""
    tokens = draw_tokens(shape, derive_seed(secret_seed, "tensor-parallel check"), CHECKED_CALLS)
    wrong = []
    for call, batch in enumerate(tokens):
        exact = exact_outputs(shape, weights, batch)
        # Every rank starts from the same tokens, as every rank of a server does.
        candidate.prepare(0, batch.expand(candidate.world_size, *batch.shape))
        during = f"checking {STEP}"
        watch.traffic(candidate.traffic(), f"between requests, before {during}")
        answers = candidate.ask("check", during, slot=0, run="step")
        watch.traffic(candidate.traffic(), during)
        for rank, (header, tensors) in enumerate(answers):
            watch.calls += shape.all_reduces_per_call
            watch.note(rank, header, during)
            ok, detail = step_output_matches(tensors.get("output"), exact)
            if not ok:
                wrong.append(f"call {call + 1}, rank {rank}: {detail}")
    candidate.ask("drop", "dropping inputs", slot=0)
    return wrong


def step_output_matches(output: Any, exact: torch.Tensor) -> tuple[bool, str]:
    """One rank's outputs of a call ([decode step, sequence, hidden]) against the exact
    step's: every sequence at every step within STEP_OUTPUT_TOLERANCE; (ok, why not)."""
    if not isinstance(output, torch.Tensor):
        return False, "the step returned no tensor"
    if output.shape != exact.shape or output.dtype != DTYPE:
        return False, (f"the step's output is {list(output.shape)} in {output.dtype}, expected "
                       f"{list(exact.shape)} in {DTYPE}")
    steps, batch, hidden = exact.shape
    differences = torch.tensor(sequence_differences(output.double().reshape(-1, hidden),
                                                    exact.reshape(-1, hidden))).view(steps, batch)
    far = int((differences > STEP_OUTPUT_TOLERANCE).sum())
    if far == 0:
        return True, ""
    step, sequence = divmod(int(differences.argmax()), batch)
    worst = float(differences[step, sequence])
    shown = f"{100 * worst:.3g}%" if np.isfinite(worst) else "not finite"
    return False, (f"{far} of {steps * batch} sequence outputs (its {batch} sequences at each of "
                   f"{steps} decode steps) lie further than {100 * STEP_OUTPUT_TOLERANCE:g}% from "
                   f"the exact step's (relative L2), the worst {shown} (sequence {sequence + 1} at "
                   f"decode step {step + 1}): inside the step, where every all-reduce is given the "
                   "same buffer with new contents, its sums are not what the op's checks saw")


def _wrong(wrong: list[str]) -> Guard:
    more = f"; and {len(wrong) - 1} more" if len(wrong) > 1 else ""
    return Guard("e2e", "fail", f"wrong output of {STEP}: {wrong[0]}{more}")


def _timing_round(shape: TensorParallelShape, weights: Mapping[str, torch.Tensor],
                  secret_seed: int, world_size: int, round_number: int) -> Round:
    """One round's token batches, every rank given the same; a call's exact outputs are
    computed only where the judge reads that call."""
    tokens = draw_tokens(shape, derive_seed(secret_seed, "tensor-parallel timing", round_number),
                         SAMPLES_PER_ROUND)
    exact = functools.cache(lambda call: exact_outputs(shape, weights, tokens[call]))

    def check(call: int, output: Any) -> tuple[bool, str]:
        return step_output_matches(output, exact(call))

    return Round(tokens.expand(world_size, *tokens.shape), check)


def _report(shape: TensorParallelShape, times: dict[str, list[float]], *, secret_seed: int,
            device: str, meaningful: bool, world_size: int) -> dict[str, Any]:
    """The single-process check's e2e JSON for the step's one point, with its shape."""
    point = Point(shape.context_length, shape.batch)
    rng = np.random.default_rng(derive_seed(secret_seed, "e2e-bootstrap", point.context_length,
                                            point.batch))
    report = endtoend.report([(point, times[BASELINE], times[CANDIDATE])],
                             floors=[MIN_NOISE_FLOOR[device]], rngs=[rng], secret_seed=secret_seed,
                             meaningful=meaningful, graphs=False, steps=shape.decode_steps)
    report["step"] = f"tensor-parallel decode step ({world_size} ranks)"
    report["aa_floor"] = False  # no A/A group: the device's fixed floor
    report["tensor_parallel"] = {**shape.as_dict(), "world_size": world_size,
                                 "message_bytes": shape.message_bytes,
                                 "all_reduces_per_call": shape.all_reduces_per_call}
    return report
