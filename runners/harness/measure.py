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
- Short calls are timed in batches: each request runs several calls, each on its own
  input set, and reports their total. What hides a small lie about a call's time is the
  harness's own cost of a request on the judge's clock (the wake-up, the reply, reading
  the child from outside) and its jitter, which a batch pays once, while the lie shows
  as many times over as the batch is long. How long a batch is follows from the baseline
  processes' calls alone (`batch_length`): the candidate has no say in it.
- The candidate's output and inputs are read from its stopped process after calls picked
  at random here (the child cannot know which, nor that it happened: one call of a
  picked request's batch, drawn here too), and after the last one: a candidate that
  changes once it is "being timed" is caught. On a CPU, where forward returns a fresh
  tensor every call, an output that shares memory with one the caller still holds (the
  calls of this request and of the one before), or that changes when the next request
  runs, aliases them.
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
from runners.harness.children import (BASELINE, CANDIDATE, Child, ChildFailure, Reply, Unreadable,
                                      strided_span)
from runners.harness.correctness import (Feed, Observed, observe, output_bound, output_facts, prepare,
                                         revalidate)
from runners.harness.memo import NO_MEMO, Memo
from runners.harness.seeds import derive_seed
from runners.harness.stats import (MIN_NOISE_FLOOR, cannot_be_significant, median_ci,
                                   median_ci_relative_width, median_ratio_ci)
from runners.ops import DISTRIBUTIONS, Op, Workload

CONTROL = "control"  # the second baseline process: the A/A half of the comparison
SIDES = (BASELINE, CANDIDATE, CONTROL)

TIMING_DISTRIBUTION = DISTRIBUTIONS[0]
WARMUP_ROUNDS = 3
# A batch is as many calls as make about this much of the baseline's time, at most
# MAX_BATCH, and as many as fit the inputs' memory side by side. A request's own cost on
# the judge's clock is 1-2.5 ms on a shared 2-core CPU; on an H200 about 1.3 ms, and
# about 0.1 ms more for each call a batch adds (its flush, poison and staged copy): an
# rmsnorm call of 0.048 ms (T=1024) goes 32 to a request.
BATCH_TARGET_MS = {"cpu": 4.0, "cuda": 1.5}
MAX_BATCH = 32
# The most memory the judge keeps in readings of timed calls (outputs and the inputs
# read back) before it checks them: at T=65536 fp32 a reading holds 2 GiB, and the
# judge held 39 GiB of them on an H200, beside three children of up to a quarter of the
# GPU each, until a child's allocation failed. Past it, the readings held so far are
# checked between two requests (while every child is stopped) and let go.
OBSERVED_BYTES = 8 * 2**30
# On a GPU at most this share of its memory: the judge has what three children at a
# quarter each leave, and on an H100 8 GiB of readings beside a timed set of the paged
# ops' 128K inputs ran the judge out of memory.
OBSERVED_SHARE_OF_GPU = 1 / 32
# Input memory a child is given beyond its largest input set, so that batches of short
# calls fit side by side (runners.harness.evaluate sizes it with batch_capacity).
BATCH_ARENA_BYTES = 64 * 2**20
# Rounds of one call each that time the baseline processes to size the batch; they run
# on every side, like any warm-up, so all three processes keep one history.
SIZING_ROUNDS = 2
MIN_SAMPLES = 10
# The clock check compares medians of the judge's round trips, whose host-side jitter
# (tens of µs) dwarfs a GPU kernel of a few µs: on a GPU enough samples for that median
# to be known to a few µs, whatever the reported times' own convergence.
CLOCK_MIN_SAMPLES = {"cpu": MIN_SAMPLES, "cuda": 100}
# Short calls, timed in batches, are where a lie hides in the request's own jitter: 10
# requests of 16 halved rmsnorm calls at T=64 left the CI's lower end 0.25 ms above the
# baselines', under a 0.28 ms margin, from a 1.2 ms lie. Their rounds cost little.
BATCHED_MIN_SAMPLES = 30
# A decode step runs many kernels and the A/A floor of a single point rests on its own
# samples: more of them keep that floor from swallowing real effects.
STEP_MIN_SAMPLES = 30
MAX_SAMPLES = 5000
TARGET_CI = 0.01
# Convergence costs a sort of every sample; checking every few rounds keeps that small.
CHECK_EVERY = 10
# The share of timed requests whose outputs (CALLS_READ_A_REQUEST calls, picked by the
# judge) are read and checked, for the whole run: a cap would tell a candidate that
# counted the reads (it can: a read from outside leaves its pages present in the child)
# when it may stop computing.
REVALIDATE_RATE = 0.1
# How many calls of an observed request are read (all of a shorter batch), taking the
# batch's slots in turn: a candidate wrong on one slot of 31 is read there within eight
# observed requests, not by luck (one call a request missed it 72% of the time over 10).
CALLS_READ_A_REQUEST = 4
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
# On a CPU 3% of the call: an honest candidate that sleeps 3 ms a call left 1.25 ms (2.1%)
# more than the baselines over a request of 16 calls, the harness's own work after each
# call running on the caches and clocks the call left.
EXCESS_MARGIN_MS = {"cpu": 0.05, "cuda": 0.01}
EXCESS_FRACTION = {"cpu": 0.1, "cuda": 0.08}
EXCESS_OF_CALL = {"cpu": 0.03, "cuda": 0.01}


@dataclass
class SideTimes:
    # Per request: the mean of its calls' reported times (what the statistics compare)...
    reported: list[float] = field(default_factory=list)
    # ... and the request's own round trip on the judge's clock, all its calls together.
    round_trips: list[float] = field(default_factory=list)
    # CPU time of the side's process during each request, read from outside.
    cpu: list[float] = field(default_factory=list)
    # On a GPU, how long the judge's own probe kernel waited right after each call.
    idle: list[float] = field(default_factory=list)
    # Calls per request.
    batch: int = 1

    def gaps(self) -> list[float]:
        """How much longer than its calls' reported times each request took on the judge's clock."""
        return [trip - self.batch * value for trip, value in zip(self.round_trips, self.reported,
                                                                 strict=True)]


@dataclass
class Measurement:
    times: dict[str, SideTimes]
    # (input seed, call number, distribution, reading) of each observed candidate call.
    observed: list[tuple[int, int, str, Observed]]
    # Why the candidate's outputs alias each other, if they do.
    aliasing: str | None = None
    # What the readings already checked during the timing found (see OBSERVED_BYTES).
    problems: list = field(default_factory=list)


def round_seed(secret_seed: int, workload: Workload, round_number: int, call: int = 0) -> int:
    """The seed of the inputs of one call of a round's batch: derived from the run's
    secret, drawn nowhere else."""
    return derive_seed(secret_seed, "timing", workload.name, round_number, call)


def _reported_ms(reply: Reply, child: Child) -> float:
    value = reply.header.get("ms")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ChildFailure("clock", f"reported times disagree with the judge's clock: the "
                                    f"{child.label} reported {str(value)[:40]} ms for a call", child.role)
    return float(value)


def _converged(times: Mapping[str, SideTimes]) -> bool:
    return all(median_ci_relative_width(side.reported) <= TARGET_CI for side in times.values())


def speedup_settled(times: Mapping[str, SideTimes], *, device: str) -> bool:
    """The stop rule of a workload's timing: the speedup (both baseline processes against
    the candidate) is known to ±TARGET_CI and so is the A/A pair's (a wide A/A CI would
    widen the noise floor it sets), or the speedup's CI lies inside the device's smallest
    noise floor, so no further sample could make it significant (the run's floor is never
    under MIN_NOISE_FLOOR). On a CPU, where that floor is 50%, the second ends most
    workloads at their minimum of samples; on a GPU the first decides."""
    baselines = times[BASELINE].reported + times[CONTROL].reported
    speedup = median_ratio_ci(baselines, times[CANDIDATE].reported)
    if cannot_be_significant(speedup, MIN_NOISE_FLOOR[device]):
        return True
    aa = median_ratio_ci(times[BASELINE].reported, times[CONTROL].reported)
    return all(_relative_half_width(ci) <= TARGET_CI for ci in (speedup, aa))


def _relative_half_width(ci: tuple[float, float]) -> float:
    low, high = ci
    return math.log(high / low) / 2 if low > 0 else math.inf


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

    def after_request(self, round_number: int, reply: Reply, observed: tuple[int, Observed] | None,
                      batch: int) -> None:
        """`observed`: which call of the request's batch was read, and what was."""
        if self.problem is not None:
            return
        first = round_number * batch  # calls are numbered across requests
        if self.held is not None:
            call, held_facts, before = self.held
            self.held = None
            now = self.candidate.read_output(held_facts, self.max_bytes)
            if now is not None and not torch.equal(_raw(now), before):
                self.problem = (f"the output of timed call #{call + 1} changed while calls "
                                f"#{first + 1}-#{first + batch} ran: forward writes into an "
                                "output it returned earlier")
                return
        for index in range(batch):
            span = _storage(output_facts(reply, index))
            if span is None:
                continue
            # Every call runs with the outputs of the 2 x batch calls before it alive
            # (runners.harness.timing), the caller's view of them.
            for call, (start, end) in self.spans[-(2 * batch):]:
                if span[0] < end and start < span[1]:
                    self.problem = (f"the output of timed call #{first + index + 1} shares memory "
                                    f"with the output of call #{call + 1}, which the caller still "
                                    "holds: forward must return a new tensor every call")
                    return
            self.spans.append((first + index, span))
        if observed is not None and observed[1].output is not None:
            index, reading = observed
            self.held = (first + index, output_facts(reply, index), _raw(reading.output).clone())


def measure_workload(
    op: Op,
    workload: Workload,
    position: int,
    children: Mapping[str, Child],
    *,
    feed: Feed,
    secret_seed: int,
    budget_s: float,
    capacity: int,
    memo: Memo = NO_MEMO,
) -> Measurement:
    """Interleaved samples (ms) until every side's median is known to ±1% or the budget
    is spent. `capacity`: the bytes of input memory each child has, which bounds how many
    input sets a batch can use."""
    first = memo.inputs(op, workload, round_seed(secret_seed, workload, -1), TIMING_DISTRIBUTION)
    layouts = [arena.layout(first)]
    slots = [f"w{position}:0"]
    for child in children.values():
        prepare(child, feed, slots[0], first, f"preparing the timed calls of {workload.name}")
    max_bytes = output_bound(first)

    def write_round(round_number: int) -> None:
        # A new input set for every call of every round, made now: no child has seen it
        # or its seed.
        for call, entries in enumerate(layouts):
            feed.write(entries, memo.inputs(op, workload, round_seed(secret_seed, workload, round_number, call),
                                            TIMING_DISTRIBUTION))

    sizing = {side: SideTimes() for side in children}
    _interleave(children, sizing, slots[:1], f"a timed call of {workload.name}", budget_s=0,
                before=lambda round_number: write_round(-2 - round_number),
                rounds=SIZING_ROUNDS, warmup=0)
    length = batch_length([*sizing[BASELINE].reported, *sizing[CONTROL].reported],
                          device=workload.device,
                          fits=capacity // arena.stride(layouts[0]))
    for call in range(1, length):
        layouts.append(arena.shifted(layouts[0], call * arena.stride(layouts[0])))
        slots.append(f"w{position}:{call}")
        inputs = memo.inputs(op, workload, round_seed(secret_seed, workload, -1, call), TIMING_DISTRIBUTION)
        for child in children.values():
            prepare(child, feed, slots[call], inputs, f"preparing the timed calls of {workload.name}",
                    entries=layouts[call])

    # Where the child cannot see it: it cannot know which outputs will be looked at.
    picker = random.Random(derive_seed(secret_seed, "revalidate", workload.name))
    times = {side: SideTimes(batch=length) for side in children}
    observed: list[tuple[int, int, str, Observed]] = []
    candidate = children[CANDIDATE]
    aliasing = _Aliasing(candidate, max_bytes) if workload.device == "cpu" else None
    picked: dict[int, list[int]] = {}
    last_reply: dict[int, Reply] = {}
    problems: list = []
    held = [0]  # bytes of the readings in `observed`
    limit = observed_limit(workload.device)
    # Which calls of an observed request are read: the next few of a secret order of the
    # batch's slots, over and over, so that a slot whose graph or answer is wrong is read
    # in the first few observed requests whichever slot it is.
    order = list(range(length))
    picker.shuffle(order)
    per_request = min(length, CALLS_READ_A_REQUEST)
    cursor = [0]

    def next_calls() -> list[int]:
        calls = [order[(cursor[0] + step) % length] for step in range(per_request)]
        cursor[0] += per_request
        return calls

    def after(side: str, round_number: int, reply: Reply) -> None:
        if side != CANDIDATE:
            return
        last_reply[0] = reply
        if round_number not in picked:
            picked[round_number] = next_calls() if picker.random() < REVALIDATE_RATE else []
        first = None
        for call in picked[round_number]:
            reading = observe(candidate, reply, layouts[call], max_bytes, index=call)
            observed.append((round_seed(secret_seed, workload, round_number, call), round_number,
                             TIMING_DISTRIBUTION, reading))
            first = first or (call, reading)
            held[0] += _held_bytes(reading)
        if not problems and held[0] > limit:
            problems.extend(revalidate(op, workload, observed, memo))
            observed.clear()
            held[0] = 0
            if workload.device == "cuda":
                # Back to the device, not only to the judge's allocator cache: the judge's
                # process held 55-60 GiB of the H200 through the timing at T=65536, beside
                # three children of 6 GiB (docs/benchmarks/h200/clock/aa_65536_twice.txt).
                torch.cuda.empty_cache()
        if aliasing is not None:
            aliasing.after_request(round_number, reply, first, length)

    rounds = _interleave(children, times, slots, f"a timed call of {workload.name}",
                         budget_s=budget_s, before=write_round, after=after,
                         min_samples=(CLOCK_MIN_SAMPLES[workload.device] if length == 1 else
                                      max(BATCHED_MIN_SAMPLES, CLOCK_MIN_SAMPLES[workload.device])),
                         orders_run=SIZING_ROUNDS,
                         settled=functools.partial(speedup_settled, device=workload.device))
    last = rounds - 1
    if not observed or observed[-1][1] != last:
        # Calls of the last request, read before the child runs again; which ones, the
        # candidate cannot know (not always the batch's last).
        for call in next_calls():
            observed.append((round_seed(secret_seed, workload, last, call), last, TIMING_DISTRIBUTION,
                             observe(candidate, last_reply[0], layouts[call], max_bytes, index=call)))
    for child in children.values():
        child.request("drop", f"freeing the inputs of {workload.name}", slots=slots)
    return Measurement(times=times, observed=[] if problems else observed,
                       aliasing=aliasing.problem if aliasing is not None else None, problems=problems)


def observed_limit(device: str) -> int:
    """The readings' bytes the judge holds before it checks them (see OBSERVED_BYTES)."""
    if device != "cuda":
        return OBSERVED_BYTES
    return min(OBSERVED_BYTES, int(torch.cuda.get_device_properties(0).total_memory * OBSERVED_SHARE_OF_GPU))


def _held_bytes(reading: Observed) -> int:
    tensors = [reading.output, *(reading.inputs_now or {}).values()]
    return sum(value.numel() * value.element_size() for value in tensors if isinstance(value, torch.Tensor))


def batch_capacity(largest_set: int, largest_timed_set: int) -> int:
    """The input memory every child gets: the largest input set of the evaluation, or
    room for a whole batch of the largest timed one within BATCH_ARENA_BYTES."""
    return max(largest_set, min(MAX_BATCH * largest_timed_set, BATCH_ARENA_BYTES))


def batch_length(baseline_ms: list[float], *, device: str, fits: int) -> int:
    """Calls per timed request: about BATCH_TARGET_MS of the baseline's time, at most
    MAX_BATCH and at most as many input sets as `fits` the inputs' memory. From the
    fastest of the sizing calls: the first replay of a new graph, or a GPU still at idle
    clocks, takes several times a call (a batch of 1-2 for a call of 0.05 ms on an H200,
    sized by the median)."""
    call = min(baseline_ms) if baseline_ms else math.inf
    wanted = math.ceil(BATCH_TARGET_MS[device] / call) if call > 0 else MAX_BATCH
    return max(1, min(MAX_BATCH, fits, wanted))


@functools.cache
def round_orders(sides: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The orders of the rounds, in turn: every order of the sides once, so each side takes
    every place equally often (the first call after the judge's own work is not timed
    like the second), and arranged so that no side is called twice in a row across two
    rounds and each side follows each other equally often (a call right after one's own
    finds its caches warm)."""
    if len(sides) < 3:
        # One side has one order; two sides alternate (one of them then runs twice in
        # a row across rounds, which no order of two avoids).
        return [tuple(sides), tuple(reversed(sides))][: max(1, len(sides))]
    if len(sides) > 3:
        return _williams_orders(sides)
    first, *others = itertools.permutations(sides)
    for rest in itertools.permutations(others):
        cycle = [first, *rest]
        joins = [(order[-1], cycle[(index + 1) % len(cycle)][0]) for index, order in enumerate(cycle)]
        if all(left != right for left, right in joins) and len(set(joins)) == len(joins):
            return cycle
    raise ValueError(f"no fair order of rounds for {len(sides)} sides")


def _williams_orders(sides: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Orders for four sides or more (a waterfall's stages), where trying every order is
    out of reach: a Williams design, in which each side takes every place once and
    follows every other side once (twice for an odd count, which needs the mirrored
    rows after them), and no side runs twice in a row across rounds."""
    n = len(sides)
    first = [0]
    for step in range(1, n):
        first.append((first[-1] + (step if step % 2 else -step)) % n)
    rows = [[(index + shift) % n for index in first] for shift in range(n)]
    if n % 2:
        rows += [list(reversed(row)) for row in rows]
    return [tuple(sides[index] for index in row) for row in rows]


def _interleave(
    children: Mapping[str, Child],
    times: dict[str, SideTimes],
    slots: list[str],
    during: str,
    *,
    budget_s: float,
    before: Callable[[int], None] | None = None,
    after: Callable[[str, int, Reply], None] | None = None,
    min_samples: int = MIN_SAMPLES,
    warmup: int = WARMUP_ROUNDS,
    rounds: int | None = None,
    orders_run: int = 0,
    settled: Callable[[Mapping[str, SideTimes]], bool] = _converged,
) -> int:
    """The timing loop the kernel and the end-to-end timings share: rounds of one request
    per side (one call per slot), in every order in turn, `warmup` rounds dropped, until
    the samples are `settled` (by default every side's median known to ±1%; a kernel
    workload's: speedup_settled), MAX_SAMPLES, or the budget, which caps it; or exactly
    `rounds` rounds. `orders_run`: rounds run just before, whose orders this loop
    continues (so no side runs twice in a row across them). Returns the number of rounds
    run."""
    orders = round_orders(tuple(children))
    done = 0
    deadline = time.monotonic() + budget_s
    while True:
        if before is not None:
            before(done)
        for side in orders[(orders_run + done) % len(orders)]:
            # Timed calls run on new inputs and are not poisoned (runners.harness.timing).
            reply = children[side].request("run", during, slots=slots, poison=False)
            elapsed = _reported_ms(reply, children[side])
            if done >= warmup:
                times[side].reported.append(elapsed / len(slots))
                times[side].round_trips.append(reply.round_trip_ms)
                times[side].cpu.append(reply.cpu_ms)
                times[side].idle.append(reply.idle_ms)
            if after is not None:
                after(side, done, reply)
        done += 1
        if rounds is not None:
            if done >= rounds:
                return done
            continue
        count = done - warmup
        if count < min_samples:
            continue
        if count >= MAX_SAMPLES or time.monotonic() >= deadline:
            return done
        if count % CHECK_EVERY == 0 and settled(times):
            return done


def measure_step(
    children: Mapping[str, Child],
    *,
    context_length: int,
    batch: int,
    seed: int,
    budget_s: float,
    output_bytes: int,
) -> tuple[dict[str, SideTimes], dict[str, torch.Tensor | None]]:
    """Interleaved samples (ms) of one decode step per side, for the end-to-end check,
    and each side's output of its last timed step, read from the stopped child (None
    where it cannot be read, or is larger than `output_bytes`).

    Each child builds the step once (same seed, so the same weights and caches on every
    side) and every call replays it: a server replays one graph per batch size, and the
    step's inputs are its own. Timed exactly like forward calls: the same requests, the
    same orders, warm-up, convergence rule and clock code in the child. Every side runs
    as many steps, so a step that carries state (the decode loop's caches) is at the
    same step on every side when the outputs are read.
    """
    slot = f"e2e:ctx={context_length},m={batch}"
    point = f"the decode step at ctx={context_length}, batch {batch}"
    for child in children.values():
        child.request("e2e_prepare", f"building {point}", slot=slot,
                      context_length=context_length, batch=batch, seed=seed)
    times = {side: SideTimes() for side in children}
    last: dict[str, Reply] = {}
    _interleave(children, times, [slot], f"a timed run of {point}",
                budget_s=budget_s, min_samples=STEP_MIN_SAMPLES,
                after=lambda side, _, reply: last.__setitem__(side, reply))
    outputs = {side: _read_step_output(children[side], last.get(side), output_bytes)
               for side in children}
    for child in children.values():
        child.request("drop", f"freeing {point}", slots=[slot])
    return times, outputs


def _read_step_output(child: Child, reply: Reply | None, max_bytes: int) -> torch.Tensor | None:
    facts = output_facts(reply) if reply is not None else None
    if not isinstance(facts, dict) or not facts.get("plain_tensor"):
        return None
    try:
        return child.read_output(facts, max_bytes)
    except Unreadable:
        return None


def median_overhead(sides: list[SideTimes]) -> float | None:
    """How much longer than reported the requests of these sides took on the judge's clock."""
    gaps = [gap for side in sides for gap in side.gaps()]
    return float(np.median(gaps)) if gaps else None


@dataclass(frozen=True)
class Excess:
    """How much longer beyond their reported times the candidate's requests took than the
    baseline processes' did, on the judge's clock: the lower end of the candidate's 95%
    CI of the median less the upper end of the baselines'. Above `margin_ms`, it fails.
    `upper_ms` is the other end: the candidate's upper end less the baselines' lower one.
    All are per request, of `batch` calls."""

    lower_ms: float
    margin_ms: float
    batch: int = 1
    upper_ms: float = 0.0

    @property
    def unseen_per_call_ms(self) -> float:
        """The largest lie a call could hide from the check: the margin, or as much more
        time beyond its reported one as the CIs leave possible, whichever is larger (with
        few samples on a loaded machine the second is: a check that cannot see a lie
        there must not credit what it might be)."""
        return max(self.margin_ms, self.upper_ms) / self.batch


def clock_excess(candidate: SideTimes, baselines: list[SideTimes], *, device: str) -> Excess | None:
    reported = [value for side in baselines for value in side.reported]
    if not candidate.reported or not reported:
        return None
    low, candidate_high = median_ci(candidate.gaps())
    baseline_gaps = [gap for side in baselines for gap in side.gaps()]
    baseline_low, high = median_ci(baseline_gaps)
    margin = max(EXCESS_MARGIN_MS[device], EXCESS_FRACTION[device] * float(np.median(baseline_gaps)),
                 EXCESS_OF_CALL[device] * max(candidate.batch * float(np.median(reported)),
                                      float(np.median(candidate.round_trips))))
    return Excess(lower_ms=low - high, margin_ms=margin, batch=candidate.batch,
                  upper_ms=candidate_high - baseline_low)


def clock_disagreement(candidate: SideTimes, baselines: list[SideTimes], *, device: str) -> str | None:
    """Does the candidate's process take longer than its reported times explain?

    On the judge's clock a request's round trip is its calls' time plus the harness's
    fixed cost around them (the request, the wake-up, the reply), which the baseline processes pay
    too. A candidate whose calls leave clearly more beyond their reported times (by more
    than the margin past the upper end of the baselines' 95% CI of the median) did work
    its reported time does not show, or reported less than it took. On a GPU, so does
    one whose calls leave the GPU busier, as the judge's own probe kernel sees it.
    """
    excess = clock_excess(candidate, baselines, device=device)
    if excess is None:
        return None
    if excess.lower_ms > excess.margin_ms:
        calls = f"requests of {candidate.batch} calls" if candidate.batch > 1 else "calls"
        return (f"reported times disagree with the judge's clock: the candidate's {calls} (median "
                f"{float(np.median(candidate.reported)):.4g} ms a call reported) take at least "
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
