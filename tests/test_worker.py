"""A sweep run by a real Celery worker (a thread here) through the real Redis broker."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.cache import cache

from research import selectors, sweep_control, sweeps, workers
from research.live import sweep_group
from research.models import Candidate, Event, Sweep
from tests.celery_worker import cpu_worker, wait_until_finished

pytestmark = pytest.mark.django_db(transaction=True)


async def _drain(channel: str, count: int, timeout_s: float) -> list[dict]:
    layer = get_channel_layer()
    messages = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count and time.monotonic() < deadline:
        try:
            message = await asyncio.wait_for(layer.receive(channel), timeout=deadline - time.monotonic())
        except asyncio.TimeoutError:
            break
        messages.append(message["event"])
    return messages


async def _subscribe(sweep_id: int) -> str:
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(sweep_group(sweep_id), channel)
    return channel


def test_a_worker_evaluates_a_sweep_and_its_events_reach_the_channel_layer_in_order(make_thesis, user):
    thesis = make_thesis(context_lengths=[64, 256], batch_sizes=[1])
    sweep = sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=2)
    # Listen before any worker runs, so every event after "sweep.created" is seen live.
    channel = async_to_sync(_subscribe)(sweep.pk)

    with cpu_worker():
        wait_until_finished(sweep.pk, timeout_s=240)

    sweep.refresh_from_db()
    assert sweep.status == Sweep.Status.FINISHED and sweep.done == 2
    stored = list(Event.objects.filter(sweep=sweep).values_list("seq", "type"))
    assert [seq for seq, _ in stored] == list(range(1, len(stored) + 1))

    pushed = async_to_sync(_drain)(channel, len(stored) - 1, timeout_s=10)
    assert [e["seq"] for e in pushed] == list(range(2, len(stored) + 1))
    assert [e["type"] for e in pushed] == [t for _, t in stored[1:]]

    # The harness really ran: correctness was judged and every workload was timed.
    for candidate in Candidate.objects.filter(sweep=sweep):
        assert candidate.status == Candidate.Status.DONE, candidate.error
        assert candidate.correct is True and candidate.verdict in {"win", "no-gain"}
        timings = list(candidate.measurements.values_list("baseline_ms", "candidate_ms"))
        assert len(timings) == len(selectors.sweep_workload_names(sweep))
        assert all(b > 0 and c > 0 for b, c in timings)
        # Measured here: the worker's queue and host, and the machine state the harness read.
        assert candidate.provenance == {"by": "worker", "queue": "runner.cpu", "host": socket.gethostname()}
        assert candidate.result["machine"]["host"] == socket.gethostname()


def test_a_sweep_no_worker_serves_says_so_with_the_command_that_would(make_thesis, user, client):
    # An H200 sweep on a CPU-only installation: its queue has no consumer.
    thesis = make_thesis(hardware="h200", context_lengths=[4096], batch_sizes=[1])
    sweep = sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=1)
    assert sweep.queue == "runner.sm90"
    client.force_login(user)
    page = client.get(sweep.get_absolute_url()).content.decode()
    assert 'id="no-worker"' in page and "celery -A config worker -Q runner.sm90" in page
    sweep_control.sweep_cancel(sweep=sweep, by=user)  # its message stays queued; nothing claims it

    # A live worker is seen by the queues it consumes (once its consumer listens).
    with cpu_worker():
        deadline, seen = time.monotonic() + 20, frozenset()
        while not {"runner.cpu", "default"} <= seen and time.monotonic() < deadline:
            cache.delete(workers.CACHE_KEY)
            seen = workers.live_queues() or frozenset()
        assert {"runner.cpu", "default"} <= seen
