"""Pausing, resuming and cancelling a sweep while workers are evaluating it.

Every change is one conditional UPDATE of the sweep's status inside a transaction: of
two clicks (or a click racing a worker finishing the sweep), exactly one wins and the
other gets a ValidationError naming the state it found. Workers learn of a change
through `candidate_claim`, which refuses candidates of a paused or cancelled sweep; a
candidate already being evaluated always finishes and is recorded.

Lock order matters: the workers' services lock a candidate row, then its sweep row
(`candidate_claim`, `candidate_record_result`), so `sweep_cancel` locks the queued
candidates before the sweep too. Otherwise a claim and a cancel could deadlock.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from research import queueing, sweeps
from research.events import event_append
from research.models import Candidate, Sweep

PAUSABLE = (Sweep.Status.QUEUED, Sweep.Status.RUNNING)
RESUMABLE = (Sweep.Status.PAUSED,)
CANCELLABLE = (Sweep.Status.QUEUED, Sweep.Status.RUNNING, Sweep.Status.PAUSED)


def sweep_can_control(*, sweep: Sweep, user) -> bool:
    """The sweep's starter, the thesis author and staff may pause, resume or cancel it; a
    verification of an import only its requester and staff (an author who could pause or
    cancel it could keep a worker's refutation from ever landing)."""
    if not user.is_authenticated:
        return False
    if sweep.strategy == Sweep.Strategy.VERIFY:
        # Not even staff who imported the win or wrote the thesis: cancelling the run
        # three times, or pausing it, would keep its refutation from landing.
        if user.pk == sweep.thesis.author_id or user.pk == _importer_id(sweep):
            return False
        return user.is_staff or user.pk == sweep.started_by_id
    return user.is_staff or user.pk in (sweep.started_by_id, sweep.thesis.author_id)


def _importer_id(verification: Sweep) -> int | None:
    """Who imported the win a verification run re-measures."""
    imported = verification.verifies
    return imported.sweep.started_by_id if imported is not None else None


def sweep_actions(*, sweep: Sweep, user) -> list[str]:
    """The controls to offer this user for the sweep as it is now."""
    if not sweep_can_control(sweep=sweep, user=user):
        return []
    return sweep_actions_for_status(sweep.status)


def sweep_actions_for_status(status: str) -> list[str]:
    return [action for action, allowed in (
        ("pause", PAUSABLE), ("resume", RESUMABLE), ("cancel", CANCELLABLE)
    ) if status in allowed]


def _check_permission(sweep: Sweep, by) -> None:
    if not sweep_can_control(sweep=sweep, user=by):
        raise PermissionDenied("only the sweep's starter, the thesis author or staff may control this sweep")


def _refusal(sweep_id: int, action: str) -> ValidationError:
    status = Sweep.objects.values_list("status", flat=True).get(pk=sweep_id)
    return ValidationError(f"sweep {sweep_id} is {status}: it cannot be {action}")


def sweep_pause(*, sweep: Sweep, by) -> Sweep:
    """Workers stop taking its candidates; one being evaluated finishes and is recorded.

    Its queued candidates stay queued (their messages are dropped by the workers) and
    are queued again on resume.
    """
    _check_permission(sweep, by)
    with transaction.atomic():
        if not Sweep.objects.filter(pk=sweep.pk, status__in=PAUSABLE).update(status=Sweep.Status.PAUSED):
            raise _refusal(sweep.pk, "paused")
        event_append(sweep_id=sweep.pk, type="sweep.paused",
                     payload={"status": Sweep.Status.PAUSED, "by": by.get_username()})
    sweep.refresh_from_db()
    return sweep


def sweep_resume(*, sweep: Sweep, by) -> Sweep:
    """Queue its still-queued candidates again, on the sweep's hardware queue."""
    _check_permission(sweep, by)
    with transaction.atomic():
        # Back to running only if a worker ever started it: otherwise the first claim
        # announces the start, as for a sweep never paused.
        started = sweep.events.filter(type="sweep.started").exists()
        status = Sweep.Status.RUNNING if started else Sweep.Status.QUEUED
        if not Sweep.objects.filter(pk=sweep.pk, status__in=RESUMABLE).update(status=status):
            raise _refusal(sweep.pk, "resumed")
        queued = list(sweep.candidates.filter(status=Candidate.Status.QUEUED).values_list("pk", flat=True))
        event_append(sweep_id=sweep.pk, type="sweep.resumed",
                     payload={"status": status, "by": by.get_username(), "requeued": len(queued)})
        queue = sweep.queue
        # A message still in the broker from before the pause may also be delivered:
        # the second claim of a candidate finds it running and records it only once.
        transaction.on_commit(lambda: queueing.evaluations_enqueue(queued, queue))
    # After the commit (and outside it: it takes the workspace lock first), so a
    # model-based sweep proposes its next candidates, or a stop rule ends it.
    sweeps.sweep_continue(sweep_id=sweep.pk)
    sweep.refresh_from_db()
    return sweep


def sweep_cancel(*, sweep: Sweep, by) -> Sweep:
    """Cancel its queued candidates and end the sweep, keeping what was evaluated.

    A candidate being evaluated is still recorded when its result arrives; the sweep
    stays cancelled (`candidate_record_result` never finishes a cancelled sweep).
    """
    _check_permission(sweep, by)
    reason = f"cancelled by {by.get_username()}"[:200]
    with transaction.atomic():
        cancelled = Candidate.objects.filter(sweep_id=sweep.pk, status=Candidate.Status.QUEUED).update(
            status=Candidate.Status.CANCELLED, finished_at=timezone.now())
        if not Sweep.objects.filter(pk=sweep.pk, status__in=CANCELLABLE).update(
            status=Sweep.Status.CANCELLED, stop_reason=reason, finished_at=timezone.now()
        ):
            raise _refusal(sweep.pk, "cancelled")  # and the candidates' update rolls back
        event_append(sweep_id=sweep.pk, type="sweep.cancelled", payload={
            "status": Sweep.Status.CANCELLED, "by": by.get_username(), "stop_reason": reason,
            "cancelled": cancelled,
        })
    sweep.refresh_from_db()
    return sweep
