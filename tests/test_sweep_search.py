"""Model-based sweeps and early stops, through the services with hand-recorded results.

The results are test data in the harness's shape (tests/reviewing.py), recorded the way
a worker records them, so these tests run no evaluation.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from research import candidates, queueing, sweeps
import workspace
from research.models import Candidate, Event, Sweep
from research.proposers import point_key
from tests.reviewing import record, recorded_result

pytestmark = pytest.mark.django_db(transaction=True)

NO_GAIN = (1.0, 1.0, 1.0, 1.0)
WIN = (1.30, 1.24, 1.02, 0.99)


@pytest.fixture(autouse=True)
def no_enqueue(monkeypatch, workspace_dir):
    # Results are recorded by the tests themselves; the worker path has its own tests.
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)


@pytest.fixture
def workspace_dir(settings, tmp_path):
    settings.KERNEL_WORKSPACE = tmp_path / "workspace"


@pytest.fixture
def start(make_thesis, user):
    def start_sweep(strategy: str, budget: int, **stops) -> Sweep:
        return sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked",
                                    strategy=strategy, budget=budget, **stops)
    return start_sweep


def _queued(sweep: Sweep) -> list[Candidate]:
    return list(sweep.candidates.filter(status=Candidate.Status.QUEUED))


def _sweep(sweep: Sweep) -> Sweep:
    return Sweep.objects.get(pk=sweep.pk)


def test_a_tpe_sweep_keeps_two_candidates_in_flight_until_its_budget_is_planned(start):
    sweep = start("tpe", 5)
    assert sweep.total == 5 and sweep.candidates.count() == 2
    recorded = 0
    while queued := _queued(sweep):
        record(queued[0], recorded_result(WIN if recorded == 2 else NO_GAIN))
        recorded += 1
        in_flight = sweep.candidates.filter(status=Candidate.Status.QUEUED).count()
        assert in_flight == min(2, 5 - recorded)
    candidates = list(sweep.candidates.all())
    assert [c.number for c in candidates] == [1, 2, 3, 4, 5]
    assert len({point_key(c.params) for c in candidates}) == 5
    assert {c.proposed_by for c in candidates} == {"tpe"}
    finished = _sweep(sweep)
    assert (finished.status, finished.done, finished.total, finished.stop_reason) == ("finished", 5, 5, "")
    # Every batch forks where the first did (the commit swapping the kernel in), and each
    # candidate's file is its point.
    forks = {workspace.commit_info(c.commit)["parents"][0] for c in candidates}
    assert len(forks) == 1 and forks != {sweep.base_commit}
    assert all(workspace.branches("candidate/")[c.branch] == c.commit for c in candidates)
    assert all(f'"block_rows": {c.params["block_rows"]},' in c.source for c in candidates)


def test_patience_stops_a_tpe_sweep_and_cancels_what_is_queued(start):
    sweep = start("tpe", 10, patience=2)
    for _ in range(3):
        record(_queued(sweep)[0], recorded_result(NO_GAIN))
    stopped = _sweep(sweep)
    reason = "stopped early: 2 candidates without improvement"
    assert (stopped.status, stopped.stop_reason, stopped.done, stopped.total) == ("finished", reason, 3, 3)
    cancelled = sweep.candidates.get(status=Candidate.Status.CANCELLED)
    assert cancelled.error == reason
    assert candidates.candidate_claim(candidate_id=cancelled.pk) is None
    finished = Event.objects.filter(sweep=sweep, type="sweep.finished").get()
    assert finished.payload == {"done": 3, "total": 3, "wins": 0, "rejected": 0, "stop_reason": reason}


def test_patience_stops_a_grid_sweep_once_its_running_candidates_are_recorded(start):
    sweep = start("grid", 6, patience=1)
    first, second, third = sweep.candidates.all()[:3]
    for candidate in (first, second, third):
        candidates.candidate_claim(candidate_id=candidate.pk)
    candidates.candidate_record_result(candidate_id=first.pk, result=recorded_result(WIN))
    candidates.candidate_record_result(candidate_id=second.pk, result=recorded_result(NO_GAIN))
    stopping = _sweep(sweep)
    # The third is being evaluated: it still counts, and its result ends the sweep.
    assert (stopping.status, stopping.done, stopping.total) == ("running", 2, 3)
    assert stopping.stop_reason == "stopped early: 1 candidate without improvement"
    assert sweep.candidates.filter(status=Candidate.Status.CANCELLED).count() == 3
    candidates.candidate_record_result(candidate_id=third.pk, result=recorded_result(NO_GAIN))
    stopped = _sweep(sweep)
    assert (stopped.status, stopped.done, stopped.total) == ("finished", 3, 3)
    assert Event.objects.filter(sweep=sweep, type="sweep.finished").count() == 1


def test_an_improvement_resets_the_patience_count(start):
    sweep = start("grid", 6, patience=2)
    for speedups in (NO_GAIN, (1.1,) * 4, NO_GAIN, (1.2,) * 4, NO_GAIN):
        record(_queued(sweep)[0], recorded_result(speedups))
    assert _sweep(sweep).status == "running" and len(_queued(sweep)) == 1


def test_a_spent_time_budget_stops_a_random_sweep(start):
    sweep = start("random", 4, time_budget_s=60)
    record(_queued(sweep)[0], recorded_result(NO_GAIN))
    assert _sweep(sweep).status == "running"
    Sweep.objects.filter(pk=sweep.pk).update(created_at=timezone.now() - timedelta(seconds=61))
    record(_queued(sweep)[0], recorded_result(WIN))
    stopped = _sweep(sweep)
    assert (stopped.status, stopped.done, stopped.total) == ("finished", 2, 2)
    assert stopped.stop_reason == "time budget of 60 s spent"
    assert sweep.candidates.filter(status=Candidate.Status.CANCELLED).count() == 2


def test_a_paused_sweep_proposes_nothing_until_it_is_continued(start):
    sweep = start("tpe", 6)
    first = sweep.candidates.get(number=1)
    candidates.candidate_claim(candidate_id=first.pk)
    Sweep.objects.filter(pk=sweep.pk).update(status=Sweep.Status.PAUSED)
    candidates.candidate_record_result(candidate_id=first.pk, result=recorded_result(NO_GAIN))
    assert sweep.candidates.count() == 2
    Sweep.objects.filter(pk=sweep.pk).update(status=Sweep.Status.RUNNING)  # resumed
    sweeps.sweep_continue(sweep_id=sweep.pk)
    assert sweep.candidates.count() == 3 and len(_queued(sweep)) == 2


def test_two_results_recorded_at_once_propose_no_duplicate_and_stay_in_budget(start):
    sweep = start("tpe", 4)
    first, second = sweep.candidates.all()
    for candidate in (first, second):
        candidates.candidate_claim(candidate_id=candidate.pk)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def deliver(candidate: Candidate) -> None:
        try:
            barrier.wait()
            candidates.candidate_record_result(candidate_id=candidate.pk, result=recorded_result(NO_GAIN))
        except BaseException as error:  # noqa: BLE001 — reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=deliver, args=(c,)) for c in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    planned = list(sweep.candidates.all())
    assert [c.number for c in planned] == [1, 2, 3, 4]
    assert len({point_key(c.params) for c in planned}) == 4
    assert _sweep(sweep).done == 2


def test_the_sweep_page_shows_why_it_stopped(logged_in_client, start):
    sweep = start("tpe", 4, patience=1, time_budget_s=600)
    record(_queued(sweep)[0], recorded_result(NO_GAIN))
    record(_queued(sweep)[0], recorded_result(NO_GAIN))
    html = logged_in_client.get(sweep.get_absolute_url()).content.decode()
    assert "Stopped: stopped early: 1 candidate without improvement" in html
    assert "Model-based (TPE)" in html and "or 600 s" in html and "patience 1" in html


def test_the_sweep_form_starts_a_tpe_sweep_with_its_stops(logged_in_client, make_thesis):
    thesis = make_thesis()
    response = logged_in_client.post(reverse("sweep_start", args=[thesis.pk]), {
        "kernel": "blocked", "strategy": "tpe", "budget": 6, "hardware": "cpu",
        "time_budget_s": 900, "patience": 3,
    })
    sweep = Sweep.objects.get()
    assert response.status_code == 302 and response["Location"] == sweep.get_absolute_url()
    assert (sweep.strategy, sweep.time_budget_s, sweep.patience, sweep.candidates.count()) == ("tpe", 900, 3, 2)
