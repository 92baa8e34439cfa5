"""Plotly figures built server-side as plain dicts, embedded in pages as JSON.

Live pages extend these figures in place (Plotly.extendTraces), so the trace order
here is the order the live script relies on: one trace per workload.
"""

from __future__ import annotations

import html
import math
from typing import Any

from research.evidence import kernel_label

Figure = dict[str, Any]


def plotly_text(text: object) -> str:
    """Text Plotly shows as written: it renders a subset of HTML in labels, names and
    hover text (links, styles, line breaks), so anything a user or an upload wrote has
    its markup escaped, which Plotly then displays as the characters themselves."""
    return html.escape(str(text), quote=False)


LAYOUT = {
    "margin": {"l": 60, "r": 20, "t": 30, "b": 50},
    "height": 340,
    "font": {"family": "system-ui, sans-serif", "size": 12},
    "paper_bgcolor": "rgba(0,0,0,0)",
    "plot_bgcolor": "rgba(0,0,0,0)",
}


def evidence_kernel_time_figure(summary: dict) -> Figure:
    """Horizontal bars of GPU time per kernel, largest on top. Bars sit at positions,
    one per kernel, labelled by `kernel_label`: keyed by a shortened name, two
    instantiations of one template (three `vectorized_elementwise_kernel<…>` in a
    real trace) stacked into one bar. The hover names the kernel in full."""
    kernels = list(reversed(summary.get("top_kernels", [])))
    positions = list(range(len(kernels)))
    return {
        "data": [
            {
                "type": "bar",
                "orientation": "h",
                "x": [k["total_ms"] for k in kernels],
                "y": positions,
                "customdata": [[k["calls"], round(100 * k["share"], 1), plotly_text(k["name"])] for k in kernels],
                "hovertemplate": "%{customdata[2]}<br>%{x:.3f} ms in %{customdata[0]} calls"
                " (%{customdata[1]}%)<extra></extra>",
                "marker": {"color": "#4c78a8"},
            }
        ],
        "layout": {
            **LAYOUT,
            "height": max(220, 28 * len(kernels) + 80),
            "xaxis": {"title": {"text": "GPU time (ms)"}},
            # automargin widens the left margin to the longest label instead of
            # clipping it at the card's edge.
            "yaxis": {"tickmode": "array", "tickvals": positions, "automargin": True,
                      "ticktext": [plotly_text(kernel_label(k["name"])) for k in kernels]},
        },
    }


NO_RESULT_YET = "no result yet"


def sweep_speedup_figure(workload_names: list[str], points: list[tuple[int, int, float]],
                         candidates: int) -> Figure:
    """Speedup over the kept kernel the sweep is timed against (the shipped baseline until
    a keep) per workload (one trace each) by candidate number.

    `points` are (candidate number, workload position, speedup), in candidate order;
    `candidates` how many the sweep has: the x axis spans them from the start, ticks
    at whole numbers (Plotly's own ticks at halves read "1 1 1 2 2 2" once rounded).
    """
    traces = [
        {"type": "scatter", "mode": "lines+markers", "name": plotly_text(name), "x": [], "y": []}
        for name in workload_names
    ]
    for number, position, speedup in points:
        if position < len(traces):
            traces[position]["x"].append(number)
            traces[position]["y"].append(speedup)
    return {
        "data": traces,
        "layout": {
            **LAYOUT,
            "xaxis": {"title": {"text": "candidate"}, "range": [0.5, max(1, candidates) + 0.5],
                      "tick0": 1, "dtick": max(1, math.ceil(candidates / 10))},
            # Timed against the kept kernel of the sweep's hardware, as the review page
            # says: after a keep, "over baseline" named a kernel main no longer runs.
            "yaxis": {"title": {"text": "speedup over the kept kernel (×)"}},
            "shapes": [
                {
                    "type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                    "line": {"dash": "dot", "color": "#888"},
                }
            ],
            "legend": {"orientation": "h", "y": -0.25},
            # Drawn empty, the chart said nothing (axes -1 to 6); the page's script
            # removes this once the first result is plotted.
            "annotations": [] if points else [{
                # Not "being evaluated": a paused or cancelled sweep, or one whose queue
                # no worker serves, draws this chart too.
                "text": f"{NO_RESULT_YET}: speedups appear as candidates finish", "showarrow": False,
                "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "font": {"color": "#667085"}}],
        },
    }
