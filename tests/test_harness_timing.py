"""The timing loop, the clock cross-check and the statistics that turn samples into a claim.

The loop is driven here with fake children that answer at once, so its schedule (who
runs when, on which inputs, which outputs are fetched) can be read off exactly.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from runners.harness import stats
from runners.harness.children import BASELINE, CANDIDATE, Reply
from runners.harness.measure import (
    CONTROL,
    MIN_SAMPLES,
    POOL_SIZE,
    WARMUP_ROUNDS,
    SideTimes,
    clock_disagreement,
    measure_workload,
)
from runners.ops import get_op


class FakeChild:
    def __init__(self, role, log, elapsed=lambda: 1.0):
        self.role = role
        self.label = f"{role} process"
        self.log = log
        self.elapsed = elapsed

    def request(self, do, during, *, max_bytes=0, **fields):
        self.log.append((self.role, do, fields))
        header = {"ok": True, "ms": self.elapsed()} if do == "run" else {"ok": True}
        return Reply(header, {}, 1.5)


def _measure(budget_s=0.0, elapsed=lambda: 1.0, seed=1):
    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [64])[0]
    log = []
    children = {role: FakeChild(role, log, elapsed) for role in (BASELINE, CANDIDATE, CONTROL)}
    measurement = measure_workload(op, workload, 0, children, secret_seed=seed, budget_s=budget_s)
    return measurement, log


def _runs(log):
    return [(role, fields["slot"]) for role, do, fields in log if do == "run"]


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


def test_each_side_takes_the_next_input_set_every_call_and_never_the_same_twice_in_a_row():
    _, log = _measure()
    for side in (BASELINE, CANDIDATE, CONTROL):
        slots = [slot for role, slot in _runs(log) if role == side]
        assert all(before != after for before, after in itertools.pairwise(slots))
        assert len(set(slots)) == POOL_SIZE


def test_every_side_loads_the_same_pool_from_seeds_and_frees_it_after():
    _, log = _measure()
    loads = {(role, fields["seed"]) for role, do, fields in log if do == "load"}
    seeds = {seed for _, seed in loads}
    assert len(seeds) == POOL_SIZE
    assert loads == {(role, seed) for role in (BASELINE, CANDIDATE, CONTROL) for seed in seeds}
    assert [do for _, do, _ in log[-3:]] == ["drop"] * 3


def test_warm_up_rounds_are_run_like_the_others_and_discarded_afterwards():
    measurement, log = _measure()
    rounds = MIN_SAMPLES + WARMUP_ROUNDS
    assert len(_runs(log)) == 3 * rounds
    assert all(len(times.reported) == MIN_SAMPLES for times in measurement.times.values())
    assert all(len(times.round_trips) == MIN_SAMPLES for times in measurement.times.values())


def test_every_side_sends_its_output_in_the_rounds_picked_and_only_the_candidates_is_kept():
    measurement, log = _measure(seed=4)
    timed = [(role, do) for role, do, _ in log if do in ("run", "fetch")]
    # Each fetch follows its own side's call at once, in every picked round alike (all
    # but the last, the candidate's after the loop).
    for index, (role, do) in enumerate(timed[:-1]):
        if do == "fetch":
            assert timed[index - 1] == (role, "run")
    last_round = MIN_SAMPLES + WARMUP_ROUNDS - 1
    picked = [call for _, call, _, _ in measurement.fetched if call != last_round]
    assert len(picked) == 3  # seed 4 picks rounds 2, 5 and 7
    per_side = Counter(role for role, do in timed if do == "fetch")
    assert per_side[BASELINE] == per_side[CONTROL] == len(picked)
    # The candidate's output of its last timed call is fetched after that call.
    candidate_runs = [index for index, (role, do) in enumerate(timed) if (role, do) == (CANDIDATE, "run")]
    assert timed[-1] == (CANDIDATE, "fetch") and len(timed) - 1 > candidate_runs[-1]
    assert measurement.fetched[-1][1] == last_round


def test_which_calls_are_fetched_depends_on_the_secret_seed():
    picks = {tuple(call for _, call, _, _ in _measure(seed=seed)[0].fetched) for seed in range(8)}
    assert len(picks) > 1


def test_it_keeps_sampling_while_the_medians_are_uncertain_and_the_budget_lasts():
    rng = np.random.default_rng(0)
    measurement, _ = _measure(budget_s=0.2, elapsed=lambda: float(rng.lognormal(0, 0.5)))
    assert len(measurement.times[CANDIDATE].reported) > 100


def test_it_stops_early_once_every_median_is_known_to_one_percent():
    measurement, _ = _measure(budget_s=10.0, elapsed=lambda: 1.0)
    assert len(measurement.times[CANDIDATE].reported) == MIN_SAMPLES


@pytest.mark.parametrize("reported", [0.0, -1.0, math.nan, "fast", True])
def test_a_reported_time_that_is_not_a_positive_number_fails_the_clock(reported):
    from runners.harness.children import ChildFailure

    with pytest.raises(ChildFailure) as caught:
        _measure(elapsed=lambda: reported)
    assert caught.value.guard == "clock"


def _times(reported, trips):
    return SideTimes(reported=list(reported), round_trips=list(trips))


def test_the_clock_check_believes_times_the_round_trips_allow():
    baselines = [_times([1.0] * 20, [1.3] * 20)] * 2
    assert clock_disagreement(_times([0.5] * 20, [0.8] * 20), baselines) is None


def test_the_clock_check_catches_a_child_reporting_a_fraction_of_its_time():
    baselines = [_times([1.0] * 20, [1.3] * 20)] * 2
    problem = clock_disagreement(_times([0.5] * 20, [5.3] * 20), baselines)
    assert problem.startswith("reported times disagree with the judge's clock")
    assert "0.3 ms overhead" in problem and "leave 5 ms" in problem


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
