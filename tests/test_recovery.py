"""Work whose queue message was lost is sent again, once, and an old copy claims nothing.

The broker is replaced by what `queueing.evaluation_send` and `queueing.proposal_enqueue` were asked to
send, and by the queue length each test says; tests/test_faults.py loses a real Redis's
data under a real worker.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from research import candidates, queueing, sweeps
from research.models import Candidate, Event, Sweep
from research.recovery import PROPOSAL_RESENT, REQUEUED, stranded_resend
from research.sweep_control import sweep_pause, sweep_resume
from tests.test_agents import _command

pytestmark = pytest.mark.django_db(transaction=True)



@pytest.fixture
def sent(monkeypatch) -> list[tuple[int, str, str]]:
    """(candidate, dispatch token, queue) of every evaluation message sent."""
    messages: list[tuple[int, str, str]] = []
    monkeypatch.setattr(queueing, "evaluation_send",
                        lambda candidate_id, dispatch, queue: messages.append((candidate_id, dispatch, queue)))
    return messages


@pytest.fixture
def sweep(make_thesis, user, sent) -> Sweep:
    return sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="grid", budget=2)


def _age(candidates, **fields_ago: float) -> None:
    """Move a time field of the candidates this many seconds into the past."""
    candidates.update(**{name: timezone.now() - timedelta(seconds=s) for name, s in fields_ago.items()})


def _lost_for() -> float:
    return settings.RECOVER_AFTER_S + 1


def _types(sweep: Sweep) -> list[str]:
    return list(Event.objects.filter(sweep=sweep).order_by("seq").values_list("type", flat=True))


def _token(sent, candidate_id: int) -> str:
    return [token for pk, token, _ in sent if pk == candidate_id][-1]


def test_a_queued_candidate_whose_message_was_lost_is_sent_again_and_the_old_message_claims_nothing(
    sweep, sent
):
    first_tokens = {pk: token for pk, token, _ in sent}
    assert len(first_tokens) == 2 and all(first_tokens.values())
    _age(sweep.candidates.all(), dispatched_at=_lost_for())

    recovered = stranded_resend(queue_length=lambda queue: 0)

    ids = sorted(first_tokens)
    assert sorted(recovered.queued) == ids and not recovered.running
    assert len(sent) == 4 and all(queue == sweep.queue for _, _, queue in sent)
    for pk in ids:
        new = _token(sent, pk)
        assert new != first_tokens[pk]
        # The lost message turns up after all: it claims nothing, and no attempt is counted.
        assert candidates.candidate_claim(candidate_id=pk, dispatch=first_tokens[pk]) is None
        assert Candidate.objects.get(pk=pk).attempts == 0
        assert candidates.candidate_claim(candidate_id=pk, dispatch=new) is not None
    requeued = Event.objects.filter(sweep=sweep, type=REQUEUED)
    assert sorted(e.payload["number"] for e in requeued) == [1, 2]
    assert all(e.payload["reason"] == "its queue message was lost" for e in requeued)
    # Sent again just now: the next pass leaves them alone.
    assert not stranded_resend(queue_length=lambda queue: 0) and len(sent) == 4


def test_nothing_is_sent_again_while_its_queue_holds_messages_or_before_the_grace_period(sweep, sent):
    _age(sweep.candidates.all(), dispatched_at=settings.RECOVER_AFTER_S - 30)
    assert not stranded_resend(queue_length=lambda queue: 0)
    _age(sweep.candidates.all(), dispatched_at=_lost_for())
    asked = []
    assert not stranded_resend(queue_length=lambda queue: asked.append(queue) or 7)
    assert asked == [sweep.queue]  # asked once for the queue, not once per candidate
    assert len(sent) == 2 and REQUEUED not in _types(sweep)


def test_an_abandoned_running_candidate_is_queued_again_with_its_attempt_counted(sweep, sent):
    candidate = sweep.candidates.get(number=1)
    first = _token(sent, candidate.pk)
    assert candidates.candidate_claim(candidate_id=candidate.pk, dispatch=first)
    abandoned = settings.CANDIDATE_TIME_LIMIT_S + settings.RECOVER_AFTER_S
    _age(Candidate.objects.filter(pk=candidate.pk), started_at=abandoned - 30)
    assert not stranded_resend(queue_length=lambda queue: 5).running  # it may still be running

    _age(Candidate.objects.filter(pk=candidate.pk), started_at=abandoned + 1)
    assert stranded_resend(queue_length=lambda queue: 5).running == [candidate.pk]

    candidate.refresh_from_db()
    assert candidate.status == Candidate.Status.QUEUED and candidate.attempts == 1
    # The broker redelivers the dead worker's message after all: it claims nothing.
    assert candidates.candidate_claim(candidate_id=candidate.pk, dispatch=first) is None
    claimed = candidates.candidate_claim(candidate_id=candidate.pk, dispatch=_token(sent, candidate.pk))
    assert claimed.attempts == 2
    assert Event.objects.get(sweep=sweep, type=REQUEUED).payload == {
        "number": 1, "reason": "its worker was lost during attempt 1"}


def test_an_abandoned_candidate_at_its_last_attempt_ends_failed(sweep, sent):
    candidate = sweep.candidates.get(number=1)
    token = _token(sent, candidate.pk)
    for _ in range(candidates.MAX_ATTEMPTS):  # each attempt's worker died
        assert candidates.candidate_claim(candidate_id=candidate.pk, dispatch=token)
    _age(Candidate.objects.filter(pk=candidate.pk),
         started_at=settings.CANDIDATE_TIME_LIMIT_S + settings.RECOVER_AFTER_S + 1)

    assert stranded_resend(queue_length=lambda queue: 0).failed == [candidate.pk]
    candidate.refresh_from_db()
    assert candidate.status == Candidate.Status.FAILED and candidate.verdict == "rejected"
    assert f"{candidates.MAX_ATTEMPTS} times" in candidate.error


def test_a_replaced_message_arriving_during_the_last_attempt_leaves_it_running(sweep, sent):
    candidate = sweep.candidates.get(number=1)
    stale = _token(sent, candidate.pk)
    _age(Candidate.objects.filter(pk=candidate.pk), dispatched_at=_lost_for())
    stranded_resend(queue_length=lambda queue: 0)
    current = _token(sent, candidate.pk)
    for _ in range(candidates.MAX_ATTEMPTS):
        assert candidates.candidate_claim(candidate_id=candidate.pk, dispatch=current)

    assert candidates.candidate_claim(candidate_id=candidate.pk, dispatch=stale) is None
    assert Candidate.objects.get(pk=candidate.pk).status == Candidate.Status.RUNNING


def test_a_paused_sweep_gets_its_abandoned_candidate_back_on_resume_not_before(sweep, sent, user):
    candidate = sweep.candidates.get(number=1)
    assert candidates.candidate_claim(candidate_id=candidate.pk, dispatch=_token(sent, candidate.pk))
    sweep_pause(sweep=sweep, by=user)
    _age(Candidate.objects.filter(pk=candidate.pk),
         started_at=settings.CANDIDATE_TIME_LIMIT_S + settings.RECOVER_AFTER_S + 1)
    before = len(sent)

    assert stranded_resend(queue_length=lambda queue: 0).running == [candidate.pk]
    assert len(sent) == before and Candidate.objects.get(pk=candidate.pk).status == Candidate.Status.QUEUED

    sweep_resume(sweep=sweep, by=user)
    assert sorted(pk for pk, _, _ in sent[before:]) == sorted(sweep.candidates.values_list("pk", flat=True))


def test_an_agent_sweep_whose_proposal_message_was_lost_is_asked_again_once(make_thesis, user, settings,
                                                                           monkeypatch, sent):
    settings.AGENT_COMMANDS = {"scripted": _command("good")}
    asked: list[int] = []
    monkeypatch.setattr(queueing, "proposal_enqueue", asked.append)
    sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="agent",
                                 budget=2, agent_command="scripted")
    assert asked == [sweep.pk]  # and that message is lost
    assert not stranded_resend(queue_length=lambda queue: 0).proposals  # too soon to tell
    Event.objects.filter(sweep=sweep).update(created_at=timezone.now() - timedelta(seconds=_lost_for()))
    assert not stranded_resend(queue_length=lambda queue: 1).proposals  # a message is waiting

    assert stranded_resend(queue_length=lambda queue: 0).proposals == [sweep.pk]
    assert asked == [sweep.pk, sweep.pk] and _types(sweep)[-1] == PROPOSAL_RESENT
    assert not stranded_resend(queue_length=lambda queue: 0).proposals


def test_two_workers_recovering_at_once_send_each_candidate_once(sweep, sent):
    _age(sweep.candidates.all(), dispatched_at=_lost_for())
    both_selected = threading.Barrier(2, timeout=30)
    results = []

    def recover() -> None:
        def queue_length(queue: str) -> int:
            both_selected.wait()  # each has read the same stale candidates
            return 0
        try:
            results.append(stranded_resend(queue_length=queue_length))
        finally:
            connection.close()

    threads = [threading.Thread(target=recover) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert sorted(pk for r in results for pk in r.queued) == sorted(sweep.candidates.values_list("pk", flat=True))
    assert len(sent) == 4 and _types(sweep).count(REQUEUED) == 2


def test_the_command_recovers_once_and_says_what(sweep, sent, monkeypatch, capsys):
    monkeypatch.setattr("research.recovery.broker_queue_length", lambda queue: 0)
    _age(sweep.candidates.all(), dispatched_at=_lost_for())
    call_command("recover_stranded")
    assert "queued again: 2 waiting and 0 abandoned candidates" in capsys.readouterr().out
    assert len(sent) == 4
