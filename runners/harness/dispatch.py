"""Where to use a candidate: the contiguous range of sizes on which it wins.

Wins depend on the workload: a kernel may win up to 96K tokens of context and lose
beyond. The range is taken along the op's size axis (context length, or tokens for ops
without a context) over the workloads' significance; everywhere else the kept kernel
stays. A size counts as won when the candidate is significantly faster there on some
workload and significantly slower on none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SIZE_AXES = ("context_length", "tokens", "message_bytes")
# What each axis is called where people read it: a collective's size is its message.
_AXIS_NAMES = {"message_bytes": "message size"}
# The unit of an axis whose name does not say it (a chart's axis title gives it).
_AXIS_UNITS = {"message_bytes": "bytes per rank"}


@dataclass(frozen=True)
class SizedResult:
    size: int
    speedup: float | None
    significant: bool


def size_axis(params: dict) -> str | None:
    return next((axis for axis in SIZE_AXES if axis in params), None)


def axis_name(axis: str | None, default: str = "size") -> str:
    """The axis in words ("context length", "message size"); `default` when unknown."""
    if not axis:
        return default
    return _AXIS_NAMES.get(axis, axis.replace("_", " "))


def axis_title(axis: str | None, default: str = "workload") -> str:
    """A chart's axis title: the name, with the unit where the name does not say it."""
    unit = _AXIS_UNITS.get(axis or "")
    return f"{axis_name(axis, default)} ({unit})" if unit else axis_name(axis, default)


def _won_sizes(results: Sequence[SizedResult]) -> dict[int, bool]:
    won: dict[int, bool] = {}
    for size in sorted({r.size for r in results}):
        here = [r for r in results if r.size == size and r.significant and r.speedup]
        won[size] = any(r.speedup > 1 for r in here) and not any(r.speedup < 1 for r in here)
    return won


def dispatch_range(axis: str, results: Sequence[SizedResult]) -> dict | None:
    """The longest run of consecutive won sizes (ties: the run with the best speedup)."""
    won = _won_sizes(results)
    runs: list[list[int]] = []
    previous_won = False
    for size, this_won in won.items():
        if this_won:
            if previous_won:
                runs[-1].append(size)
            else:
                runs.append([size])
        previous_won = this_won
    if not runs:
        return None
    best = {r.size: max((x.speedup or 0) for x in results if x.size == r.size) for r in results}
    chosen = max(runs, key=lambda run: (len(run), max(best[s] for s in run)))
    sizes = list(won)
    return {
        "axis": axis,
        "min": chosen[0],
        "max": chosen[-1],
        "sizes": chosen,
        "covers_all": chosen == sizes,
        "summary": _summary(axis, chosen[0], chosen[-1], sizes),
    }


def _human(size: int, axis: str = "") -> str:
    if axis == "message_bytes":
        for unit, scale in (("MB", 2**20), ("KB", 2**10)):
            if size >= scale and size % scale == 0:
                return f"{size // scale} {unit}"
        return f"{size} B"
    return f"{size // 1024}K" if size >= 1024 and size % 1024 == 0 else str(size)


def _summary(axis: str, low: int, high: int, sizes: list[int]) -> str:
    """The range in words, with what serves outside it: the range is the measured sizes
    it holds, so past the largest measured size the kept kernel still serves (a keep
    may widen the range, on the reviewer's word)."""
    name = axis_name(axis)

    def human(size: int) -> str:
        return _human(size, axis)

    if high == sizes[-1]:
        beyond = f"kept kernel beyond {human(high)}, where nothing was measured"
    else:
        beyond = f"kept kernel beyond {human(high)}"
    if low == sizes[0] and high == sizes[-1]:
        return f"candidate at every measured {name} ({human(low)}–{human(high)}), {beyond}"
    where = human(low) if low == high else f"{human(low)}–{human(high)}"
    parts = [f"candidate for {name} {where}"]
    if low != sizes[0]:
        parts.append(f"kept kernel below {human(low)}")
    parts.append(beyond)
    return ", ".join(parts)
