"""The timing loop, the clock cross-check and the statistics that turn samples into a claim.

The loop is driven here with fake children that answer at once, so its schedule (who
runs when, on which inputs, which outputs are read) can be read off exactly.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import mannwhitneyu

from runners.harness import arena, stats
from runners.harness.children import BASELINE, CANDIDATE, Reply
from runners.harness.measure import (
    BATCH_TARGET_MS,
    BATCHED_MIN_SAMPLES,
    CHECK_EVERY,
    CONTROL,
    MAX_BATCH,
    MIN_SAMPLES,
    SIZING_ROUNDS,
    WARMUP_ROUNDS,
    SideTimes,
    batch_length,
    clock_disagreement,
    clock_excess,
    measure_workload,
    speedup_settled,
)
from runners.harness.stats import MIN_NOISE_FLOOR
from runners.ops import get_op


class FakeFeed:
    """Records every input set the judge writes (the first element of x stands for it)."""

    def __init__(self, log):
        self.log = log

    def write(self, entries, inputs):
        self.log.append(("judge", "write", {"x0": float(inputs["x"].reshape(-1)[0])}))


class FakeChild:
    """Answers at once; `elapsed` is the time it reports for one call."""

    def __init__(self, role, log, elapsed=lambda: 1.0):
        self.role = role
        self.label = f"{role} process"
        self.log = log
        self.elapsed = elapsed
        self.calls = 0

    def request(self, do, during, *, max_bytes=0, **fields):
        self.log.append((self.role, do, fields))
        if do != "run":
            return Reply({"ok": True}, {}, 1.5)
        outputs = []
        for _ in fields["slots"]:
            # A new one-element output every call, somewhere new.
            self.calls += 1
            outputs.append({"type": "torch.Tensor", "tensor": True, "plain_tensor": True,
                            "device": "cpu", "dtype": "float32", "shape": [1], "strides": [1],
                            "layout": "torch.strided", "address": 4096 * (self.calls + 1)})
        times = [self.elapsed() for _ in fields["slots"]]
        total = times[0] if len(times) == 1 else sum(times)  # one call's: passed on as it is
        return Reply({"ok": True, "ms": total, "outputs": outputs}, {}, 1.5)

    def read_output(self, facts, max_bytes):
        self.log.append((self.role, "read", {}))
        return torch.zeros(1)

    def read_inputs(self, entries):
        return {}


def _measure(budget_s=0.0, elapsed=lambda: 1.0, seed=1, input_sets=1, candidate_elapsed=None):
    """`input_sets`: how many input sets the inputs' memory holds (1: no batches)."""
    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [64])[0]
    log = []
    children = {role: FakeChild(role, log, elapsed) for role in (BASELINE, CANDIDATE, CONTROL)}
    if candidate_elapsed is not None:
        children[CANDIDATE].elapsed = candidate_elapsed
    stride = arena.stride(arena.layout(op.make_inputs(workload, 0, "normal")))
    measurement = measure_workload(op, workload, 0, children, feed=FakeFeed(log), secret_seed=seed,
                                   budget_s=budget_s, capacity=input_sets * stride)
    return measurement, log


def _runs(log):
    return [(role, tuple(fields["slots"])) for role, do, fields in log if do == "run"]


