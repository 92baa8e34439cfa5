"""Which points of a kernel's SPACE a sweep evaluates next: grid, random, or Optuna's TPE.

Grid and random sweeps are decided up front. A TPE sweep proposes a few points at a
time from what its earlier candidates measured: the Optuna study is rebuilt from the
sweep's recorded candidates on every call, so the database is the persisted study and a
sweep resumes after any restart with nothing else to restore.

Pure functions over plain values (no Django, no Celery): the services turn candidates
into `Trial`s and proposals into candidates.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from runners import space

GRID = "grid"
RANDOM = "random"
TPE = "tpe"
STRATEGIES = (GRID, RANDOM, TPE)

# TPE candidates in flight at once: enough to keep a couple of workers busy, few enough
# that each proposal has seen nearly every earlier result.
TPE_PARALLELISM = 2
# Random points before the model takes over; TPE's default (10) would leave a small
# sweep purely random.
TPE_STARTUP_TRIALS = 5
# The objective of a candidate without a usable speedup (rejected, failed): below any
# real geomean speedup, which is always positive.
FAILING_VALUE = 0.0
# Asks for a point not tried yet before falling back to an untried point at random
# (a converged model keeps proposing its best point).
MAX_ASKS = 16
# Spaces up to this size are enumerated to pick an untried point; larger ones sampled.
ENUMERABLE_POINTS = 100_000

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class Trial:
    """A point a sweep already has: its objective, or None while it is being evaluated."""

    params: Mapping[str, Any]
    value: float | None


def objective(*, verdict: str, geomean_speedup: float | None) -> float:
    """What the search maximises: the geomean speedup of a candidate that was not rejected."""
    if verdict == "rejected" or not geomean_speedup or geomean_speedup <= 0:
        return FAILING_VALUE
    return geomean_speedup


def batch_size(strategy: str, budget: int) -> int:
    """How many candidates a sweep keeps in flight: all of them, or TPE's few."""
    return TPE_PARALLELISM if strategy == TPE else budget


def space_size(parameter_space: Mapping[str, Sequence[Any]]) -> int:
    return math.prod(len(values) for values in parameter_space.values())


def point_key(point: Mapping[str, Any]) -> str:
    """One spelling per point: JSON, so a tuple in SPACE matches the list it is stored as."""
    return json.dumps(point, sort_keys=True)


def propose(strategy: str, parameter_space: Mapping[str, Sequence[Any]], *,
            history: Sequence[Trial], count: int, seed: int) -> list[dict[str, Any]]:
    """Up to `count` points of the space not in `history`, in the order to evaluate them.

    Deterministic for a given strategy, space, history and seed.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"no proposer for strategy {strategy!r}")
    checked = {key: list(values) for key, values in parameter_space.items()}
    tried = {point_key(trial.params) for trial in history}
    count = max(0, min(count, space_size(checked) - len(tried)))
    if count == 0:
        return []
    if strategy == TPE:
        return _tpe_points(checked, history, tried, count, seed)
    # With nothing tried (a sweep's start, where grid and random propose everything)
    # exactly the points the harness's own sweeps evaluate.
    points = space.sweep_points(checked, strategy, count + len(tried), seed)
    return [point for point in points if point_key(point) not in tried][:count]


def _positions(parameter_space: dict[str, list[Any]], point: Mapping[str, Any]) -> dict[str, int] | None:
    """The point as an index per parameter; None when it is not a point of this space."""
    if set(point) != set(parameter_space):
        return None
    positions = {}
    for key, values in parameter_space.items():
        spelled = [json.dumps(value) for value in values]
        wanted = json.dumps(point[key])
        if wanted not in spelled:
            return None
        positions[key] = spelled.index(wanted)
    return positions


def _tpe_points(parameter_space: dict[str, list[Any]], history: Sequence[Trial], tried: set[str],
                count: int, seed: int) -> list[dict[str, Any]]:
    # Categorical over each parameter's positions: SPACE values may be anything
    # literal (tuples, None), and TPE treats categories as unordered either way.
    distributions = {key: CategoricalDistribution(list(range(len(values))))
                     for key, values in parameter_space.items()}
    # The sampler's seed moves with the history, so a rebuilt study never replays the
    # random draws of an earlier call.
    rng = random.Random(f"{seed}:{len(history)}")
    sampler = optuna.samplers.TPESampler(
        seed=rng.randrange(2**32), n_startup_trials=TPE_STARTUP_TRIALS, multivariate=True,
        constant_liar=True,
    )
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for trial in history:
        positions = _positions(parameter_space, trial.params)
        if positions is None:
            continue  # not a point of this space: nothing the model can learn from
        # Points still being evaluated go in running: the constant liar steers new
        # proposals away from them.
        study.add_trial(create_trial(
            params=positions, distributions=distributions,
            state=TrialState.RUNNING if trial.value is None else TrialState.COMPLETE, value=trial.value,
        ))

    def point_at(positions: Mapping[str, int]) -> dict[str, Any]:
        return {key: parameter_space[key][positions[key]] for key in parameter_space}

    known = {point_key(t.params): t.value for t in history}
    points: list[dict[str, Any]] = []
    while len(points) < count:
        for _ in range(MAX_ASKS):
            asked = study.ask(distributions)
            point = point_at(asked.params)
            key = point_key(point)
            if key not in tried:
                break
            # Told again, a known point weighs more; a pending one stays running.
            if known.get(key) is not None:
                study.tell(asked, known[key])
        else:
            point = _untried_point(parameter_space, tried, rng)
            key = point_key(point)
            study.add_trial(create_trial(params=_positions(parameter_space, point),
                                         distributions=distributions, state=TrialState.RUNNING))
        tried.add(key)
        points.append(point)
    return points


def _untried_point(parameter_space: dict[str, list[Any]], tried: set[str], rng: random.Random) -> dict[str, Any]:
    if space_size(parameter_space) <= ENUMERABLE_POINTS:
        return rng.choice([p for p in space.grid_points(parameter_space) if point_key(p) not in tried])
    while True:  # tried is a vanishing fraction of a space this large
        (point,) = space.random_points(parameter_space, 1, rng.randrange(2**32))
        if point_key(point) not in tried:
            return point
