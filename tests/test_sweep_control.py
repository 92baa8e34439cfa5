"""Pausing, resuming and cancelling a sweep: rules, races, events, views, a real worker."""

from __future__ import annotations

import threading

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from celery.signals import task_postrun
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection
from django.test import Client
from django.urls import reverse

from config.asgi import application
from research import candidates, queueing, sweeps
from research.frames import event_frame
from research.models import Candidate, Event, Sweep
from research.sweep_control import sweep_cancel, sweep_pause, sweep_resume
from tests.celery_worker import cpu_worker, wait_until_finished
from tests.test_sweeps import _result

pytestmark = pytest.mark.django_db(transaction=True)

User = get_user_model()


@pytest.fixture
def enqueued(monkeypatch) -> list[tuple[list[int], str]]:
    """What would have been sent to the broker; the worker test sends it for real."""
    sent: list[tuple[list[int], str]] = []
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: sent.append((list(ids), queue)))
    return sent


@pytest.fixture
def sweep(make_thesis, user, enqueued) -> Sweep:
    return sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="grid", budget=3)


def _statuses(sweep: Sweep) -> list[str]:
    return list(sweep.candidates.order_by("number").values_list("status", flat=True))


def _types(sweep: Sweep) -> list[str]:
    return list(Event.objects.filter(sweep=sweep).values_list("type", flat=True))


def test_the_starter_the_thesis_author_and_staff_may_control_a_sweep_and_no_one_else(make_thesis, user, enqueued):
    starter = User.objects.create_user("grace")
    staff = User.objects.create_user("root", is_staff=True)
    stranger = User.objects.create_user("mallory")
    sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=starter, kernel="blocked",
                                 strategy="grid", budget=2)
    with pytest.raises(PermissionDenied):
        sweep_pause(sweep=sweep, by=stranger)
    assert Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.QUEUED
    assert sweep_pause(sweep=sweep, by=starter).status == Sweep.Status.PAUSED
    assert sweep_resume(sweep=sweep, by=user).status == Sweep.Status.QUEUED  # user: the thesis author
    assert sweep_cancel(sweep=sweep, by=staff).status == Sweep.Status.CANCELLED


def test_only_valid_transitions_are_allowed(sweep, user):
    with pytest.raises(ValidationError, match="is queued: it cannot be resumed"):
        sweep_resume(sweep=sweep, by=user)
    sweep_pause(sweep=sweep, by=user)
    with pytest.raises(ValidationError, match="is paused: it cannot be paused"):
        sweep_pause(sweep=sweep, by=user)
    sweep_cancel(sweep=sweep, by=user)
    for action in (sweep_pause, sweep_resume, sweep_cancel):
        with pytest.raises(ValidationError, match="is cancelled"):
            action(sweep=sweep, by=user)


def test_a_finished_sweep_cannot_be_cancelled(make_thesis, user, enqueued):
    sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="grid", budget=1)
    (candidate,) = sweep.candidates.all()
    candidates.candidate_claim(candidate_id=candidate.pk)
    candidates.candidate_record_result(candidate_id=candidate.pk, result=_result())
    with pytest.raises(ValidationError, match="is finished"):
        sweep_cancel(sweep=sweep, by=user)
    assert Sweep.objects.get(pk=sweep.pk).stop_reason == ""


def test_two_clicks_at_once_pause_the_sweep_once(sweep, user):
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def click() -> None:
        try:
            barrier.wait()
            sweep_pause(sweep=Sweep.objects.select_related("thesis").get(pk=sweep.pk), by=user)
            outcomes.append("paused")
        except ValidationError:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=click) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["paused", "refused"]
    assert _types(sweep).count("sweep.paused") == 1


def test_a_paused_sweep_keeps_its_queued_candidates_and_lets_a_running_one_finish(sweep, user, enqueued):
    first, second, _ = sweep.candidates.all()
    assert candidates.candidate_claim(candidate_id=first.pk) is not None
    sweep_pause(sweep=sweep, by=user)

    assert candidates.candidate_claim(candidate_id=second.pk) is None
    # A redelivery of the one already started (its worker died) may still finish it.
    assert candidates.candidate_claim(candidate_id=first.pk) is not None
    assert candidates.candidate_record_result(candidate_id=first.pk, result=_result())
    assert _statuses(sweep) == ["done", "queued", "queued"]
    assert Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.PAUSED

    enqueued.clear()
    resumed = sweep_resume(sweep=sweep, by=user)
    assert resumed.status == Sweep.Status.RUNNING  # it had started before the pause
    assert enqueued == [([c.pk for c in sweep.candidates.filter(number__gt=1)], "runner.cpu")]
    assert candidates.candidate_claim(candidate_id=second.pk) is not None


