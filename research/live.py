"""The one place that publishes to the channel layer.

Publishing is best effort: the event is already stored, and a client that misses the
push is replayed it from the database on its next (re)connect or gap.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)


def sweep_group(sweep_id: int) -> str:
    return f"sweep.{sweep_id}"


def publish_sweep_event(message: dict) -> None:
    layer = get_channel_layer()
    try:
        async_to_sync(layer.group_send)(
            sweep_group(message["sweep"]), {"type": "sweep.event", "event": message}
        )
    except Exception:  # the database keeps the event; replay delivers it later
        logger.warning("could not publish event %s of sweep %s", message["seq"], message["sweep"], exc_info=True)