def test_no_side_runs_twice_in_a_row_and_each_follows_each_other_side_alike():
    _, log = _measure()
    sides = [role for role, _ in _runs(log)]
    assert all(before != after for before, after in itertools.pairwise(sides))
    # Over whole cycles of six rounds (eighteen calls, eighteen transitions).
    followed = Counter(itertools.pairwise(sides[: (len(sides) - 1) // 18 * 18 + 1]))
    assert len(set(followed.values())) == 1 and len(followed) == 6


def test_every_side_takes_every_place_in_a_round_equally_often():
    _, log = _measure()
    sides = [role for role, _ in _runs(log)]
    rounds = [tuple(sides[start:start + 3]) for start in range(0, len(sides) // 18 * 18, 3)]
    assert len(rounds) >= 6 and len(set(rounds)) == 6  # every order of the three
    places = Counter((place, side) for order in rounds for place, side in enumerate(order))
    assert len(places) == 9 and len(set(places.values())) == 1


def test_every_round_gets_new_inputs_written_by_the_judge_before_any_side_runs():
    _, log = _measure()
    events = [(role, do, fields) for role, do, fields in log if do in ("write", "run")]
    # First the inputs every side prepares its slot on (written once for each), then one
    # new set per round (the rounds that size the batch first).
    rounds = SIZING_ROUNDS + MIN_SAMPLES + WARMUP_ROUNDS
    writes = [fields["x0"] for role, do, fields in events if do == "write"]
    assert len(writes) == 3 + rounds and len(set(writes[:3])) == 1
    assert len(set(writes[2:])) == 1 + rounds
    runs_after_write = []
    for role, do, _ in events[3:]:
        if do == "write":
            runs_after_write.append(0)
        else:
            runs_after_write[-1] += 1
    assert runs_after_write == [3] * rounds


def test_every_side_prepares_one_slot_once_and_frees_it_after():
    _, log = _measure()
    prepared = Counter(role for role, do, _ in log if do == "prepare")
    assert prepared == {BASELINE: 1, CANDIDATE: 1, CONTROL: 1}
    assert len({tuple(fields["slots"]) for _, do, fields in log if do == "run"}) == 1
    assert [do for _, do, _ in log[-3:]] == ["drop"] * 3


def test_warm_up_rounds_are_run_like_the_others_and_discarded_afterwards():
    measurement, log = _measure()
    rounds = SIZING_ROUNDS + MIN_SAMPLES + WARMUP_ROUNDS
    assert len(_runs(log)) == 3 * rounds
    assert all(len(times.reported) == MIN_SAMPLES for times in measurement.times.values())
    assert all(len(times.round_trips) == MIN_SAMPLES for times in measurement.times.values())


def test_only_the_candidates_outputs_are_read_right_after_its_calls_in_the_rounds_picked():
    measurement, log = _measure(seed=2)
    timed = [(role, do) for role, do, _ in log if do in ("run", "read")]
    # Every reading in the loop follows the candidate's own call at once (an earlier
    # output read again, to see that the call left it alone, comes right after it too).
    for index, (role, do) in enumerate(timed[:-1]):
        if do == "read":
            assert role == CANDIDATE and timed[index - 1][0] == CANDIDATE
    last_round = MIN_SAMPLES + WARMUP_ROUNDS - 1
    picked = [call for _, call, _, _ in measurement.observed if call != last_round]
    assert len(picked) == 2  # seed 2 picks rounds 2 and 7
    # The last call's output is read too, before the candidate runs again.
    candidates = [do for role, do in timed if role == CANDIDATE]
    assert measurement.observed[-1][1] == last_round and candidates[-2:] == ["run", "read"]


def test_short_calls_are_timed_in_batches_sized_by_the_baselines_alone():
    # The baselines take 1 ms a call; the candidate claims 0.001 ms, which would ask for
    # the longest batch if it had a say.
    measurement, log = _measure(input_sets=MAX_BATCH, candidate_elapsed=lambda: 0.001)
    batch = round(BATCH_TARGET_MS["cpu"] / 1.0)
    assert all(times.batch == batch for times in measurement.times.values())
    timed = [slots for _, slots in _runs(log)[3 * SIZING_ROUNDS:]]
    assert set(timed) == {tuple(f"w0:{call}" for call in range(batch))}
    # Each request's time is reported per call: the candidate's 0.001 ms, not batch x that.
    assert measurement.times[CANDIDATE].reported[0] == pytest.approx(0.001)
    assert measurement.times[BASELINE].reported[0] == pytest.approx(1.0)


def test_a_batch_is_only_as_long_as_the_inputs_memory_holds_and_never_past_its_cap():
    assert batch_length([1.0] * 4, device="cpu", fits=3) == 3
    assert batch_length([1e-6] * 4, device="cpu", fits=10**6) == MAX_BATCH
    assert batch_length([100.0] * 4, device="cpu", fits=10**6) == 1
    assert batch_length([], device="cpu", fits=10**6) == 1
    # A slow first call (a graph's first replay) does not shrink the batch.
    assert batch_length([40.0, 1.0, 35.0, 1.0], device="cpu", fits=10**6) == 4


def test_every_call_of_a_batch_gets_an_input_set_of_its_own_each_round():
    _, log = _measure(input_sets=MAX_BATCH)
    batch = round(BATCH_TARGET_MS["cpu"] / 1.0)
    events = [(role, do, fields) for role, do, fields in log if do in ("write", "run")]
    # From the inputs of the first batched round on (the prepares' writes come before).
    first = next(index for index, (_, do, fields) in enumerate(events)
                 if do == "run" and len(fields["slots"]) == batch)
    writes = [fields["x0"] for _, do, fields in events[first - batch:] if do == "write"]
    assert len(writes) == batch * (max(MIN_SAMPLES, BATCHED_MIN_SAMPLES) + WARMUP_ROUNDS)
    assert len(set(writes)) == len(writes)  # no call's inputs repeat another's


def test_one_call_of_a_picked_batch_is_read_with_its_own_inputs_seed():
    from runners.harness.measure import round_seed

    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [64])[0]
    batch = round(BATCH_TARGET_MS["cpu"] / 1.0)
    seen = set()
    for seed in range(8):
        measurement, _ = _measure(seed=seed, input_sets=MAX_BATCH)
        for input_seed, round_number, _, _ in measurement.observed:
            call = next(call for call in range(batch)
                        if round_seed(seed, workload, round_number, call) == input_seed)
            seen.add(call)
    assert len(seen) > 1  # not always the same call of the batch


def test_a_lie_about_each_call_shows_on_the_clock_as_many_times_as_the_batch_is_long():
    rng = np.random.default_rng(5)
    # A request's own cost: 1.3 ms, jittering by 0.05 ms. A lie of 0.02 ms a call.
    def side(reported, batch, lie=0.0):
        trips = _jittered(rng, 1.3 + batch * (reported + lie), 60, 0.05)
        return SideTimes(reported=[reported] * 60, round_trips=trips, batch=batch)

    single = [side(0.2, 1), side(0.2, 1)]
    assert clock_disagreement(side(0.2, 1, lie=0.02), single, device="cpu") is None
    batched = [side(0.2, 20), side(0.2, 20)]
    assert clock_disagreement(side(0.2, 20), batched, device="cpu") is None
    problem = clock_disagreement(side(0.2, 20, lie=0.02), batched, device="cpu")
    assert "requests of 20 calls" in problem


def test_what_the_check_cannot_rule_out_is_credited_to_no_call():
    rng = np.random.default_rng(7)
    # A loaded machine: requests jitter by 1 ms, 10 samples; a lie of 0.08 ms a call in
    # batches of 16 (1.3 ms a request) the check cannot tell from that noise.
    def side(lie=0.0):
        return SideTimes(reported=[0.2] * 10, batch=16,
                         round_trips=_jittered(rng, 2.0 + 16 * (0.2 + lie), 10, 1.0))

    baselines = [side(), side()]
    liar = side(lie=0.08)
    assert clock_disagreement(liar, baselines, device="cpu") is None
    excess = clock_excess(liar, baselines, device="cpu")
    # What a call could have hidden: at least its lie, not just the margin's share.
    assert excess.margin_ms / 16 < 0.08 < excess.unseen_per_call_ms


def test_which_calls_are_read_depends_on_the_secret_seed():
    picks = {tuple(call for _, call, _, _ in _measure(seed=seed)[0].observed) for seed in range(8)}
    assert len(picks) > 1


def test_it_keeps_sampling_while_the_speedup_could_still_be_significant_until_the_budget():
    # 1.6x faster, beyond the CPU's 50% floor, but too noisy to know it to 1%: only the
    # budget ends it.
    rng = np.random.default_rng(0)
    started = time.monotonic()
    measurement, _ = _measure(budget_s=0.5, elapsed=lambda: float(rng.lognormal(0, 0.5)),
                              candidate_elapsed=lambda: float(rng.lognormal(0, 0.5)) / 1.6)
    assert time.monotonic() - started >= 0.5
    assert len(measurement.times[CANDIDATE].reported) > MIN_SAMPLES
    assert not speedup_settled(measurement.times, device="cpu")


def test_on_a_cpu_it_stops_once_the_speedup_cannot_reach_the_noise_floor():
    """No sample more could make it significant: the rule ends it, long before the budget."""
    rng = np.random.default_rng(0)
    measurement, _ = _measure(budget_s=60.0, elapsed=lambda: float(rng.lognormal(0, 0.5)))
    times = measurement.times
    count = len(times[CANDIDATE].reported)
    assert MIN_SAMPLES <= count < 500 and count % CHECK_EVERY == 0  # checked, not the budget
    baselines = times[BASELINE].reported + times[CONTROL].reported
    low, high = stats.median_ratio_ci(baselines, times[CANDIDATE].reported)
    assert 1 / (1 + MIN_NOISE_FLOOR["cpu"]) < low and high < 1 + MIN_NOISE_FLOOR["cpu"]
    # At the check before, it could still have been: the rule waited for it.
    earlier = {side: SideTimes(reported=side_times.reported[:count - CHECK_EVERY])
               for side, side_times in times.items()}
    assert count == MIN_SAMPLES or not speedup_settled(earlier, device="cpu")


def _sides(rng, *, candidate_scale=1.0, control_spread=0.002, spread=0.002, n=400):
    return {BASELINE: SideTimes(reported=list(rng.lognormal(0, spread, n))),
            CONTROL: SideTimes(reported=list(rng.lognormal(0, control_spread, n))),
            CANDIDATE: SideTimes(reported=list(rng.lognormal(0, spread, n) * candidate_scale))}


def test_on_a_gpu_a_speedup_known_to_one_percent_settles_once_the_a_a_pair_is_too():
    rng = np.random.default_rng(3)
    # 3% faster, both CIs well within ±1%.
    assert speedup_settled(_sides(rng, candidate_scale=1 / 1.03), device="cuda")
    # The same speedup beside an A/A pair known only to a few percent: its floor would
    # be wide, so the rule goes on.
    assert not speedup_settled(_sides(rng, candidate_scale=1 / 1.03, control_spread=0.3),
                               device="cuda")
    # The speedup itself known only to a few percent, beyond the GPU's 0.5% floor.
    assert not speedup_settled(_sides(rng, candidate_scale=1 / 1.03, spread=0.15), device="cuda")


def test_on_a_cpu_the_same_uncertain_speedup_settles_inside_its_floor():
    rng = np.random.default_rng(3)
    sides = _sides(rng, candidate_scale=1 / 1.03, spread=0.15)
    assert not speedup_settled(sides, device="cuda")
    assert speedup_settled(sides, device="cpu")


def test_the_quick_ratio_ci_tracks_the_bootstrap_ci_the_result_reports():
    rng = np.random.default_rng(5)
    for spread, n in ((0.05, 30), (0.3, 100), (0.02, 1000)):
        base, cand = rng.lognormal(0, spread, n), rng.lognormal(0, spread, n) / 1.1
        quick = stats.median_ratio_ci(base, cand)
        boot = stats.compare(base, cand, rng=np.random.default_rng(0), noise=0.0).speedup_ci
        assert quick[0] < float(np.median(base) / np.median(cand)) < quick[1]
        width = lambda ci: math.log(ci[1] / ci[0])  # noqa: E731
        assert 0.5 < width(quick) / width(boot) < 2.5, (spread, n, quick, boot)


def test_it_stops_early_once_every_median_is_known_to_one_percent():
    measurement, _ = _measure(budget_s=10.0, elapsed=lambda: 1.0)
    assert len(measurement.times[CANDIDATE].reported) == MIN_SAMPLES


@pytest.mark.parametrize("reported", [0.0, -1.0, math.nan, "fast", True])
def test_a_reported_time_that_is_not_a_positive_number_fails_the_clock(reported):
    from runners.harness.children import ChildFailure

    with pytest.raises(ChildFailure) as caught:
        _measure(elapsed=lambda: reported)
    assert caught.value.guard == "clock"


def _times(reported, trips, idle=()):
    return SideTimes(reported=list(reported), round_trips=list(trips), idle=list(idle))


def _jittered(rng, value, count=40, spread=0.02):
    return list(value + rng.normal(0, spread, count))


def test_the_clock_check_believes_a_candidate_whose_calls_cost_what_the_baselines_do():
    rng = np.random.default_rng(1)
    baselines = [_times([1.0] * 40, _jittered(rng, 1.3)) for _ in range(2)]
    # Faster, and the same 0.3 ms of the harness's own around each call.
    assert clock_disagreement(_times([0.5] * 40, _jittered(rng, 0.8)), baselines, device="cpu") is None


def test_the_clock_check_catches_a_child_reporting_less_than_its_calls_take():
    rng = np.random.default_rng(2)
    baselines = [_times([1.0] * 40, _jittered(rng, 1.3)) for _ in range(2)]
    # Reports 0.5 ms for calls that take 1.5 ms of the judge's clock beyond the harness's
    # own 0.3 ms: a lie of 1 ms, far beyond the CPU's margin.
    problem = clock_disagreement(_times([0.5] * 40, _jittered(rng, 1.8)), baselines, device="cpu")
    assert problem.startswith("reported times disagree with the judge's clock")
    assert "longer beyond their reported times than the baseline processes' do (margin 0.05" in problem
    excess = clock_excess(_times([0.5] * 40, _jittered(rng, 1.8)), baselines, device="cpu")
    # The margin: 3% of the candidate's 1.8 ms on the judge's clock, above the 0.05 ms floor.
    assert 0.9 < excess.lower_ms < 1.0 and excess.margin_ms == pytest.approx(0.054, abs=0.002)


def test_the_clock_check_catches_a_lie_just_beyond_its_margin_and_believes_one_within():
    rng = np.random.default_rng(4)
    baselines = [_times([1.0] * 200, _jittered(rng, 1.3, 200, 0.005)) for _ in range(2)]
    within = _times([0.98] * 200, _jittered(rng, 1.3, 200, 0.005))  # 0.02 ms off: believed
    beyond = _times([0.9] * 200, _jittered(rng, 1.3, 200, 0.005))  # 0.1 ms off: not
    assert clock_disagreement(within, baselines, device="cpu") is None
    assert clock_disagreement(beyond, baselines, device="cpu") is not None


def test_the_clock_check_catches_gpu_work_left_running_past_the_reply():
    rng = np.random.default_rng(3)
    baselines = [_times([1.0] * 40, _jittered(rng, 1.3, spread=0.001),
                        _jittered(rng, 0.11, spread=0.002)) for _ in range(2)]
    honest = _times([0.5] * 40, _jittered(rng, 0.8, spread=0.001), _jittered(rng, 0.11, spread=0.002))
    leaves_work = _times([0.5] * 40, _jittered(rng, 0.8, spread=0.001), _jittered(rng, 0.29, spread=0.002))
    assert clock_disagreement(honest, baselines, device="cuda") is None
    problem = clock_disagreement(leaves_work, baselines, device="cuda")
    assert problem.startswith("the GPU was still busy with the candidate's work after its calls replied")


def test_the_median_ci_brackets_the_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    few, many = rng.normal(10, 1, 20), rng.normal(10, 1, 2000)
    for samples in (few, many):
        low, high = stats.median_ci(samples)
        assert low <= np.median(samples) <= high
    assert stats.median_ci_relative_width(many) < stats.median_ci_relative_width(few)


@pytest.mark.parametrize("shift", [0.0, 0.02, 0.2])
def test_the_rank_test_agrees_with_scipy(shift):
    rng = np.random.default_rng(11)
    a, b = np.round(rng.normal(1, 0.1, 80), 2), np.round(rng.normal(1 + shift, 0.1, 60), 2)
    expected = mannwhitneyu(a, b, alternative="two-sided", method="asymptotic").pvalue
    assert stats.mann_whitney_p(a, b) == pytest.approx(expected, rel=1e-9)


def test_identical_distributions_are_not_significant():
    rng = np.random.default_rng(2)
    found = stats.compare(rng.normal(1.0, 0.05, 300), rng.normal(1.0, 0.05, 300),
                          rng=np.random.default_rng(3), noise=0.005)
    assert found.speedup == pytest.approx(1.0, abs=0.02)
    assert not found.significant


def test_a_clearly_faster_candidate_is_significant_with_a_ci_above_one():
    rng = np.random.default_rng(4)
    found = stats.compare(rng.normal(1.0, 0.02, 50), rng.normal(0.8, 0.02, 50),
                          rng=np.random.default_rng(5), noise=0.01)
    assert found.speedup == pytest.approx(1.25, rel=0.03)
    assert found.significant and found.speedup_ci[0] > 1 and found.p_value < 0.01


def test_an_effect_inside_the_noise_floor_is_not_significant_however_certain():
    rng = np.random.default_rng(6)
    found = stats.compare(rng.normal(1.0, 0.001, 2000), rng.normal(0.97, 0.001, 2000),
                          rng=np.random.default_rng(7), noise=0.04)
    assert found.p_value < 0.01 and found.speedup_ci[0] > 1
    assert not found.significant


def test_a_significant_slowdown_is_significant_with_a_speedup_below_one():
    rng = np.random.default_rng(8)
    found = stats.compare(rng.normal(1.0, 0.02, 50), rng.normal(1.3, 0.02, 50),
                          rng=np.random.default_rng(9), noise=0.01)
    assert found.significant and found.speedup < 1 and found.speedup_ci[1] < 1


def test_a_floor_above_one_still_lets_a_larger_slowdown_count_as_it_would_a_speedup():
    # A loaded machine: the two baseline processes differed by 2.5x. A 100x slowdown is
    # real; a 2x one is within that noise, in either direction alike.
    rng = np.random.default_rng(12)
    base = rng.normal(1.0, 0.01, 40)
    slower = stats.compare(base, rng.normal(100.0, 1.0, 40), rng=np.random.default_rng(13), noise=1.5)
    faster = stats.compare(base, rng.normal(0.01, 0.0001, 40), rng=np.random.default_rng(14), noise=1.5)
    within = stats.compare(base, rng.normal(2.0, 0.02, 40), rng=np.random.default_rng(15), noise=1.5)
    assert slower.significant and slower.speedup < 0.011
    assert faster.significant and faster.speedup > 90
    assert not within.significant and within.p_value < 0.01


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_noise_floor_is_the_a_a_effect_plus_its_ci_and_never_below_the_devices(device):
    rng = np.random.default_rng(10)
    same = rng.normal(1.0, 0.0001, 500)
    minimum = stats.MIN_NOISE_FLOOR[device]
    floors = stats.noise_floors([(same, same.copy())], rngs=[np.random.default_rng(1)], minimum=minimum)
    assert floors[0].speedup == 1.0 and floors[0].floor == minimum >= stats.MIN_EFFECT
    apart = stats.noise_floors([(rng.normal(1.05, 0.01, 500), rng.normal(1.0, 0.01, 500))],
                               rngs=[np.random.default_rng(2)], minimum=stats.MIN_EFFECT)[0]
    low, high = apart.speedup_ci
    assert apart.floor >= abs(1 - apart.speedup) + (high - low) / 2
    assert apart.floor == pytest.approx(0.05, abs=0.01) or apart.floor > 0.05


def test_a_quiet_workload_inherits_the_runs_typical_a_a_spread():
    rng = np.random.default_rng(12)
    quiet = (rng.normal(1.0, 0.001, 300), rng.normal(1.0, 0.001, 300))
    noisy = (rng.normal(1.08, 0.001, 300), rng.normal(1.0, 0.001, 300))
    floors = stats.noise_floors([quiet, noisy], rngs=[np.random.default_rng(i) for i in range(2)],
                                minimum=stats.MIN_EFFECT)
    spread = math.sqrt((math.log(floors[0].speedup) ** 2 + math.log(floors[1].speedup) ** 2) / 2)
    assert floors[0].floor == pytest.approx(stats.RUN_SPREAD_FACTOR * spread)
    assert floors[0].floor > 0.1
