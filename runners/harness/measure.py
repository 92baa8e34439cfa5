"""Time the baseline, the candidate and a control baseline side by side, each in its own process.

- Every round asks each child for one call. Rounds alternate between two orders
  (A B C, then A C B), so over two rounds each side follows each other side once and
  no side ever runs twice in a row: a process called back-to-back finds its own data
  still in cache and runs several percent faster, which would bias whichever side got
  the repeats. Drift (clocks, temperature, background load) hits every side alike.
- Every round's inputs are new: the judge makes them at the round, from a seed no child
  has seen, and writes them where every side reads them (runners.harness.arena). No
  input set of a later call exists anywhere a child can look, so nothing can be worked
  out ahead, and no call ever repeats an earlier one's inputs, so a cache of answers,
  however it is keyed, only ever misses.
- Warm-up calls are the first rounds, discarded here afterwards; the child runs every
  call the same way and cannot tell them apart.
- The candidate's output and inputs are read from its stopped process after calls picked
  at random here (the child cannot know which, nor that it happened), and after the last
  one: a candidate that changes once it is "being timed" is caught. On a CPU, where
  forward returns a fresh tensor every call, an output that shares memory with one of
  the previous two, or that changes when the next call runs, aliases them.
- Each request's round trip is measured on the judge's own clock. The baseline
  processes run the same harness code around their calls, so what their round trips
  leave beyond their reported times is the harness's own cost: a candidate whose calls
  leave clearly more did work its reported time does not show (or lied about the time).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from runners.harness import arena
from runners.harness.children import BASELINE, CANDIDATE, Child, ChildFailure, Reply, strided_span
from runners.harness.correctness import Feed, Observed, observe, output_bound, prepare
from runners.harness.seeds import derive_seed
from runners.harness.stats import median_ci, median_ci_relative_width
from runners.ops import DISTRIBUTIONS, Op, Workload

CONTROL = "control"  # the second baseline process: the A/A half of the comparison
SIDES = (BASELINE, CANDIDATE, CONTROL)

TIMING_DISTRIBUTION = DISTRIBUTIONS[0]
WARMUP_ROUNDS = 3
MIN_SAMPLES = 10
# The clock check compares medians of the judge's round trips, whose host-side jitter
# (tens of µs) dwarfs a GPU kernel of a few µs: on a GPU enough samples for that median
# to be known to a few µs, whatever the reported times' own convergence.
CLOCK_MIN_SAMPLES = {"cpu": MIN_SAMPLES, "cuda": 100}
# A decode step runs many kernels and the A/A floor of a single point rests on its own
# samples: more of them keep that floor from swallowing real effects.
STEP_MIN_SAMPLES = 30
MAX_SAMPLES = 5000
TARGET_CI = 0.01
# Convergence costs a sort of every sample; checking every few rounds keeps that small.
CHECK_EVERY = 10
REVALIDATE_RATE = 0.1
MAX_REVALIDATIONS = 4
# How much longer than their reported times a candidate's calls may take on the judge's
# clock beyond what the baseline processes' take (the upper end of their median's 95%
# CI) before the difference is work the times do not show: the largest of an absolute
# margin, a fraction of the harness's own cost around a call (which grows with the
# output, poisoned before every call) and a fraction of the call itself: of the
# baselines' reported time (on a GPU the host's view of a long call moves with the
# clocks) or of the candidate's call on the judge's own clock, whichever is longer (a
# call of 150-650 ms, an interpreted Triton kernel's on a CPU, leaves 0.1-0.17 ms more of
# its garbage and pages to the harness after it than a 1 ms torch call does). A lie
# within the margin earns nothing: significance adds the margin back to the candidate's
# time (runners.harness.evaluate). Above the spread between
# honest processes measured by bench/harness_overhead.py (docs/benchmarks.md): on a
# shared 2-core CPU A/A processes differed by up to 0.02 ms on 0.6 ms of overhead and
# 0.44 ms on 6 ms; on an H200 by up to 0.08 ms on 1.1 ms and 0.1 ms on a 7.3 ms call,
# and honest Triton and CuTe kernels left up to 0.051 ms more than the torch baseline
# (its GPU runs at other clocks, and the harness's hold before each call is counted in
# cycles).
EXCESS_MARGIN_MS = {"cpu": 0.05, "cuda": 0.01}
EXCESS_FRACTION = {"cpu": 0.1, "cuda": 0.08}
EXCESS_OF_CALL = 0.01


@dataclass
class SideTimes:
    reported: list[float] = field(default_factory=list)
    round_trips: list[float] = field(default_factory=list)
    # CPU time of the side's process during each request, read from outside.
    cpu: list[float] = field(default_factory=list)
    # On a GPU, how long the judge's own probe kernel waited right after each call.
    idle: list[float] = field(default_factory=list)


@dataclass
class Measurement:
    times: dict[str, SideTimes]
    # (input seed, call number, distribution, reading) of each observed candidate call.
    observed: list[tuple[int, int, str, Observed]]
    # Why the candidate's outputs alias each other, if they do.
    aliasing: str | None = None


def round_seed(secret_seed: int, workload: Workload, round_number: int) -> int:
    """The seed of one round's inputs: derived from the run's secret, drawn nowhere else."""
    return derive_seed(secret_seed, "timing", workload.name, round_number)


def _reported_ms(reply: Reply, child: Child) -> float:
    value = reply.header.get("ms")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ChildFailure("clock", f"reported times disagree with the judge's clock: the "
                                    f"{child.label} reported {str(value)[:40]} ms for a call", child.role)
    return float(value)


def _converged(times: Mapping[str, SideTimes]) -> bool:
    return all(median_ci_relative_width(side.reported) <= TARGET_CI for side in times.values())


def _storage(facts: object) -> tuple[int, int] | None:
    """[start, end) of the bytes a CPU output described by `facts` spans."""
    span = strided_span(facts)
    if span is None or not span or not isinstance(facts, dict) or facts.get("device") != "cpu":
        return None
    return facts["address"], facts["address"] + span


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class _Aliasing:
    """Watches the candidate's CPU outputs for memory shared between calls."""

    def __init__(self, candidate: Child, max_bytes: int) -> None:
        self.candidate = candidate
        self.max_bytes = max_bytes
        self.spans: list[tuple[int, tuple[int, int]]] = []
        # (call, facts, raw bytes) of the last observed output, read again after the next call.
        self.held: tuple[int, dict, torch.Tensor] | None = None
        self.problem: str | None = None

    def after_call(self, round_number: int, reply: Reply, observed: Observed | None) -> None:
        if self.problem is not None:
            return
        facts = reply.header.get("output")
        span = _storage(facts)
        if self.held is not None:
            call, held_facts, before = self.held
            self.held = None
            now = self.candidate.read_output(held_facts, self.max_bytes)
            if now is not None and not torch.equal(_raw(now), before):
                self.problem = (f"the output of timed call #{call + 1} changed while call "
                                f"#{round_number + 1} ran: forward writes into an output it "
                                "returned earlier")
                return
        if span is not None:
            for call, (start, end) in self.spans[-2:]:
                if span[0] < end and start < span[1]:
                    self.problem = (f"the output of timed call #{round_number + 1} shares memory "
                                    f"with the output of call #{call + 1}, which the caller still "
                                    "holds: forward must return a new tensor every call")
                    return
            self.spans.append((round_number, span))
        if observed is not None and observed.output is not None:
            self.held = (round_number, facts, _raw(observed.output).clone())


