"""The review queue's size for the navigation, kept in the cache between its changes.

Every page a logged-in user opens shows the count, and counting the queue is one of the
heaviest queries a page asks (its exclusions join reviews, sweeps and the kept kernels).
The queue changes only where the lab says so (reviews.live.publish_queue_changed: a win
recorded, a candidate revised, a keep, a revert, an undo), so the count is kept under a
generation that each change replaces. A new generation, not a deleted key: a page that
counted just before a change stores its number under the generation it read, which no
later page asks for, so a count read after a change is always counted after it.
"""

from __future__ import annotations

import uuid

from django.core.cache import cache

from reviews.selectors import review_queue_count

_GENERATION = "review-queue:generation"
# A ceiling for changes made by hand outside the lab (the admin, git on the workspace),
# which tell no one: those show within this time, the lab's own on the next page.
KEEP_S = 300


def count() -> int:
    generation = cache.get(_GENERATION)
    if generation is None:  # first use, or evicted: a generation no count was kept under
        generation = uuid.uuid4().hex
        if not cache.add(_GENERATION, generation, None):
            generation = cache.get(_GENERATION) or generation
    return cache.get_or_set(f"review-queue:count:{generation}", review_queue_count, KEEP_S)


def forget() -> None:
    """The queue changed: every count kept so far is of the old queue."""
    cache.set(_GENERATION, uuid.uuid4().hex, None)
