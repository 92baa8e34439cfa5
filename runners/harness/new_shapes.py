"""The cost of a new shape: the first call at a size the process has not seen.

A serving engine calls a kernel at a new size all the time (the context grows by a
token every decode step, batches come and go), so a kernel that compiles, tunes or
allocates per size costs that at every new size, not once. Warm-up hides it from the
timed calls. So once every declared workload is timed, each timing process is called
once at each of two neighbours of every declared workload: the context length moved by
odd amounts drawn from the run's secret seed (no process has seen them: the secret
sizes of the correctness check ran in another process). The first call there,
preparing the slot included (on CUDA that is where the call is first run and
captured), is timed on the judge's clock in all three processes, and its output is
checked. The cheaper of the two counts: a cost paid once, whatever the size, is not
one paid per size.

The candidate fails the `first-call` guard when that call costs more than the op's
budget allows: `Op.first_call_budget` (a factor of the candidate's steady call at the
declared workload, and a floor in ms per device, whichever is larger) plus what the
first call cost the baseline, which pays the same allocator and harness costs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from runners.harness.children import BASELINE, CANDIDATE, Child, Reply
from runners.harness.correctness import Feed, expect, judge_output, observe, prepare
from runners.harness.measure import CONTROL
from runners.harness.result import Guard
from runners.harness.seeds import derive_seed
from runners.ops import Op, Workload, WorkloadError

GUARD = "first-call"
SLOT = "first"
# The size itself, whichever axis an op has; the op names what follows from it.
_SIZES = frozenset({"context_length", "tokens"})


@dataclass(frozen=True)
class FirstCall:
    """One new shape's first call, on the judge's clock (ms, preparing included)."""

    declared: str  # the declared workload it neighbours
    shape: str  # the new workload's name
    candidate_ms: float
    baseline_ms: float  # the two baseline processes' lesser
    steady_ms: float  # the candidate's median round trip at the declared workload
    baseline_steady_ms: float
    allowed_ms: float

    @property
    def over_budget(self) -> bool:
        return self.candidate_ms > self.allowed_ms


def neighbours(op: Op, device: str, workloads: list[Workload],
               secret_seed: int) -> list[tuple[Workload, Workload]]:
    """Each declared workload with each of two new ones beside it: its context length moved
    by two odd steps of up to a sixteenth (at least 3), one up and one down where the op's
    range allows, drawn from the secret seed."""
    draw = random.Random(derive_seed(secret_seed, "new shapes"))
    low, high = op.context_length_range(device)
    sized = _SIZES | op.sized_params
    pairs = []
    for workload in workloads:
        params = workload.params
        context = params.get("context_length")
        if context is None:  # rmsnorm's size is its tokens: context × batch
            context, batch = params["tokens"], 1
        else:
            batch = params["batch"]
        reach = max(3, context // 16)
        steps = [draw.randrange(1, reach + 1) | 1 for _ in range(2)]
        moved = {context + steps[0] if context + steps[0] <= high else context - steps[0],
                 context - steps[1] if context - steps[1] >= low else context + steps[1]}
        kind = {key: value for key, value in params.items() if key not in sized}
        for size in sorted(moved):
            if not low <= size <= high or size == context:
                continue
            try:
                found = op.workloads(device, [size], [batch])
            except WorkloadError:
                continue
            alike = [w for w in found
                     if {k: v for k, v in w.params.items() if k not in sized} == kind]
            if alike:
                pairs.append((workload, alike[0]))
    return pairs


def _first_call(child: Child, feed: Feed, inputs: dict, workload: Workload) -> tuple[float, Reply]:
    during = f"the first call at the new shape {workload.name}"
    prepared = prepare(child, feed, SLOT, inputs, during)
    reply = child.request("run", during, slot=SLOT)
    return prepared.round_trip_ms + reply.round_trip_ms, reply


def measure(op: Op, pairs: list[tuple[Workload, Workload]], sides: Mapping[str, Child], *,
            feed: Feed, secret_seed: int, steady: Mapping[str, Mapping[str, float]],
            device: str) -> tuple[list[FirstCall], list[Guard]]:
    """The first call at each new shape in every timing process, and any problem with the
    candidate's output there. `steady` holds each side's median round trip (ms) by
    declared workload name."""
    factor, floors = op.first_call_budget
    calls, problems = [], []
    for declared, new in pairs:
        seed = derive_seed(secret_seed, "new shape", new.name)
        expected = expect(op, new, seed, "normal")
        first: dict[str, float] = {}
        for role in (BASELINE, CANDIDATE, CONTROL):
            first[role], reply = _first_call(sides[role], feed, expected.inputs, new)
            if role == CANDIDATE:
                reading = observe(sides[role], reply, expected.entries, expected.max_bytes)
                for name, problem in judge_output(op, expected, reading, device).items():
                    if problem is not None:
                        problems.append(Guard(name, "fail", f"{problem} (the first call at the "
                                                             f"new shape {new.name})"))
            sides[role].request("drop", f"freeing the inputs of {new.name}", slots=[SLOT])
        baseline_ms = min(first[BASELINE], first[CONTROL])
        baseline_steady = min(steady[BASELINE][declared.name], steady[CONTROL][declared.name])
        candidate_steady = steady[CANDIDATE][declared.name]
        allowed = (max(factor * candidate_steady, floors[device])
                   + max(0.0, baseline_ms - baseline_steady))
        calls.append(FirstCall(declared.name, new.name, first[CANDIDATE], baseline_ms,
                               candidate_steady, baseline_steady, allowed))
    return calls, problems


def per_workload(calls: list[FirstCall]) -> list[FirstCall]:
    """For each declared workload, the cheaper of its new shapes' first calls (relative to
    what each allows): a compile a kernel pays once whatever the size (Triton's first call
    at a length not divisible by 16) is not a cost per size; one it pays at both is."""
    cheapest: dict[str, FirstCall] = {}
    for call in calls:
        known = cheapest.get(call.declared)
        if known is None or call.candidate_ms - call.allowed_ms < known.candidate_ms - known.allowed_ms:
            cheapest[call.declared] = call
    return list(cheapest.values())


def guard(op: Op, calls: list[FirstCall]) -> Guard:
    """The first-call guard over each declared workload's cheaper new shape."""
    calls = per_workload(calls)
    if not calls:
        return Guard(GUARD, "warn", "no new shape could be drawn beside the declared workloads")
    over = [call for call in calls if call.over_budget]
    factor, _ = op.first_call_budget
    if over:
        worst = max(over, key=lambda call: call.candidate_ms - call.allowed_ms)
        return Guard(GUARD, "fail", (
            f"first call at {worst.shape}: {worst.candidate_ms:,.1f} ms, steady "
            f"{worst.steady_ms:.3g} ms at {worst.declared} (the baseline's first call "
            f"{worst.baseline_ms:,.1f} ms, steady {worst.baseline_steady_ms:.3g} ms; allowed "
            f"{worst.allowed_ms:,.1f} ms), and as much at another new size: it pays per new "
            f"shape what a serving engine pays every step; {len(over)} of {len(calls)} "
            "workloads over budget"))
    worst = max(calls, key=lambda call: call.candidate_ms / call.allowed_ms)
    return Guard(GUARD, "pass", (
        f"the first call at new shapes beside {len(calls)} workloads stayed within "
        f"{factor:g}× its steady call or the op's floor; the closest, {worst.shape}: "
        f"{worst.candidate_ms:.3g} ms (allowed {worst.allowed_ms:.3g} ms)"))
