"""The sweep page's result rows, each rendered once for what it shows.

Rendering 200 rows was most of the sweep page's own time (the `result-row` partial: its
parameters, verdict and a formatted speedup per workload), and a recorded row shows the
same thing every time it is drawn. Each row's HTML is kept in the cache, shared by every
web process, under a digest of everything the partial reads from it and of the partial's
template itself: a row whose result changes, or a template that changes, has a new key
and is rendered anew, so a kept row is always the HTML the template would draw now.
"""

from __future__ import annotations

import hashlib
import json

from django.core.cache import cache
from django.template.loader import get_template, render_to_string
from django.urls import reverse
from django.utils.safestring import SafeString

from research.models import Candidate

_PARTIAL = "research/sweep_detail.html#result-row"
KEEP_S = 7 * 24 * 3600


def _rendering() -> str:
    """What draws a row besides its own data: the page's template (it holds the partial)
    and where a row's number links to."""
    source = get_template("research/sweep_detail.html").template.source
    return hashlib.sha256((source + reverse("candidate_review", args=[0])).encode()).hexdigest()[:16]


def _shown(row: Candidate) -> str:
    """Everything the partial reads from the row, as text."""
    return json.dumps([row.pk, row.number, row.params, row.verdict, row.geomean_speedup, row.error,
                       [[w.speedup, w.significant] for w in row.workloads]], default=str)


def rendered(results: list[Candidate]) -> list[SafeString]:
    """Each row's HTML, in order: from the cache where it was drawn before, drawn (and
    kept) otherwise."""
    rendering = _rendering()
    keys = [f"result-row:{rendering}:{hashlib.sha256(_shown(row).encode()).hexdigest()}" for row in results]
    found = cache.get_many(keys)
    drawn = {key: render_to_string(_PARTIAL, {"row": row})
             for key, row in zip(keys, results) if key not in found}
    if drawn:
        cache.set_many(drawn, KEEP_S)
    # Kept as the SafeString the template rendered (the cache pickles it with its type):
    # anything else read from the cache would be escaped on the page, never trusted.
    return [found.get(key) or drawn[key] for key in keys]
