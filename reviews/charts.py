"""Plotly figures of the review page and the keep/revert path: pure functions, data in,
a figure dict out, embedded in pages as JSON (see research/charts.py)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from research.charts import LAYOUT, Figure, plotly_text
from reviews.selectors import WorkloadRow
from runners.harness.dispatch import axis_title

KEPT_COLOUR = "#667085"
CANDIDATE_COLOUR = "#2f5bd3"
WIN_COLOUR = "#127a3a"
LOSS_COLOUR = "#b42318"
GREY = "#98a2b3"
WAITING_COLOUR = "#dc6803"
WARN_COLOUR = "#b54708"
_DASHES = ["solid", "dot", "dash", "dashdot", "longdash"]


def _size_label(row: WorkloadRow) -> str:
    return f"{row.size:,}" if row.size is not None else plotly_text(row.name)


def _categories(rows: Sequence[WorkloadRow]) -> list[str]:
    """x positions: the sizes in order (even spacing suits sizes that grow geometrically)."""
    seen = sorted({(r.size if r.size is not None else -1, _size_label(r)) for r in rows})
    return [label for _, label in seen]


def _groups(rows: Sequence[WorkloadRow]) -> dict[str, list[WorkloadRow]]:
    groups: dict[str, list[WorkloadRow]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    for members in groups.values():
        members.sort(key=lambda r: (r.size is None, r.size or 0))
    return groups


def _band(x: list[str], ci: list[tuple[float, float] | None], colour: str, group: str) -> list[dict]:
    """A confidence band: the upper edge, then the lower edge filled up to it."""
    if not any(ci):
        return []
    hi = [c[1] if c else None for c in ci]
    lo = [c[0] if c else None for c in ci]
    edge = {"type": "scatter", "mode": "lines", "x": x, "line": {"width": 0, "color": colour},
            "hoverinfo": "skip", "showlegend": False, "legendgroup": group}
    return [{**edge, "y": hi},
            {**edge, "y": lo, "fill": "tonexty", "fillcolor": _transparent(colour)}]


def _transparent(colour: str, alpha: float = 0.18) -> str:
    red, green, blue = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red},{green},{blue},{alpha})"


def latency_figure(rows: Sequence[WorkloadRow], axis: str | None, baseline: str = "kept") -> Figure:
    """Median time per size, the kernel timed against (`baseline`: the kept one, or a
    head-to-head's other win) vs candidate, each with its confidence band."""
    traces: list[dict] = []
    for index, (group, members) in enumerate(_groups(rows).items()):
        x = [_size_label(r) for r in members]
        dash = _DASHES[index % len(_DASHES)]
        suffix = "" if group == "all" else plotly_text(f" ({group})")
        for side, colour, times, ci in (
            (baseline, KEPT_COLOUR, [r.baseline_ms for r in members], [r.baseline_ci for r in members]),
            ("candidate", CANDIDATE_COLOUR, [r.candidate_ms for r in members], [r.candidate_ci for r in members]),
        ):
            legend = f"{side}{suffix}"
            traces += _band(x, ci, colour, legend)
            traces.append({
                "type": "scatter", "mode": "lines+markers", "name": legend, "legendgroup": legend,
                "x": x, "y": times, "line": {"color": colour, "dash": dash},
                "hovertemplate": f"{legend}<br>%{{x}}: %{{y:.4g}} ms<extra></extra>",
            })
    return {
        "data": traces,
        "layout": {
            **LAYOUT,
            "xaxis": {"title": {"text": axis_title(axis)}, "type": "category",
                      "categoryorder": "array", "categoryarray": _categories(rows)},
            "yaxis": {"title": {"text": "median time per call (ms)"}, "rangemode": "tozero"},
            "legend": {"orientation": "h", "y": -0.25},
        },
    }


def speedup_figure(rows: Sequence[WorkloadRow], axis: str | None,
                   dispatch: dict | None, baseline: str = "the kept kernel") -> Figure:
    """Speedup per size with its confidence interval; the dispatch range shaded.

    `dispatch` is {"min", "max", "summary"?} along the same axis (either end may be
    None: open). The shading covers the measured sizes inside the range.
    """
    categories = _categories(rows)
    traces = []
    for index, (group, members) in enumerate(_groups(rows).items()):
        speedups = [r.speedup for r in members]
        colours = [
            (WIN_COLOUR if (r.speedup or 0) > 1 else LOSS_COLOUR) if r.significant else GREY
            for r in members
        ]
        traces.append({
            "type": "scatter", "mode": "lines+markers",
            "name": "speedup" if group == "all" else plotly_text(f"speedup ({group})"),
            "x": [_size_label(r) for r in members], "y": speedups,
            "line": {"color": CANDIDATE_COLOUR, "dash": _DASHES[index % len(_DASHES)]},
            "marker": {"color": colours, "size": 9},
            "error_y": {
                "type": "data", "symmetric": False, "color": GREY,
                "array": [(r.speedup_ci[1] - r.speedup) if r.speedup_ci and r.speedup else 0 for r in members],
                "arrayminus": [(r.speedup - r.speedup_ci[0]) if r.speedup_ci and r.speedup else 0 for r in members],
            },
            "customdata": [["significant" if r.significant else "not significant", r.p_value] for r in members],
            "hovertemplate": "%{x}: %{y:.3f}× (%{customdata[0]}, p=%{customdata[1]:.2g})<extra></extra>",
        })
    shapes: list[dict[str, Any]] = [{
        "type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
        "line": {"dash": "dot", "color": "#888"},
    }]
    annotations = []
    inside = _dispatch_positions(rows, categories, dispatch)
    if inside:
        shapes.insert(0, {
            "type": "rect", "xref": "x", "yref": "paper", "x0": inside[0] - 0.5, "x1": inside[-1] + 0.5,
            "y0": 0, "y1": 1, "fillcolor": _transparent(WIN_COLOUR, 0.12), "line": {"width": 0},
            "layer": "below",
        })
        annotations.append({
            "xref": "paper", "yref": "paper", "x": 0, "y": 1.08, "showarrow": False, "xanchor": "left",
            "text": "shaded: dispatch range" + (f" — {plotly_text(dispatch['summary'])}"
                                                if dispatch.get("summary") else ""),
            "font": {"color": WIN_COLOUR},
        })
    return {
        "data": traces,
        "layout": {
            **LAYOUT,
            "xaxis": {"title": {"text": axis_title(axis)}, "type": "category",
                      "categoryorder": "array", "categoryarray": categories},
            "yaxis": {"title": {"text": f"speedup over {plotly_text(baseline)} (×)"}},
            "shapes": shapes,
            "annotations": annotations,
            "legend": {"orientation": "h", "y": -0.25},
        },
    }


def _dispatch_positions(rows: Sequence[WorkloadRow], categories: list[str],
                        dispatch: dict | None) -> list[int]:
    if not dispatch:
        return []
    low, high = dispatch.get("min"), dispatch.get("max")
    return sorted({
        categories.index(_size_label(r)) for r in rows
        if r.size is not None and (low is None or r.size >= low) and (high is None or r.size <= high)
    })


# -- the keep/revert path ------------------------------------------------------------

# One colour and line style per op's running best: the team chart has several, and in
# one colour they read as one line (the first is the win colour).
_OP_DASHES = ("solid", "dash", "dot", "dashdot")
_OP_COLOURS = (WIN_COLOUR, "#2f5bd3", "#7a3ab5", "#0e7490")
_STATES = {
    # state: (legend, colour, symbol, size)
    "rejected": ("rejected", GREY, "x", 7),
    "no-gain": ("no gain", GREY, "circle-open", 7),
    "reverted": ("reverted", GREY, "diamond", 8),
    "waiting": ("awaiting review", WAITING_COLOUR, "circle", 9),
    # Kept once, then a second reviewer undid the keep: no longer a kept kernel.
    "undone": ("kept, then undone", GREY, "star-open", 13),
}


def path_figure(points: Sequence[dict]) -> Figure:
    """Every evaluated candidate in order; kept ones highlighted and labelled; the running
    best (over kept candidates, per op and hardware class, starting at the shipped
    baseline = 1) as a step.

    `points` come from reviews.selectors.path_points: x, y (None when not timed), op,
    hardware, state, label, candidate, thesis, speedup, when, url. A candidate that was never
    timed (rejected before timing) sits on the x axis. An undo of a keep is a point of its
    own (state "undo", `undoes`: the kept point's x), drawn where it happened, at the
    undone kernel's speedup; from there the running best drops back to the best keep
    still standing.
    """
    traces: list[dict] = []

    def marker_trace(members: list[dict], name: str, **style: Any) -> dict:
        return {
            "type": "scatter", "mode": "markers", "name": name,
            "x": [p["x"] for p in members],
            "y": [p["y"] if p["y"] is not None else 0 for p in members],
            # The url is read by the page's script, never shown; the rest is shown.
            "customdata": [[p["url"], *(plotly_text(p[key]) for key in ("candidate", "label", "thesis", "op", "when")),
                            "not timed" if p["y"] is None else f"{p['y']:.3f}×"] for p in members],
            "hovertemplate": "%{customdata[1]} · %{customdata[4]} · " + name
                             + "<br>%{customdata[2]}<br>%{customdata[6]} over the shipped baseline"
                             "<br>%{customdata[3]}<br>%{customdata[5]}<extra></extra>",
            **style,
        }

    for state, (name, colour, symbol, size) in _STATES.items():
        members = [p for p in points if p["state"] == state]
        if members:
            traces.append(marker_trace(members, name, marker={"color": colour, "symbol": symbol, "size": size}))

    # One running best per op and hardware class: kernels are kept per class.
    lines = list(dict.fromkeys((p["op"], p.get("hardware")) for p in points))
    last_x = max((p["x"] for p in points), default=0)
    for line, dash, colour in zip(lines, itertools.cycle(_OP_DASHES), itertools.cycle(_OP_COLOURS)):
        members = [p for p in points if (p["op"], p.get("hardware")) == line]
        steps = sorted((p for p in members if p["state"] in ("kept", "undone", "undo") and p["y"] is not None),
                       key=lambda p: p["x"])
        first_x = min(p["x"] for p in members)
        op = f"{line[0]} on {line[1]}" if line[1] else line[0]
        xs, ys, standing = [first_x], [1.0], {}
        for point in steps:
            # A keep stands from its point until an undo names it.
            if point["state"] == "undo":
                standing.pop(point["undoes"], None)
            else:
                standing[point["x"]] = point["y"]
            xs.append(point["x"])
            ys.append(max([1.0, *standing.values()]))
        xs.append(last_x)
        ys.append(ys[-1])
        traces.append({
            "type": "scatter", "mode": "lines", "name": "running best" if len(lines) == 1 else f"running best ({op})",
            "x": xs, "y": ys, "line": {"shape": "hv", "color": colour, "width": 2, "dash": dash},
            "hoverinfo": "skip",
        })

    # An imported win two reviewers kept without a worker's measurement stays marked apart.
    for name, colour, symbol, unverified in (("kept", WIN_COLOUR, "star", False),
                                             ("kept unverified", WARN_COLOUR, "star-open", True)):
        kept = [p for p in points if p["state"] == "kept" and bool(p.get("unverified")) == unverified]
        if kept:
            traces.append(marker_trace(
                kept, name, mode="markers+text",
                text=[_label(p) + (" (unverified)" if unverified else "") for p in kept],
                # Toward the middle, so a label near either end stays inside the plot.
                textposition=["top left" if 2 * p["x"] > last_x + 1 else "top right" for p in kept],
                textfont={"color": colour, "size": 11},
                marker={"color": colour, "symbol": symbol, "size": 15,
                        "line": {"color": colour if unverified else "#fff", "width": 1}},
            ))
    undos = [p for p in points if p["state"] == "undo"]
    if undos:
        traces.append(marker_trace(
            undos, "undo of a keep", mode="markers+text", text=[plotly_text(f"undo {p['candidate']}") for p in undos],
            textposition=["bottom left" if 2 * p["x"] > last_x + 1 else "bottom right" for p in undos],
            textfont={"color": LOSS_COLOUR, "size": 11},
            marker={"color": LOSS_COLOUR, "symbol": "triangle-down", "size": 13, "line": {"color": "#fff", "width": 1}},
        ))
    return {
        "data": traces,
        "layout": {
            **LAYOUT,
            "height": 380,
            # Whole candidates only: at most a dozen ticks, however long the path.
            "xaxis": {"title": {"text": "candidate, in the order results came in"}, "tickformat": "d",
                      "tick0": 1, "dtick": max(1, math.ceil(last_x / 12))},
            "yaxis": {"title": {"text": "speedup vs shipped baseline (×)"}, "rangemode": "tozero"},
            "legend": {"orientation": "h", "y": -0.22},
            "hovermode": "closest",
        },
    }


def _label(point: dict, limit: int = 40) -> str:
    text = f"{point['candidate']}: {point['label']}"
    return plotly_text(text if len(text) <= limit else text[: limit - 1] + "…")


def compound_figure(report: dict) -> Figure:
    """The waterfall of one loop (a report of runners.harness.compound): the shipped
    baselines' tokens per second, then each keep's or undo's change, coloured by its
    sign (grey where it is within this run's noise floor), and the machine's roofline as
    a line above when the hardware has one."""
    stages = report["stages"]
    labels = [f"{index}. {plotly_text(stage['label'])}" for index, stage in enumerate(stages)]
    values = [stages[0]["tokens_per_s"]] + [
        stage["tokens_per_s"] - before["tokens_per_s"] for before, stage in zip(stages, stages[1:])]
    hover = []
    for index, stage in enumerate(stages):
        low, high = stage["tokens_per_s_ci"]
        text = f"{stage['tokens_per_s']:,.0f} tokens/s [{low:,.0f}, {high:,.0f}]"
        if index:
            s_low, s_high = stage["speedup_ci"]
            verdict = "significant" if stage["significant"] else "within the noise floor"
            text += f"<br>{stage['speedup']:.3f}× the stage before [{s_low:.3f}, {s_high:.3f}], {verdict}"
        hover.append(f"{labels[index]}<br>{text}")
    # Plotly colours a waterfall's rises and falls, not its significance: grey bars
    # are drawn over the steps that are within the noise floor.
    traces: list[dict] = [{
        "type": "waterfall", "orientation": "v", "name": "tokens/s",
        "x": labels, "y": values, "measure": ["absolute"] + ["relative"] * (len(stages) - 1),
        "text": [f"{stage['tokens_per_s']:,.0f}" for stage in stages], "textposition": "outside",
        "hovertext": hover, "hoverinfo": "text",
        "increasing": {"marker": {"color": WIN_COLOUR}}, "decreasing": {"marker": {"color": LOSS_COLOUR}},
        "totals": {"marker": {"color": KEPT_COLOUR}},
        "connector": {"line": {"color": GREY, "dash": "dot"}},
    }]
    noisy = [index for index, stage in enumerate(stages) if index and not stage["significant"]]
    if noisy:
        traces.append({
            "type": "bar", "name": "within the noise floor", "x": [labels[i] for i in noisy],
            "base": [min(stages[i - 1]["tokens_per_s"], stages[i]["tokens_per_s"]) for i in noisy],
            "y": [abs(values[i]) for i in noisy], "marker": {"color": GREY},
            "hovertext": [hover[i] for i in noisy], "hoverinfo": "text",
        })
    roofline = report.get("roofline_tokens_per_s")
    if roofline:
        traces.append({
            "type": "scatter", "mode": "lines", "name": "roofline", "x": [labels[0], labels[-1]],
            "y": [roofline, roofline], "line": {"color": WARN_COLOUR, "dash": "dash"},
            "hovertemplate": f"roofline: {roofline:,.0f} tokens/s (datasheet bandwidth)<extra></extra>",
        })
    return {"data": traces, "layout": {
        **LAYOUT, "height": 380, "barmode": "overlay", "showlegend": bool(roofline or noisy),
        "legend": {"orientation": "h", "y": -0.35, "x": 0},
        "margin": {**LAYOUT["margin"], "b": 110},
        "yaxis": {"title": {"text": "decode tokens/s"}, "rangemode": "tozero", "automargin": True},
        "xaxis": {"automargin": True, "tickangle": -20},
    }}
