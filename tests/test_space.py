from __future__ import annotations

import ast
import math

import pytest

from runners.space import grid_points, materialize, random_points, read_literals

SPACE = {"block": [64, 256, 1024], "mode": ["a", "b"], "fused": [True, False]}

CANDIDATE = '''"""A tunable candidate — with a non-ASCII docstring, so offsets are in bytes."""

from __future__ import annotations

PARAMS = {"block": 64, "mode": "a", "fused": True}

SPACE = {
    "block": [64, 256, 1024],
    "mode": ["a", "b"],
    "fused": [True, False],
}


def forward(x):
    return x * PARAMS["block"]
'''


def test_grid_points_enumerates_every_combination_with_the_last_key_fastest():
    points = grid_points(SPACE)
    assert len(points) == math.prod(len(values) for values in SPACE.values())
    assert points[0] == {"block": 64, "mode": "a", "fused": True}
    assert points[1] == {"block": 64, "mode": "a", "fused": False}
    assert points[-1] == {"block": 1024, "mode": "b", "fused": False}
    assert len({tuple(point.items()) for point in points}) == len(points)


def test_grid_points_are_the_same_on_every_call():
    assert grid_points(SPACE) == grid_points(dict(SPACE))


def test_grid_points_rejects_an_empty_value_list():
    with pytest.raises(ValueError, match="non-empty list"):
        grid_points({"block": []})


def test_random_points_are_distinct_points_of_the_grid():
    grid = grid_points(SPACE)
    points = random_points(SPACE, 5, seed=7)
    assert len(points) == 5
    assert all(point in grid for point in points)
    assert len({tuple(point.items()) for point in points}) == 5


def test_random_points_depend_only_on_the_seed():
    assert random_points(SPACE, 4, seed=1) == random_points(SPACE, 4, seed=1)
    assert random_points(SPACE, 4, seed=1) != random_points(SPACE, 4, seed=2)


def test_random_points_never_return_more_than_the_grid():
    points = random_points(SPACE, 100, seed=0)
    assert sorted(map(repr, points)) == sorted(map(repr, grid_points(SPACE)))


def test_random_points_sample_a_huge_space_without_enumerating_it():
    huge = {f"p{i}": list(range(10)) for i in range(30)}
    points = random_points(huge, 3, seed=0)
    assert len(points) == 3 and all(len(point) == 30 for point in points)


def test_materialize_rewrites_only_the_params_literal():
    source = materialize(CANDIDATE, {"block": 256, "mode": "b"})
    params, space = read_literals(source)
    assert params == {"block": 256, "mode": "b", "fused": True}
    assert space == SPACE
    before, after = CANDIDATE.splitlines(), source.splitlines()
    assert before[:4] == after[:4]
    assert before[-6:] == after[-6:]
    assert '    "block": 256,' in after


def test_materialize_round_trips_to_the_original_values():
    there = materialize(CANDIDATE, {"block": 1024, "fused": False})
    back = materialize(there, {"block": 64, "mode": "a", "fused": True})
    assert read_literals(back)[0] == read_literals(CANDIDATE)[0]
    assert materialize(back, {"block": 64}) == back
    ast.parse(back)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"colour": 1}, "'colour' is not in SPACE"),
        ({"block": 128}, r"block=128 is not in SPACE\['block'\]"),
    ],
)
def test_materialize_rejects_values_outside_the_space(params, message):
    with pytest.raises(ValueError, match=message):
        materialize(CANDIDATE, params)


def test_materialize_needs_a_literal_params_dict():
    computed = CANDIDATE.replace('PARAMS = {"block": 64, "mode": "a", "fused": True}',
                                 'PARAMS = dict(block=64, mode="a", fused=True)')
    with pytest.raises(ValueError, match="no top-level literal PARAMS"):
        materialize(computed, {"block": 256})
    with pytest.raises(ValueError, match="no top-level literal PARAMS"):
        materialize("def forward(x):\n    return x\n", {})


def test_materialize_needs_a_space_to_check_against():
    with pytest.raises(ValueError, match="no top-level literal SPACE"):
        materialize('PARAMS = {"block": 64}\n', {"block": 256})


def test_read_literals_does_not_run_the_candidate():
    params, space = read_literals('import os\nos.exit(1)\nPARAMS = {"a": 1}\n')
    assert params == {"a": 1} and space is None
