"""The live count of the review queue: pushed when a win is recorded or decided."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from config.asgi import application
from reviews.services import candidate_revert
from tests.reviewing import make_people, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, workspace_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = (b"origin", b"http://localhost")
HOST = (b"host", b"localhost")


@sync_to_async
def _setup():
    people = make_people()
    sweep = start_sweep(make_thesis(people.author), people.producer, budget=2)
    client = Client()
    client.force_login(people.reviewer)
    return people, sweep, f"sessionid={client.cookies['sessionid'].value}".encode()


async def test_an_anonymous_socket_is_refused(workspace_dir):
    communicator = WebsocketCommunicator(application, "/ws/reviews/", headers=[ORIGIN, HOST])
    connected, code = await communicator.connect()
    assert not connected and code == 4401


async def test_the_count_arrives_on_connect_and_again_when_a_win_is_recorded_and_decided(workspace_dir, no_enqueue):
    people, sweep, cookie = await _setup()
    communicator = WebsocketCommunicator(application, "/ws/reviews/", headers=[ORIGIN, HOST, (b"cookie", cookie)])
    connected, _ = await communicator.connect()
    assert connected
    assert await communicator.receive_json_from(timeout=5) == {"type": "queue.count", "count": 0}

    first, second = await sync_to_async(lambda: list(sweep.candidates.all()))()
    win = await sync_to_async(record)(first, recorded_result())
    assert (await communicator.receive_json_from(timeout=5))["count"] == 1
    # A result that is not a win changes nothing in the queue, so nothing is pushed.
    await sync_to_async(record)(second, recorded_result((1.0, 1.0, 1.0, 1.0)))
    assert await communicator.receive_nothing(timeout=0.5)

    await sync_to_async(candidate_revert)(candidate=win, reviewer=people.reviewer, commit=win.commit)
    assert (await communicator.receive_json_from(timeout=5))["count"] == 0
    await communicator.disconnect()
