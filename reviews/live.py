"""Publishing review-queue changes to the `reviews` channel group.

The message carries no count: each connected page asks for it when told, so a lost push
costs only a late number, never a wrong one. The count kept for the navigation
(reviews.queue_count) is forgotten first, so whoever asks after the push counts anew.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from reviews import queue_count

logger = logging.getLogger(__name__)

QUEUE_GROUP = "reviews"


def publish_queue_changed() -> None:
    queue_count.forget()
    layer = get_channel_layer()
    try:
        async_to_sync(layer.group_send)(QUEUE_GROUP, {"type": "queue.changed"})
    except Exception:  # best effort: the next page load shows the right count anyway
        logger.warning("could not publish a review queue change", exc_info=True)


def queue_changed_on_a_win(sender, *, candidate, **signal) -> None:
    """A recorded win now waits for a reviewer (research.signals.candidate_recorded)."""
    if candidate.verdict == "win":
        transaction.on_commit(publish_queue_changed)


def queue_changed_on_a_revision(sender, **signal) -> None:
    """A revised candidate waits again for its result (research.signals.candidate_revised)."""
    transaction.on_commit(publish_queue_changed)
