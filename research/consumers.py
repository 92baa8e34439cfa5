"""The sweep websocket: replays stored events after the client's last seq, then streams.

The consumer only translates events to frames. It never trusts the push alone: a gap
in seqs is filled from the database, a seq already sent is dropped, and every
CATCH_UP_EVERY_S it asks the database for the sweep's last seq, so a push dropped with
no later push behind it (a full channel-layer queue, Redis restarting) still arrives.
"""

from __future__ import annotations

import asyncio
import contextlib

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from research.frames import event_frame
from research.live import sweep_group
from research.models import Sweep
from research.selectors import sweep_events_after, sweep_last_seq
from research.sweep_control import sweep_can_control

CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
CATCH_UP_EVERY_S = 5.0


class SweepConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.sweep_id = int(self.scope["url_route"]["kwargs"]["sweep_id"])
        sweep = await database_sync_to_async(
            Sweep.objects.select_related("thesis").filter(pk=self.sweep_id).first)()
        if sweep is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        # Whether this viewer gets the pause/resume/cancel buttons in the frames.
        self.can_control = sweep_can_control(sweep=sweep, user=user)
        # None until the client says what it has seen; live events wait for that.
        self.last_sent: int | None = None
        # Pushes and the catch-up loop take turns, so a seq is never sent twice.
        self.sending = asyncio.Lock()
        self.catching_up: asyncio.Task | None = None
        self.group = sweep_group(self.sweep_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if getattr(self, "catching_up", None) is not None:
            self.catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.catching_up
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content: dict, **kwargs) -> None:
        after = content.get("after") if isinstance(content, dict) else None
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            await self.send_json({"error": 'send {"after": <last seq seen, 0 for all>}'})
            return
        async with self.sending:
            self.last_sent = after
            await self._replay()
        if self.catching_up is None:
            self.catching_up = asyncio.create_task(self._catch_up_while_open())

    async def sweep_event(self, message: dict) -> None:
        if self.last_sent is None:
            return
        event = message["event"]
        async with self.sending:
            if event["seq"] <= self.last_sent:
                return
            if event["seq"] > self.last_sent + 1:
                await self._replay()  # a push went missing: the database has it
                return
            await self._send_event(event)

    async def _catch_up_while_open(self) -> None:
        while True:
            await asyncio.sleep(CATCH_UP_EVERY_S)
            if await database_sync_to_async(sweep_last_seq)(self.sweep_id) > self.last_sent:
                async with self.sending:
                    await self._replay()

    async def _replay(self) -> None:
        """Send what the database holds after the last seq sent; the caller holds `sending`."""
        while True:
            events = await database_sync_to_async(sweep_events_after)(self.sweep_id, self.last_sent)
            for event in events:
                await self._send_event(event)
            if len(events) < 1000:
                return

    async def _send_event(self, event: dict) -> None:
        await self.send_json(event_frame(event, can_control=self.can_control))
        self.last_sent = event["seq"]