def measure_workload(
    op: Op,
    workload: Workload,
    position: int,
    children: Mapping[str, Child],
    *,
    feed: Feed,
    secret_seed: int,
    budget_s: float,
) -> Measurement:
    """Interleaved samples (ms) until every side's median is known to ±1% or the budget is spent."""
    slot = f"w{position}"
    first = op.make_inputs(workload, round_seed(secret_seed, workload, -1), TIMING_DISTRIBUTION)
    for child in children.values():
        prepare(child, feed, slot, first, f"preparing the timed calls of {workload.name}")
    entries = arena.layout(first)
    max_bytes = output_bound(first)
    # Where the child cannot see it: it cannot know which outputs will be looked at.
    picker = random.Random(derive_seed(secret_seed, "revalidate", workload.name))
    times = {side: SideTimes() for side in children}
    observed: list[tuple[int, int, str, Observed]] = []
    candidate = children[CANDIDATE]
    aliasing = _Aliasing(candidate, max_bytes) if workload.device == "cpu" else None

    def before(round_number: int) -> None:
        # A new input set every round, made now: no child has seen it or its seed.
        inputs = op.make_inputs(workload, round_seed(secret_seed, workload, round_number),
                                TIMING_DISTRIBUTION)
        feed.write(entries, inputs)

    picked: dict[int, bool] = {}
    last_reply: dict[int, Reply] = {}

    def after(side: str, round_number: int, reply: Reply) -> None:
        if side != CANDIDATE:
            return
        last_reply[0] = reply
        if round_number not in picked:
            picked[round_number] = len(observed) < MAX_REVALIDATIONS and picker.random() < REVALIDATE_RATE
        reading = None
        if picked[round_number]:
            reading = observe(candidate, reply, entries, max_bytes)
            observed.append((round_seed(secret_seed, workload, round_number), round_number,
                             TIMING_DISTRIBUTION, reading))
        if aliasing is not None:
            aliasing.after_call(round_number, reply, reading)

    rounds = _interleave(children, times, lambda round_number: slot,
                         f"a timed call of {workload.name}", budget_s=budget_s, before=before,
                         after=after, min_samples=CLOCK_MIN_SAMPLES[workload.device])
    if not observed or observed[-1][1] != rounds - 1:
        # The last call's output, read before the child runs again.
        observed.append((round_seed(secret_seed, workload, rounds - 1), rounds - 1,
                         TIMING_DISTRIBUTION, observe(candidate, last_reply[0], entries, max_bytes)))
    for child in children.values():
        child.request("drop", f"freeing the inputs of {workload.name}", slots=[slot])
    return Measurement(times=times, observed=observed,
                       aliasing=aliasing.problem if aliasing is not None else None)


