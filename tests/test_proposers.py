"""Proposers: which points a sweep evaluates next (no database, no harness)."""

from __future__ import annotations

import math
import statistics

import pytest

from research import proposers
from research.proposers import Trial, point_key, propose

SPACE = {"block": [16, 32, 64, 128, 256], "warps": [1, 2, 4, 8], "layout": ["row", "col", (2, 2)]}

# A synthetic tuning problem with one known optimum: 4 parameters × 6 values (1296
# points), the objective a smooth bump around the optimum's position in each list, so a
# model that learns which values do well per parameter homes in on it.
BENCH_SPACE = {
    "block": [16, 32, 64, 128, 256, 512],
    "warps": [1, 2, 4, 8, 16, 32],
    "stages": [1, 2, 3, 4, 5, 6],
    "split": [1, 2, 4, 8, 16, 32],
}
OPTIMUM = {"block": 128, "warps": 4, "stages": 3, "split": 8}
BENCH_SEEDS = range(8)


def synthetic_speedup(point: dict) -> float:
    distance = sum((BENCH_SPACE[k].index(point[k]) - BENCH_SPACE[k].index(OPTIMUM[k])) ** 2 for k in BENCH_SPACE)
    return 2.0 * math.exp(-distance / 8)


def evaluations_to_optimum(strategy: str, seed: int) -> int:
    """Run a sweep of the whole space the way the services do (propose a batch, record
    every result, propose again) until the optimum is evaluated."""
    size = proposers.space_size(BENCH_SPACE)
    history: list[Trial] = []
    while len(history) < size:
        batch = propose(strategy, BENCH_SPACE, history=history, seed=seed,
                        count=proposers.batch_size(strategy, size))
        for point in batch:
            history.append(Trial(point, synthetic_speedup(point)))
            if point == OPTIMUM:
                return len(history)
    raise AssertionError("the sweep covered the whole space without evaluating the optimum")


def _keys(points):
    return [point_key(p) for p in points]


@pytest.mark.parametrize("strategy", proposers.STRATEGIES)
def test_every_proposed_point_is_a_point_of_the_space(strategy):
    points = propose(strategy, SPACE, history=[], count=12, seed=3)
    assert len(points) == 12
    for point in points:
        assert set(point) == set(SPACE) and all(point[k] in SPACE[k] for k in SPACE)


@pytest.mark.parametrize("strategy", proposers.STRATEGIES)
def test_a_proposer_never_proposes_a_point_already_tried(strategy):
    tried = propose("random", SPACE, history=[], count=20, seed=11)
    # Recorded, failed and still-running points alike; params come back from JSON as lists.
    history = [Trial({**p, "layout": list(p["layout"]) if isinstance(p["layout"], tuple) else p["layout"]},
                     [1.2, proposers.FAILING_VALUE, None][i % 3]) for i, p in enumerate(tried)]
    points = propose(strategy, SPACE, history=history, count=20, seed=5)
    assert len(points) == 20 and len(set(_keys(points))) == 20
    assert not set(_keys(points)) & set(_keys(tried))


def test_tpe_exhausts_the_space_without_a_repeat_and_then_proposes_nothing():
    size = proposers.space_size(SPACE)
    history: list[Trial] = []
    while batch := propose("tpe", SPACE, history=history, count=2, seed=1):
        history += [Trial(p, 1.0 + 0.01 * len(history)) for p in batch]
    assert len(history) == size and len(set(_keys(t.params for t in history))) == size


@pytest.mark.parametrize("strategy", proposers.STRATEGIES)
def test_the_same_seed_and_history_propose_the_same_points(strategy):
    history = [Trial(p, 1.0 + i / 10) for i, p in enumerate(propose("random", SPACE, history=[], count=8, seed=2))]
    first = propose(strategy, SPACE, history=history, count=3, seed=42)
    assert propose(strategy, SPACE, history=history, count=3, seed=42) == first
    if strategy != "grid":
        assert any(propose(strategy, SPACE, history=history, count=3, seed=s) != first for s in (1, 2, 3))


def test_grid_and_random_start_with_the_points_the_harness_sweeps():
    from runners import space

    assert propose("grid", SPACE, history=[], count=7, seed=0) == space.grid_points(SPACE)[:7]
    assert propose("random", SPACE, history=[], count=7, seed=9) == space.random_points(SPACE, 7, 9)


def test_a_rejected_or_failed_candidate_scores_below_any_real_speedup():
    assert proposers.objective(verdict="rejected", geomean_speedup=3.0) == proposers.FAILING_VALUE
    assert proposers.objective(verdict="no-gain", geomean_speedup=None) == proposers.FAILING_VALUE
    assert proposers.FAILING_VALUE < proposers.objective(verdict="no-gain", geomean_speedup=0.2) == 0.2


def test_tpe_reaches_a_known_optimum_in_fewer_evaluations_than_random_on_average():
    tpe = [evaluations_to_optimum("tpe", seed) for seed in BENCH_SEEDS]
    random = [evaluations_to_optimum("random", seed) for seed in BENCH_SEEDS]
    print(f"evaluations to the optimum of {proposers.space_size(BENCH_SPACE)} points over seeds "
          f"{list(BENCH_SEEDS)}: tpe {tpe} (mean {statistics.mean(tpe):.1f}), "
          f"random {random} (mean {statistics.mean(random):.1f})")
    # Random needs half the space on average (648 evaluations); TPE a small fraction.
    assert statistics.mean(tpe) * 4 < statistics.mean(random)
