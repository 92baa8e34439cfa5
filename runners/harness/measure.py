"""Time the baseline, the candidate and a control baseline side by side, each in its own process.

- Every round asks each child for one call. Rounds alternate between two orders
  (A B C, then A C B), so over two rounds each side follows each other side once and
  no side ever runs twice in a row: a process called back-to-back finds its own data
  still in cache and runs several percent faster, which would bias whichever side got
  the repeats. Drift (clocks, temperature, background load) hits every side alike.
- Each child holds a pool of input sets per workload, generated from seeds sent here, and
  takes the next one every call: never the same buffers twice in a row, so caching on
  pointers or shapes buys nothing.
- Warm-up calls are the first rounds, discarded here afterwards; the child runs every
  call the same way and cannot tell them apart.
- After calls picked at random here (the child cannot know which), and after the last
  one, the candidate's output is fetched for checking: a candidate that changes once it
  is "being timed" is caught.
- Each request's round trip is measured on the judge's own clock. A child whose reported
  times fall far below what its round trips leave, once the overhead seen on the trusted
  baseline is taken off, is not reporting the truth.
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

from runners.harness.children import BASELINE, CANDIDATE, Child, ChildFailure, Reply
from runners.harness.correctness import Fetched, fetch_output, output_bound
from runners.harness.seeds import derive_seed
from runners.harness.stats import median_ci_relative_width
from runners.ops import DISTRIBUTIONS, Op, Workload

CONTROL = "control"  # the second baseline process: the A/A half of the comparison
SIDES = (BASELINE, CANDIDATE, CONTROL)

POOL_SIZE = 5
TIMING_DISTRIBUTION = DISTRIBUTIONS[0]
WARMUP_ROUNDS = 3
MIN_SAMPLES = 10
# A decode step runs many kernels and the A/A floor of a single point rests on its own
# samples: more of them keep that floor from swallowing real effects.
STEP_MIN_SAMPLES = 30
MAX_SAMPLES = 5000
TARGET_CI = 0.01
# Convergence costs a sort of every sample; checking every few rounds keeps that small.
CHECK_EVERY = 10
REVALIDATE_RATE = 0.1
MAX_REVALIDATIONS = 4
# Reported below half of what the judge's clock allows, by more than noise: not believed.
CLOCK_RATIO = 0.5
CLOCK_SLACK_MS = 0.05


@dataclass
class SideTimes:
    reported: list[float] = field(default_factory=list)
    round_trips: list[float] = field(default_factory=list)


@dataclass
class Measurement:
    times: dict[str, SideTimes]
    # (seed, call number, distribution, output) of each fetched candidate output.
    fetched: list[tuple[int, int, str, Fetched]]


def pool_inputs(secret_seed: int, workload: Workload) -> list[tuple[int, str]]:
    """(seed, distribution) of each input set in a timing pool.

    One distribution for all: a call's time can depend on the values (rmsnorm in
    bfloat16 on CPU runs ~40% slower on the outlier distribution), and a pool mixing
    two speeds puts the median between two modes, where it jumps with every run.
    """
    return [(derive_seed(secret_seed, "timing", workload.name, index), TIMING_DISTRIBUTION)
            for index in range(POOL_SIZE)]


def _reported_ms(reply: Reply, child: Child) -> float:
    value = reply.header.get("ms")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ChildFailure("clock", f"reported times disagree with the judge's clock: the "
                                    f"{child.label} reported {str(value)[:40]} ms for a call", child.role)
    return float(value)


def _converged(times: Mapping[str, SideTimes]) -> bool:
    return all(median_ci_relative_width(side.reported) <= TARGET_CI for side in times.values())


def measure_workload(
    op: Op,
    workload: Workload,
    position: int,
    children: Mapping[str, Child],
    *,
    secret_seed: int,
    budget_s: float,
) -> Measurement:
    """Interleaved samples (ms) until every side's median is known to ±1% or the budget is spent."""
    pool = pool_inputs(secret_seed, workload)
    slots = [f"w{position}:{index}" for index in range(POOL_SIZE)]
    for slot, (seed, distribution) in zip(slots, pool, strict=True):
        for child in children.values():
            child.request("load", f"preparing timed inputs of {workload.name}",
                          slot=slot, workload=workload.to_dict(), seed=seed, distribution=distribution)
    max_bytes = output_bound(op.make_inputs(workload, pool[0][0], pool[0][1]))
    # Where the child cannot see it: it cannot know which outputs will be looked at.
    picker = random.Random(derive_seed(secret_seed, "revalidate", workload.name))
    times = {side: SideTimes() for side in children}
    fetched: list[tuple[int, int, str, Fetched]] = []
    candidate = children[CANDIDATE]

    picked: dict[int, bool] = {}

    def fetch(round_number: int) -> None:
        seed, distribution = pool[round_number % POOL_SIZE]
        output = fetch_output(candidate, f"sending the output of a timed call of {workload.name}",
                              max_bytes)
        fetched.append((seed, round_number, distribution, output))

    def after(side: str, round_number: int) -> None:
        if round_number not in picked:  # drawn at the round's first call
            picked[round_number] = len(fetched) < MAX_REVALIDATIONS and picker.random() < REVALIDATE_RATE
        if not picked[round_number]:
            return
        if side == CANDIDATE:
            fetch(round_number)
        else:
            # Sent and dropped: every process does what the candidate's does, so a
            # transfer that slows the next call slows every side alike.
            fetch_output(children[side], f"sending the output of a timed call of {workload.name}",
                         max_bytes)

    rounds = _interleave(children, times, lambda round_number: slots[round_number % POOL_SIZE],
                         f"a timed call of {workload.name}", budget_s=budget_s, after=after)
    if not fetched or fetched[-1][1] != rounds - 1:
        fetch(rounds - 1)
    for child in children.values():
        child.request("drop", f"freeing the inputs of {workload.name}", slots=slots)
    return Measurement(times=times, fetched=fetched)


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
    after: Callable[[str, int], None] | None = None,
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
        for side in orders[rounds % len(orders)]:
            reply = children[side].request("run", during, slot=slot)
            elapsed = _reported_ms(reply, children[side])
            if rounds >= WARMUP_ROUNDS:
                times[side].reported.append(elapsed)
                times[side].round_trips.append(reply.round_trip_ms)
            if after is not None:
                after(side, rounds)
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


def clock_disagreement(candidate: SideTimes, baselines: list[SideTimes]) -> str | None:
    """Compares what the candidate's child reported with the judge's own round trips.

    The overhead of a round trip (pipe, poisoning, cache flush) is what the trusted
    baseline children show between their round trips and their reported times.
    """
    gaps = [trip - reported for side in baselines
            for trip, reported in zip(side.round_trips, side.reported, strict=True)]
    if not gaps or not candidate.reported:
        return None
    overhead = float(np.median(gaps))
    judged = float(np.median(candidate.round_trips)) - overhead
    reported = float(np.median(candidate.reported))
    # How late a process wakes varies from one to the next as much as the overhead
    # itself on a busy machine: a shortfall within it is noise, not a lie.
    if reported < CLOCK_RATIO * judged - max(CLOCK_SLACK_MS, overhead):
        return (f"reported times disagree with the judge's clock: the candidate's median is "
                f"{reported:.4g} ms, but its round trips, less the {overhead:.4g} ms overhead "
                f"the baseline shows, leave {judged:.4g} ms")
    return None