def test_cancel_cancels_the_queued_candidates_and_a_late_result_does_not_uncancel(make_thesis, user, enqueued,
                                                                                 monkeypatch):
    webhooks: list[str] = []
    monkeypatch.setattr(sweeps, "webhook_event", lambda *, type, payload: webhooks.append(type))
    sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="grid", budget=2)
    first, second = sweep.candidates.all()
    candidates.candidate_claim(candidate_id=first.pk)
    candidates.candidate_claim(candidate_id=second.pk)
    candidates.candidate_record_result(candidate_id=first.pk, result=_result())

    cancelled = sweep_cancel(sweep=sweep, by=user)
    assert cancelled.stop_reason == "cancelled by ada" and cancelled.finished_at is not None
    # The last running candidate completes the count: the sweep still is not "finished".
    assert candidates.candidate_record_result(candidate_id=second.pk, result=_result())
    sweep.refresh_from_db()
    assert sweep.status == Sweep.Status.CANCELLED and sweep.done == sweep.total == 2
    assert "sweep.finished" not in _types(sweep) and "sweep.finished" not in webhooks


def test_cancel_marks_every_queued_candidate_cancelled_and_workers_skip_them(sweep, user):
    first, second, third = sweep.candidates.all()
    candidates.candidate_claim(candidate_id=first.pk)
    sweep_pause(sweep=sweep, by=user)
    sweep_cancel(sweep=sweep, by=user)
    assert _statuses(sweep) == ["running", "cancelled", "cancelled"]
    assert candidates.candidate_claim(candidate_id=second.pk) is None
    assert Candidate.objects.get(pk=second.pk).status == Candidate.Status.CANCELLED


def test_each_change_appends_a_live_event_with_the_new_status(sweep, user):
    sweep_pause(sweep=sweep, by=user)
    sweep_resume(sweep=sweep, by=user)
    sweep_cancel(sweep=sweep, by=user)
    events = list(Event.objects.filter(sweep=sweep).order_by("seq"))
    assert [e.type for e in events] == ["sweep.created", "sweep.paused", "sweep.resumed", "sweep.cancelled"]
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert events[1].payload == {"status": "paused", "by": "ada"}
    assert events[2].payload == {"status": "queued", "by": "ada", "requeued": 3}
    assert events[3].payload == {"status": "cancelled", "by": "ada", "stop_reason": "cancelled by ada",
                                 "cancelled": 3}


def test_a_control_event_updates_the_status_and_offers_buttons_only_to_those_who_may_use_them(sweep, user):
    sweep_pause(sweep=sweep, by=user)
    message = Event.objects.get(sweep=sweep, type="sweep.paused").as_message()
    html = event_frame(message, can_control=True)["html"]
    assert 'id="sweep-status"' in html and ">paused<" in html and "Paused by ada" in html
    assert 'name="resume"' in html and 'name="cancel"' in html and 'name="pause"' not in html
    watcher = event_frame(message)["html"]
    assert 'id="sweep-controls"' in watcher and "<button" not in watcher


