"""Publishing review-queue changes to the `reviews` channel group.

The message carries no count: each connected page asks the database when told, so a
lost push costs only a late number, never a wrong one.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

QUEUE_GROUP = "reviews"


def publish_queue_changed() -> None:
    layer = get_channel_layer()
    try:
        async_to_sync(layer.group_send)(QUEUE_GROUP, {"type": "queue.changed"})
    except Exception:  # best effort: the next page load shows the right count anyway
        logger.warning("could not publish a review queue change", exc_info=True)