@functools.cache
def round_orders(sides: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The orders of the rounds, in turn: every order of the sides once, so each side takes
    every place equally often (the first call after the judge's own work is not timed
    like the second), and arranged so that no side is called twice in a row across two
    rounds and each side follows each other equally often (a call right after one's own
    finds its caches warm)."""
    first, *others = itertools.permutations(sides)
    for rest in itertools.permutations(others):
        cycle = [first, *rest]
        joins = [(order[-1], cycle[(index + 1) % len(cycle)][0]) for index, order in enumerate(cycle)]
        if all(left != right for left, right in joins) and len(set(joins)) == len(joins):
            return cycle
    raise ValueError(f"no fair order of rounds for {len(sides)} sides")


def _interleave(
    children: Mapping[str, Child],
    times: dict[str, SideTimes],
    slot_of: Callable[[int], str],
    during: str,
    *,
    budget_s: float,
    before: Callable[[int], None] | None = None,
    after: Callable[[str, int, Reply], None] | None = None,
    min_samples: int = MIN_SAMPLES,
) -> int:
    """The timing loop the kernel and the end-to-end timings share: rounds of one call per
    side, in every order in turn, warm-up rounds dropped, until every side's median is known
    to ±1%, MAX_SAMPLES, or the budget. Returns the number of rounds run."""
    orders = round_orders(tuple(children))
    rounds = 0
    deadline = time.monotonic() + budget_s
    while True:
        slot = slot_of(rounds)
        if before is not None:
            before(rounds)
        for side in orders[rounds % len(orders)]:
            reply = children[side].request("run", during, slot=slot)
            elapsed = _reported_ms(reply, children[side])
            if rounds >= WARMUP_ROUNDS:
                times[side].reported.append(elapsed)
                times[side].round_trips.append(reply.round_trip_ms)
                times[side].cpu.append(reply.cpu_ms)
                times[side].idle.append(reply.idle_ms)
            if after is not None:
                after(side, rounds, reply)
        rounds += 1
        count = rounds - WARMUP_ROUNDS
        if count < min_samples:
            continue
        if count >= MAX_SAMPLES or time.monotonic() >= deadline:
            return rounds
        if count % CHECK_EVERY == 0 and _converged(times):
            return rounds


def measure_step(
    children: Mapping[str, Child],
    *,
    context_length: int,
    batch: int,
    seed: int,
    budget_s: float,
) -> dict[str, SideTimes]:
    """Interleaved samples (ms) of one decode step per side, for the end-to-end check.

    Each child builds the step once (same seed, so the same weights and caches on every
    side) and every call replays it: a server replays one graph per batch size, and the
    step's inputs are its own. Timed exactly like forward calls: the same requests, the
    same orders, warm-up, convergence rule and clock code in the child.
    """
    slot = f"e2e:ctx={context_length},m={batch}"
    point = f"the decode step at ctx={context_length}, batch {batch}"
    for child in children.values():
        child.request("e2e_prepare", f"building {point}", slot=slot,
                      context_length=context_length, batch=batch, seed=seed)
    times = {side: SideTimes() for side in children}
    _interleave(children, times, lambda round_number: slot, f"a timed run of {point}",
                budget_s=budget_s, min_samples=STEP_MIN_SAMPLES)
    for child in children.values():
        child.request("drop", f"freeing {point}", slots=[slot])
    return times


def median_overhead(sides: list[SideTimes]) -> float | None:
    """How much longer than reported the calls of these sides took on the judge's clock."""
    gaps = [trip - value for side in sides for trip, value in zip(side.round_trips, side.reported,
                                                                   strict=True)]
    return float(np.median(gaps)) if gaps else None


@dataclass(frozen=True)
class Excess:
    """How much longer beyond their reported times the candidate's calls took than the
    baseline processes' did, on the judge's clock: the lower end of the candidate's 95%
    CI of the median less the upper end of the baselines'. Above `margin_ms`, it fails."""

    lower_ms: float
    margin_ms: float


def clock_excess(candidate: SideTimes, baselines: list[SideTimes], *, device: str) -> Excess | None:
    reported = [value for side in baselines for value in side.reported]
    trips = [value for side in baselines for value in side.round_trips]
    if not candidate.reported or not reported:
        return None
    low, _ = median_ci([trip - value for trip, value in zip(candidate.round_trips, candidate.reported,
                                                               strict=True)])
    baseline_gaps = [trip - value for trip, value in zip(trips, reported, strict=True)]
    _, high = median_ci(baseline_gaps)
    margin = max(EXCESS_MARGIN_MS[device], EXCESS_FRACTION[device] * float(np.median(baseline_gaps)),
                 EXCESS_OF_CALL * max(float(np.median(reported)), float(np.median(candidate.round_trips))))
    return Excess(lower_ms=low - high, margin_ms=margin)


def clock_disagreement(candidate: SideTimes, baselines: list[SideTimes], *, device: str) -> str | None:
    """Does the candidate's process take longer than its reported times explain?

    On the judge's clock a call's round trip is its time plus the harness's fixed cost
    around it (the request, the wake-up, the reply), which the baseline processes pay
    too. A candidate whose calls leave clearly more beyond their reported times (by more
    than the margin past the upper end of the baselines' 95% CI of the median) did work
    its reported time does not show, or reported less than it took. On a GPU, so does
    one whose calls leave the GPU busier, as the judge's own probe kernel sees it.
    """
    excess = clock_excess(candidate, baselines, device=device)
    if excess is None:
        return None
    if excess.lower_ms > excess.margin_ms:
        return (f"reported times disagree with the judge's clock: the candidate's calls (median "
                f"{float(np.median(candidate.reported)):.4g} ms reported) take at least "
                f"{excess.lower_ms:.4g} ms longer beyond their reported times than the baseline "
                f"processes' do (margin {excess.margin_ms:.3g} ms): work the reported times do "
                "not show")
    idle = [value for value in candidate.idle if math.isfinite(value)]
    baseline_idle = [value for side in baselines for value in side.idle if math.isfinite(value)]
    if idle and baseline_idle:
        low, _ = median_ci(idle)
        _, high = median_ci(baseline_idle)
        if low > high + excess.margin_ms:
            return (f"the GPU was still busy with the candidate's work after its calls replied: "
                    f"a kernel of the judge's waited at least {low:.4g} ms after each, against at "
                    f"most {high:.4g} ms after the baseline processes' calls: work left running "
                    "past the reported time")
    return None