async def _socket(sweep: Sweep, user) -> WebsocketCommunicator:
    client = Client()
    await sync_to_async(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    communicator = WebsocketCommunicator(application, f"/ws/sweeps/{sweep.pk}/",
                                         headers=[(b"origin", b"http://localhost"), (b"host", b"localhost"),
                                                  (b"cookie", cookie)])
    connected, _ = await communicator.connect()
    assert connected
    last_seq = await sync_to_async(Sweep.objects.values_list("last_seq", flat=True).get)(pk=sweep.pk)
    await communicator.send_json_to({"after": last_seq})
    return communicator


async def test_every_open_page_hears_of_a_pause_and_only_its_controller_gets_buttons(sweep, user):
    watcher = await sync_to_async(User.objects.create_user)("mallory")
    sockets = [await _socket(sweep, user), await _socket(sweep, watcher)]
    await sync_to_async(sweep_pause)(sweep=sweep, by=user)
    mine, theirs = [await s.receive_json_from(timeout=5) for s in sockets]
    assert mine["type"] == theirs["type"] == "sweep.paused" and mine["payload"]["status"] == "paused"
    assert 'name="resume"' in mine["html"] and "<button" not in theirs["html"]
    assert ">paused<" in theirs["html"]
    for s in sockets:
        await s.disconnect()


# Views


def test_the_sweep_page_shows_only_the_valid_actions(logged_in_client, sweep, user):
    html = logged_in_client.get(sweep.get_absolute_url()).content.decode()
    assert 'name="pause"' in html and 'name="cancel"' in html and 'name="resume"' not in html
    sweep_cancel(sweep=sweep, by=user)
    html = logged_in_client.get(sweep.get_absolute_url()).content.decode()
    assert 'name="pause"' not in html and 'name="cancel"' not in html
    assert "Stopped: cancelled by ada" in html


def test_pausing_with_htmx_returns_the_controls_alone(logged_in_client, sweep):
    """The page's own event can replace the controls before the answer lands, detaching the
    form htmx resolves any further target from (an HX-Retarget threw "Invalid re-target
    #sweep-controls" under load): the new status comes with that event instead."""
    response = logged_in_client.post(reverse("sweep_pause", args=[sweep.pk]), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and "HX-Retarget" not in response.headers
    assert html.lstrip().startswith('<div id="sweep-controls"')
    assert 'name="resume"' in html and 'name="pause"' not in html
    assert "hx-swap-oob" not in html and 'id="sweep-status"' not in html
    assert Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.PAUSED


def test_an_invalid_action_with_htmx_says_why_in_the_controls(logged_in_client, sweep):
    response = logged_in_client.post(reverse("sweep_resume", args=[sweep.pk]), HTTP_HX_REQUEST="true")
    assert response.status_code == 422
    assert "is queued: it cannot be resumed" in response.content.decode()


def test_without_javascript_it_redirects_to_the_sweep_and_shows_a_refusal(logged_in_client, sweep):
    response = logged_in_client.post(reverse("sweep_cancel", args=[sweep.pk]))
    assert response.status_code == 302 and response["Location"] == sweep.get_absolute_url()
    assert Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.CANCELLED
    refused = logged_in_client.post(reverse("sweep_pause", args=[sweep.pk]), follow=True)
    assert "is cancelled: it cannot be paused" in refused.content.decode()


def test_someone_else_is_refused_and_sees_no_buttons(client, sweep):
    client.force_login(User.objects.create_user("mallory"))
    assert client.post(reverse("sweep_pause", args=[sweep.pk]), HTTP_HX_REQUEST="true").status_code == 403
    assert "<button" not in client.get(sweep.get_absolute_url()).content.decode().split('id="sweep-controls"')[1][:200]
    assert client.get(reverse("sweep_pause", args=[sweep.pk])).status_code == 405
    assert Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.QUEUED


# A real worker


def test_a_real_worker_skips_a_paused_sweep_and_evaluates_it_after_resume(make_thesis, user):
    sweep = sweeps.sweep_start(thesis=make_thesis(context_lengths=[64], batch_sizes=[1]), started_by=user,
                                 kernel="blocked", strategy="grid", budget=1)
    sweep_pause(sweep=sweep, by=user)  # before any worker is up: its message waits in the broker
    handled = threading.Semaphore(0)

    def count(sender=None, **kwargs) -> None:
        if sender is not None and sender.name == "research.tasks.evaluate_candidate":
            handled.release()

    task_postrun.connect(count, weak=False)
    try:
        with cpu_worker():
            assert handled.acquire(timeout=60), "the worker never took the paused sweep's message"
            assert _statuses(sweep) == ["queued"] and "candidate.started" not in _types(sweep)

            sweep_resume(sweep=sweep, by=user)
            wait_until_finished(sweep.pk)
    finally:
        task_postrun.disconnect(count)
    sweep.refresh_from_db()
    assert sweep.status == Sweep.Status.FINISHED and sweep.done == 1
    assert _statuses(sweep) == ["done"]
    assert _types(sweep) == ["sweep.created", "sweep.paused", "sweep.resumed", "sweep.started",
                             "candidate.started", "candidate.result", "sweep.finished"]


def test_resuming_lets_the_sweep_propose_its_next_candidates(sweep, user, monkeypatch):
    continued: list[int] = []
    monkeypatch.setattr(sweeps, "sweep_continue", lambda *, sweep_id: continued.append(sweep_id))
    sweep_pause(sweep=sweep, by=user)
    sweep_resume(sweep=sweep, by=user)
    assert continued == [sweep.pk]

