"""The cost of a new shape: the first call at a size the process has not seen.

A serving engine calls a kernel at a new size all the time (the context grows by a
token every decode step, batches come and go), so a kernel that compiles, tunes or
allocates per size costs that at every new size, not once. Warm-up hides it from the
timed calls. So once every declared workload is timed, each timing process is called
once at each of two neighbours of every declared workload along each axis: the
context length moved by odd amounts, and the batch size moved by odd amounts, drawn
from the run's secret seed (no process has seen them: the secret sizes of the
correctness check ran in another process). The first call there, preparing the slot
included (on CUDA that is where the call is first run and captured), is timed on the
judge's clock in all three processes, and its output is checked. Per axis the cheaper
of the two counts: a cost paid once, whatever the size, is not one paid per size. An
op whose shapes are bucketed (Op.context_bucket, Op.batch_bucket) makes inputs at the
bucket's shapes, so a neighbour inside the declared workload's bucket is new lengths
in the same tensors, as a server's next step is.

The candidate fails the `first-call` guard when such a call costs more than the op's
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
from runners.harness.memo import NO_MEMO, Memo
from runners.harness.result import Guard
from runners.harness.seeds import derive_seed
from runners.ops import Op, Workload, WorkloadError

GUARD = "first-call"
SLOT = "first"
# The size itself, whichever axis an op has; the op names what follows from it.
_SIZES = frozenset({"context_length", "tokens"})
# The axes a new shape moves along: rmsnorm's size is its token count.
LENGTH, TOKENS, BATCH = "context length", "token count", "batch size"


@dataclass(frozen=True)
class NewShape:
    """A workload no process has seen, beside a declared one along one axis."""

    declared: Workload
    workload: Workload
    axis: str  # LENGTH (TOKENS) or BATCH


@dataclass(frozen=True)
class FirstCall:
    """One new shape's first call, on the judge's clock (ms, preparing included)."""

    declared: str  # the declared workload it neighbours
    shape: str  # the new workload's name
    axis: str  # what moved: LENGTH (TOKENS) or BATCH
    candidate_ms: float
    baseline_ms: float  # the two baseline processes' lesser
    steady_ms: float  # the candidate's median round trip at the declared workload
    baseline_steady_ms: float
    allowed_ms: float

    @property
    def over_budget(self) -> bool:
        return self.candidate_ms > self.allowed_ms


def _moved(value: int, steps: list[int], low: int, high: int) -> list[int]:
    """`value` moved up by the first step and down by the second, each the other way
    where the range ends; never `value` itself."""
    moved = {value + steps[0] if value + steps[0] <= high else value - steps[0],
             value - steps[1] if value - steps[1] >= low else value + steps[1]}
    return sorted(size for size in moved if low <= size <= high and size != value)


def _inside(top: int, bucket: int | None, low: int, high: int) -> tuple[int, int]:
    """Where a new size is drawn: the op's range, or, where the op buckets the axis, the
    part of it in the bucket that ends at `top` (the declared size rounded up), which is
    what a server's next step meets (new lengths in the same tensors). A bucket of one
    size keeps the range."""
    if not bucket:
        return low, high
    inside = max(low, top - bucket + 1), min(high, top)
    return inside if inside[1] > inside[0] else (low, high)


def _reach(reach: int, bucket: int | None) -> int:
    """The longest step: inside one bucket where the op has one."""
    return max(1, min(reach, bucket - 1)) if bucket else reach


def neighbours(op: Op, device: str, workloads: list[Workload], secret_seed: int) -> list[NewShape]:
    """Each declared workload with two new ones beside it along each axis: its context
    length moved by two odd steps of up to a sixteenth (at least 3), and its batch size
    (where it has one the op lets move) by two odd steps of up to an eighth (at least
    1), one up and one down where the op's range allows (its bucket's part of it, where
    the op buckets the axis), drawn from the secret seed."""
    draw = random.Random(derive_seed(secret_seed, "new shapes"))
    low, high = op.context_length_range(device)
    sized = _SIZES | op.sized_params
    found: list[NewShape] = []

    def beside(workload: Workload, contexts: list[int], batches: list[int], axis: str,
               ignored: frozenset[str]) -> None:
        kind = {key: value for key, value in workload.params.items() if key not in ignored}
        for context in contexts:
            for batch in batches:
                try:
                    made = op.workloads(device, [context], [batch])
                except WorkloadError:
                    continue
                alike = [w for w in made if {k: v for k, v in w.params.items() if k not in ignored} == kind]
                if alike:
                    found.append(NewShape(workload, alike[0], axis))

    for workload in workloads:
        params = workload.params
        context, axis = params.get("context_length"), LENGTH
        if context is None:  # rmsnorm's size is its tokens: context × batch
            context, batch, axis = params["tokens"], 1, TOKENS
        else:
            batch = params["batch"]
        buckets = op.buckets(device)
        bucket = buckets.get("context_length")
        span = _inside(op.bucketed(device, context), bucket, low, high)
        steps = [draw.randrange(1, _reach(max(3, context // 16), bucket) + 1) | 1 for _ in range(2)]
        beside(workload, _moved(context, steps, *span), [batch], axis, sized)
        if "batch" in params and op.max_batch_size(device) > 1:
            bucket = buckets.get("batch")
            span = _inside(op.padded_batch(device, batch), bucket, 1, op.max_batch_size(device))
            steps = [draw.randrange(1, _reach(max(1, batch // 8), bucket) + 1) | 1 for _ in range(2)]
            beside(workload, [context], _moved(batch, steps, *span), BATCH, sized | {"batch"})
    return found


def _first_call(child: Child, feed: Feed, inputs: dict, workload: Workload) -> tuple[float, Reply]:
    during = f"the first call at the new shape {workload.name}"
    prepared = prepare(child, feed, SLOT, inputs, during)
    reply = child.request("run", during, slot=SLOT)
    return prepared.round_trip_ms + reply.round_trip_ms, reply


def measure(op: Op, shapes: list[NewShape], sides: Mapping[str, Child], *,
            feed: Feed, secret_seed: int, steady: Mapping[str, Mapping[str, float]],
            device: str, memo: Memo = NO_MEMO) -> tuple[list[FirstCall], list[Guard]]:
    """The first call at each new shape in every timing process, and any problem with the
    candidate's output there. `steady` holds each side's median round trip (ms) by
    declared workload name."""
    factor, floors = op.first_call_budget
    calls, problems = [], []
    for shape in shapes:
        declared, new = shape.declared, shape.workload
        seed = derive_seed(secret_seed, "new shape", new.name)
        expected = expect(op, new, seed, "normal", memo=memo)
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
        calls.append(FirstCall(declared.name, new.name, shape.axis, first[CANDIDATE], baseline_ms,
                               candidate_steady, baseline_steady, allowed))
    return calls, problems


def _margin(call: FirstCall) -> float:
    return call.candidate_ms - call.allowed_ms


def per_axis(calls: list[FirstCall]) -> list[FirstCall]:
    """For each declared workload and axis, the cheaper of its new shapes' first calls
    (relative to what each allows): a compile a kernel pays once whatever the size
    (Triton's first call at a length not divisible by 16) is not a cost per size; one it
    pays at both is."""
    cheapest: dict[tuple[str, str], FirstCall] = {}
    for call in calls:
        known = cheapest.get((call.declared, call.axis))
        if known is None or _margin(call) < _margin(known):
            cheapest[(call.declared, call.axis)] = call
    return list(cheapest.values())


def per_workload(calls: list[FirstCall]) -> list[FirstCall]:
    """For each declared workload, the costlier of its axes' cheaper first calls: what a
    new shape costs there, as the review page and the dispatch range report it."""
    worst: dict[str, FirstCall] = {}
    for call in per_axis(calls):
        known = worst.get(call.declared)
        if known is None or _margin(call) > _margin(known):
            worst[call.declared] = call
    return list(worst.values())


def guard(op: Op, calls: list[FirstCall]) -> Guard:
    """The first-call guard over each declared workload's cheaper new shape per axis."""
    calls = per_axis(calls)
    if not calls:
        return Guard(GUARD, "warn", "no new shape could be drawn beside the declared workloads")
    over = [call for call in calls if call.over_budget]
    factor, _ = op.first_call_budget
    workloads = {call.declared for call in calls}
    if over:
        worst = max(over, key=_margin)
        return Guard(GUARD, "fail", (
            f"first call at {worst.shape}: {worst.candidate_ms:,.1f} ms, steady "
            f"{worst.steady_ms:.3g} ms at {worst.declared} (the baseline's first call "
            f"{worst.baseline_ms:,.1f} ms, steady {worst.baseline_steady_ms:.3g} ms; allowed "
            f"{worst.allowed_ms:,.1f} ms), and as much at another new {worst.axis}: it pays per "
            f"new shape what a serving engine pays every step; "
            f"{len({call.declared for call in over})} of {len(workloads)} workloads over budget "
            f"(by {', '.join(sorted({call.axis for call in over}))})"))
    worst = max(calls, key=lambda call: call.candidate_ms / call.allowed_ms)
    axes = " and ".join(sorted({call.axis for call in calls}))
    return Guard(GUARD, "pass", (
        f"the first call at new shapes beside {len(workloads)} workloads "
        f"(new {axes}) stayed within {factor:g}× its steady call or the op's floor; the "
        f"closest, {worst.shape}: {worst.candidate_ms:.3g} ms (allowed {worst.allowed_ms:.3g} ms)"))
