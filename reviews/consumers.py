"""The review queue's websocket: tells a page the queue's size whenever it changes.

Publishers only say "changed" (reviews.live), after forgetting the kept count; each page
then asks reviews.queue_count, so one change costs one count, not one per open page.
"""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from research.consumers import CLOSE_UNAUTHENTICATED
from reviews.live import QUEUE_GROUP
from reviews import queue_count


class ReviewQueueConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.joined = True
        await self.channel_layer.group_add(QUEUE_GROUP, self.channel_name)
        await self.accept()
        await self._send_count()  # what changed between the page's render and now

    async def disconnect(self, code: int) -> None:
        if getattr(self, "joined", False):
            await self.channel_layer.group_discard(QUEUE_GROUP, self.channel_name)

    async def queue_changed(self, message: dict) -> None:
        await self._send_count()

    async def _send_count(self) -> None:
        count = await database_sync_to_async(queue_count.count)()
        await self.send_json({"type": "queue.count", "count": count})
