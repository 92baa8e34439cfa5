"""Work whose queue message was lost is sent again.

The database says what is owed: a queued candidate is owed an evaluation, a running
agent sweep its next proposal. The broker can still lose the message that would do
it — Redis restarted without its append-only file, a failover to a replica that was
behind, a flush, a process that died between its commit and the send — and then
nothing would ever come: the sweep would wait forever.

`stranded_resend` finds such work and sends it again:

- a queued candidate sent more than RECOVER_AFTER_S ago while its queue is empty;
- a running candidate started more than CANDIDATE_TIME_LIMIT_S + RECOVER_AFTER_S ago:
  its evaluation would have ended by then, so its worker died, and a broker that
  still held the message would have handed it out again (the visibility timeout). It
  goes back to queued with its attempt counted, or ends failed if that was its last;
- an agent sweep that wants its next proposal, has recorded nothing for
  RECOVER_AFTER_S, and whose queue ("default") is empty.

A re-sent evaluation carries a fresh dispatch token (research.queueing.evaluations_enqueue),
so the old message, should it turn up after all, claims nothing; a second proposal
message finds the first one's claim and does nothing. Of several workers recovering
at once, a conditional update lets one re-send each piece of work.

Every worker runs this when it starts and every RECOVER_EVERY_S after, from a thread
of its own (research.tasks): nothing depends on a message surviving.
`manage.py recover_stranded` runs it once, from cron or by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from research import agents, candidates, queueing
from research.events import event_append
from research.models import Candidate, Sweep

REQUEUED = "candidate.requeued"
PROPOSAL_RESENT = "agent.resent"
AGENT_QUEUE = "default"
_ACTIVE = [Sweep.Status.QUEUED, Sweep.Status.RUNNING]


@dataclass
class Recovered:
    """What one pass sent again, by candidate and sweep id."""

    queued: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    proposals: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.queued or self.running or self.failed or self.proposals)


def stranded_resend(*, queue_length=None) -> Recovered:
    """One pass over everything owed. `queue_length(name)` counts a queue's waiting
    messages (the broker's, by default)."""
    queue_length = queue_length or broker_queue_length
    now = timezone.now()
    after = timedelta(seconds=settings.RECOVER_AFTER_S)
    recovered = Recovered()
    _resend_running(now - after - timedelta(seconds=settings.CANDIDATE_TIME_LIMIT_S), recovered)
    _resend_queued(now - after, queue_length, recovered)
    _resend_proposals(now - after, queue_length, recovered)
    return recovered


def broker_queue_length(queue: str) -> int:
    from config.celery import app

    with app.connection_for_write() as connection:
        return connection.default_channel.queue_declare(queue=queue).message_count


def _resend_running(cutoff, recovered: Recovered) -> None:
    stale = Candidate.objects.filter(status=Candidate.Status.RUNNING, started_at__lt=cutoff,
                                     sweep__status__in=[*_ACTIVE, Sweep.Status.PAUSED])
    for candidate in stale.select_related("sweep"):
        if candidate.attempts >= candidates.MAX_ATTEMPTS:
            if candidates.candidate_fail_if_out_of_attempts(candidate.pk, candidate.dispatch):
                recovered.failed.append(candidate.pk)
            continue
        with transaction.atomic():
            if not Candidate.objects.filter(pk=candidate.pk, status=Candidate.Status.RUNNING,
                                            started_at=candidate.started_at).update(status=Candidate.Status.QUEUED):
                continue  # it was recorded, or another worker recovered it first
            _requeued(candidate, f"its worker was lost during attempt {candidate.attempts}")
        recovered.running.append(candidate.pk)


def _resend_queued(cutoff, queue_length, recovered: Recovered) -> None:
    stale = Candidate.objects.filter(status=Candidate.Status.QUEUED, dispatched_at__lt=cutoff,
                                     sweep__status__in=_ACTIVE).select_related("sweep")
    empty: dict[str, bool] = {}
    for candidate in stale:
        queue = candidate.sweep.queue
        if queue not in empty:
            empty[queue] = queue_length(queue) == 0
        if not empty[queue]:
            continue  # the workers are still draining it: the message may be there
        with transaction.atomic():
            if not Candidate.objects.filter(pk=candidate.pk, status=Candidate.Status.QUEUED,
                                            dispatched_at=candidate.dispatched_at).update(dispatched_at=timezone.now()):
                continue
            _requeued(candidate, "its queue message was lost")
        recovered.queued.append(candidate.pk)


def _requeued(candidate: Candidate, reason: str) -> None:
    """Say so on the sweep's stream and send it once this commits (not while paused:
    resuming sends every queued candidate)."""
    sweep = candidate.sweep
    event_append(sweep_id=sweep.pk, type=REQUEUED, payload={"number": candidate.number, "reason": reason})
    if sweep.status != Sweep.Status.PAUSED:
        transaction.on_commit(lambda: queueing.evaluations_enqueue([candidate.pk], sweep.queue))


def _resend_proposals(cutoff, queue_length, recovered: Recovered) -> None:
    sweeps = Sweep.objects.filter(strategy=Sweep.Strategy.AGENT, status__in=_ACTIVE, stop_reason="")
    for sweep in sweeps:
        last = sweep.events.order_by("-seq").first()
        if last is not None and last.created_at >= cutoff:
            continue
        if not agents.proposal_wanted(sweep) or queue_length(AGENT_QUEUE) != 0:
            continue
        with transaction.atomic():
            # The sweep's row lock: of several workers recovering at once, one re-sends.
            locked = Sweep.objects.select_for_update().get(pk=sweep.pk)
            if locked.last_seq != sweep.last_seq:
                continue
            # The event also restarts the clock, so a message waiting in a busy
            # worker's prefetch is not sent again on every pass.
            event_append(sweep_id=sweep.pk, type=PROPOSAL_RESENT,
                         payload={"reason": "the message asking for its next proposal was lost"})
            transaction.on_commit(lambda sweep_id=sweep.pk: queueing.proposal_enqueue(sweep_id))
        recovered.proposals.append(sweep.pk)
