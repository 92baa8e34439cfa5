"""The sweep page's result rows, each rendered once for what it shows.

Rendering 200 rows was most of the sweep page's own time (the `result-row` partial: its
parameters, verdict and a formatted speedup per workload), and a recorded row shows the
same thing every time it is drawn. Each row's HTML is kept in the cache, shared by every
web process, under a digest of everything the partial reads from it and of the partial's
template itself: a row whose result changes, or a template that changes, has a new key
and is rendered anew, so a kept row is always the HTML the template would draw now.

A row's workloads are read whole only for the rows to draw: the key needs just what they
show, which the database joins into one line per candidate (position, speedup,
significance), so a page of 200 kept rows reads 200 short lines, not 800 measurements.
"""

from __future__ import annotations

import hashlib
import json

from django.core.cache import cache
from django.db.models import Aggregate, Prefetch, TextField, Value, prefetch_related_objects
from django.db.models.functions import Concat
from django.template.loader import get_template, render_to_string
from django.urls import reverse
from django.utils.safestring import SafeString

from research.models import Candidate, Measurement

_PARTIAL = "research/sweep_detail.html#result-row"
KEEP_S = 7 * 24 * 3600


def _rendering() -> str:
    """What draws a row besides its own data: the page's template (it holds the partial)
    and where a row's number links to."""
    source = get_template("research/sweep_detail.html").template.source
    return hashlib.sha256((source + reverse("candidate_review", args=[0])).encode()).hexdigest()[:16]


class _Joined(Aggregate):
    """The group's texts joined with commas, in no particular order (callers sort)."""

    function = "GROUP_CONCAT"  # SQLite's
    output_field = TextField()

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, function="STRING_AGG",
                           template="%(function)s(%(expressions)s, ',')", **extra)


def _workloads_shown(results: list[Candidate]) -> dict[int, str]:
    """What each row shows of its workloads, as text, by candidate id, in one query."""
    shown = _Joined(Concat("position", Value(":"), "speedup", Value(":"), "significant",
                           output_field=TextField()))
    lines = (Measurement.objects.filter(candidate__in=[row.pk for row in results]).order_by()
             .values("candidate_id").annotate(shown=shown).values_list("candidate_id", "shown"))
    # Sorted here: the databases join a group's rows in whatever order they read them.
    return {candidate: ",".join(sorted(line.split(","), key=lambda part: int(part.split(":")[0])))
            for candidate, line in lines}


def _shown(row: Candidate, workloads: str) -> str:
    """Everything the partial reads from the row, as text."""
    return json.dumps([row.pk, row.number, row.params, row.verdict, row.geomean_speedup, row.error, workloads],
                      default=str)


def rendered(results: list[Candidate]) -> list[SafeString]:
    """Each row's HTML, in order: from the cache where it was drawn before, drawn (and
    kept) otherwise, reading the workloads of those rows only."""
    rendering = _rendering()
    workloads = _workloads_shown(results)
    keys = [f"result-row:{rendering}:{hashlib.sha256(_shown(row, workloads.get(row.pk, '')).encode()).hexdigest()}"
            for row in results]
    found = cache.get_many(keys)
    to_draw = [(key, row) for key, row in zip(keys, results) if key not in found]
    prefetch_related_objects([row for _, row in to_draw], Prefetch(
        "measurements", queryset=Measurement.objects.only("candidate_id", "position", "workload", "speedup",
                                                          "significant")))
    drawn = {key: render_to_string(_PARTIAL, {"row": row}) for key, row in to_draw}
    if drawn:
        cache.set_many(drawn, KEEP_S)
    # Kept as the SafeString the template rendered (the cache pickles it with its type):
    # anything else read from the cache would be escaped on the page, never trusted.
    return [found.get(key) or drawn[key] for key in keys]
