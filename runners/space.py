"""Parameter spaces of tunable candidates: enumerate, sample, and write a point out.

A sweep point becomes a real candidate file (not a file plus a side-channel of values),
so what is reviewed, diffed and evaluated is exactly what ran.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import random
import sys
from collections.abc import Mapping
from typing import Any

from runners import python_source


def _checked_space(space: Mapping[str, Any]) -> dict[str, list[Any]]:
    if not isinstance(space, Mapping) or not space:
        raise ValueError("SPACE must be a non-empty dict of parameter name -> list of values")
    checked = {}
    for key, values in space.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"SPACE[{key!r}] must be a non-empty list of values")
        checked[key] = list(values)
    return checked


def grid_points(space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every point, the last parameter varying fastest."""
    checked = _checked_space(space)
    keys = list(checked)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*checked.values())]


def _point_at(space: dict[str, list[Any]], index: int) -> dict[str, Any]:
    point = {}
    for key in reversed(space):
        index, position = divmod(index, len(space[key]))
        point[key] = space[key][position]
    return {key: point[key] for key in space}


def _distinct_indices(size: int, count: int, rng: random.Random) -> list[int]:
    if size <= sys.maxsize:
        return rng.sample(range(size), count)
    # Too large for range() to sample from; at this size repeats are rare.
    picked: dict[int, None] = {}
    while len(picked) < count:
        picked[rng.randrange(size)] = None
    return list(picked)


def random_points(space: Mapping[str, Any], n: int, seed: int) -> list[dict[str, Any]]:
    """Up to n distinct points; sampled by index so a huge space is never enumerated."""
    checked = _checked_space(space)
    size = math.prod(len(values) for values in checked.values())
    indices = _distinct_indices(size, min(max(n, 0), size), random.Random(seed))
    return [_point_at(checked, index) for index in indices]


def _literal_assignment(tree: ast.Module, name: str) -> ast.expr | None:
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return node.value
    return None


def read_literals(source: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A candidate's PARAMS and SPACE, read without running the candidate."""
    tree = python_source.parse(source)
    found = []
    for name in ("PARAMS", "SPACE"):
        node = _literal_assignment(tree, name)
        try:
            value = ast.literal_eval(node) if node is not None else None
        except ValueError:
            value = None
        found.append(value if isinstance(value, dict) else None)
    return found[0], found[1]


def _format_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _format_params(params: Mapping[str, Any]) -> str:
    lines = [f"    {_format_value(key)}: {_format_value(value)}," for key, value in params.items()]
    return "{\n" + "\n".join(lines) + "\n}"


def materialize(source: str, params: Mapping[str, Any]) -> str:
    """The candidate source with its top-level PARAMS literal replaced by `params`.

    Keys not in `params` keep their current values; only the PARAMS literal changes,
    so the diff against the source shows exactly the changed values.
    """
    tree = python_source.parse(source)
    node = _literal_assignment(tree, "PARAMS")
    current, space = read_literals(source)
    if node is None or current is None:
        raise ValueError("the candidate has no top-level literal PARAMS = {...} to rewrite")
    if space is None:
        raise ValueError("the candidate has no top-level literal SPACE = {...} to check values against")
    for key, value in params.items():
        if key not in space:
            raise ValueError(f"parameter {key!r} is not in SPACE (known: {', '.join(map(str, space))})")
        if value not in space[key]:
            raise ValueError(f"{key}={value!r} is not in SPACE[{key!r}] = {space[key]!r}")
    merged = {**current, **params}

    # ast offsets count UTF-8 bytes, so splice bytes rather than characters.
    raw = source.encode()
    line_starts = [0]
    for line in raw.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    start = line_starts[node.lineno - 1] + node.col_offset
    end = line_starts[node.end_lineno - 1] + node.end_col_offset
    return (raw[:start] + _format_params(merged).encode() + raw[end:]).decode()


STRATEGIES = ("grid", "random", "listed")


def listed_points(space: Mapping[str, Any], points: Any) -> list[dict[str, Any]]:
    """Points named one by one (to measure again the ones a search found), each checked
    against SPACE: every parameter named, each value one SPACE lists, none twice."""
    checked = _checked_space(space)
    if not isinstance(points, list) or not points:
        raise ValueError("the listed points must be a non-empty JSON list of objects")
    found: list[dict[str, Any]] = []
    for number, point in enumerate(points, start=1):
        if not isinstance(point, dict):
            raise ValueError(f"listed point {number} is not an object of parameter -> value")
        if set(point) != set(checked):
            missing, unknown = sorted(set(checked) - set(point)), sorted(set(point) - set(checked))
            raise ValueError(f"listed point {number} must name exactly SPACE's parameters"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; not in SPACE: {', '.join(unknown)}" if unknown else ""))
        for key, value in point.items():
            if value not in checked[key]:
                raise ValueError(f"listed point {number}: {key}={value!r} is not one of SPACE's "
                                 f"values {checked[key]!r}")
        ordered = {key: point[key] for key in checked}
        if ordered in found:
            raise ValueError(f"listed point {number} repeats point {found.index(ordered) + 1}")
        found.append(ordered)
    return found


def sweep_points(space: Mapping[str, Any], strategy: str, budget: int, seed: int,
                 listed: Any = None) -> list[dict[str, Any]]:
    """The points a sweep of `budget` candidates evaluates: the grid's first `budget` in
    order, `budget` distinct points drawn with `seed`, or the first `budget` listed."""
    if (strategy == "listed") != (listed is not None):
        raise ValueError("listed points go with the listed strategy, and only with it")
    if strategy == "grid":
        return grid_points(space)[:budget]
    if strategy == "random":
        return random_points(space, budget, seed)
    if strategy == "listed":
        return listed_points(space, listed)[:budget]
    raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
