"""The sweep websocket through the real ASGI stack and the real Redis channel layer."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from config.asgi import application
from research import consumers
from research.events import event_append
from research.live import sweep_group
from research.models import Event, Sweep

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = (b"origin", b"http://localhost")
HOST = (b"host", b"localhost")


@sync_to_async
def _sweep_with_events(count: int) -> tuple[Sweep, bytes]:
    from research import theses

    user = get_user_model().objects.create_user("grace", password="pw-for-tests-only")
    thesis = theses.thesis_submit(author=user, title="t", idea="i", op="rmsnorm", hardware="cpu",
                                    required_dsl="torch")
    sweep = Sweep.objects.create(thesis=thesis, started_by=user, kernel="blocked", strategy="grid",
                                 budget=1, seed=1, hardware="cpu", queue="runner.cpu", total=1)
    for n in range(count):
        event_append(sweep_id=sweep.pk, type="note", payload={"n": n})
    client = Client()
    client.force_login(user)
    return sweep, f"sessionid={client.cookies['sessionid'].value}".encode()


async def _connect(sweep: Sweep, cookie: bytes | None, origin=ORIGIN) -> WebsocketCommunicator:
    headers = [origin, HOST] + ([(b"cookie", cookie)] if cookie else [])
    return WebsocketCommunicator(application, f"/ws/sweeps/{sweep.pk}/", headers=headers)


async def test_an_anonymous_socket_is_refused():
    sweep, _ = await _sweep_with_events(1)
    communicator = await _connect(sweep, cookie=None)
    connected, code = await communicator.connect()
    assert not connected and code == 4401


async def test_a_socket_from_a_foreign_origin_is_refused():
    sweep, cookie = await _sweep_with_events(1)
    communicator = await _connect(sweep, cookie, origin=(b"origin", b"http://evil.example"))
    connected, _ = await communicator.connect()
    assert not connected


async def test_it_replays_after_the_clients_seq_then_streams_live_events():
    sweep, cookie = await _sweep_with_events(3)
    communicator = await _connect(sweep, cookie)
    connected, _ = await communicator.connect()
    assert connected
    await communicator.send_json_to({"after": 1})
    replayed = [await communicator.receive_json_from() for _ in range(2)]
    assert [f["seq"] for f in replayed] == [2, 3]
    assert replayed[0]["sweep"] == sweep.pk and replayed[0]["type"] == "note" and "html" in replayed[0]

    await sync_to_async(event_append)(sweep_id=sweep.pk, type="note", payload={"n": "live"})
    live = await communicator.receive_json_from(timeout=5)
    assert live["seq"] == 4 and live["payload"] == {"n": "live"}
    assert await communicator.receive_nothing(timeout=0.3)
    await communicator.disconnect()


async def test_a_lost_push_is_filled_from_the_database_in_order():
    sweep, cookie = await _sweep_with_events(2)
    communicator = await _connect(sweep, cookie)
    await communicator.connect()
    await communicator.send_json_to({"after": 2})
    assert await communicator.receive_nothing(timeout=0.3)

    # Two events are stored but only the second is pushed, as if the first push was lost.
    @sync_to_async
    def store_silently():
        Event.objects.create(sweep=sweep, seq=3, type="note", payload={"n": 3})
        Event.objects.create(sweep=sweep, seq=4, type="note", payload={"n": 4})
        return Event.objects.get(sweep=sweep, seq=4).as_message()

    fourth = await store_silently()
    await get_channel_layer().group_send(sweep_group(sweep.pk), {"type": "sweep.event", "event": fourth})
    frames = [await communicator.receive_json_from(timeout=5) for _ in range(2)]
    assert [f["seq"] for f in frames] == [3, 4]
    # A duplicate push of something already sent is dropped.
    await get_channel_layer().group_send(sweep_group(sweep.pk), {"type": "sweep.event", "event": fourth})
    assert await communicator.receive_nothing(timeout=0.3)
    await communicator.disconnect()


async def test_a_lost_push_with_nothing_after_it_arrives_by_the_catch_up(monkeypatch):
    monkeypatch.setattr(consumers, "CATCH_UP_EVERY_S", 0.2)
    sweep, cookie = await _sweep_with_events(1)
    communicator = await _connect(sweep, cookie)
    await communicator.connect()
    await communicator.send_json_to({"after": 1})
    assert await communicator.receive_nothing(timeout=0.3)

    # The sweep's last event: stored, its push lost, and no later push to reveal the gap.
    @sync_to_async
    def store_silently():
        Event.objects.create(sweep=sweep, seq=2, type="note", payload={"n": 2})
        Sweep.objects.filter(pk=sweep.pk).update(last_seq=2)

    await store_silently()
    frame = await communicator.receive_json_from(timeout=5)
    assert frame["seq"] == 2 and frame["payload"] == {"n": 2}
    assert await communicator.receive_nothing(timeout=0.6)  # and only once
    await communicator.disconnect()


async def test_it_explains_a_malformed_resume_message():
    sweep, cookie = await _sweep_with_events(1)
    communicator = await _connect(sweep, cookie)
    await communicator.connect()
    await communicator.send_json_to({"after": "yesterday"})
    assert "error" in await communicator.receive_json_from()
    await communicator.disconnect()
