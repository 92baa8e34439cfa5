"""Stale wins, and timing them again against the kernel kept since.

A win is measured against the kept kernel of its op and hardware class when its sweep
started. Once a keep replaces that kernel, the win can no longer be kept (its speedup is
over a kernel main no longer runs; workspace.merge_build refuses it), so it is
*stale*: it leaves the queue and its count at once (the keep publishes a queue change,
and pages fetch the list again), and is listed apart with one action, "re-time": a
RETIME sweep of one candidate, the same source forked from today's main and timed
against today's kept kernel, queued like any evaluation. Its result, if a win, waits in
the queue like any other; the stale win itself stays as it was.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from research import sweeps
import workspace
from research.models import Candidate, Sweep


def stale_filter() -> Q:
    """Candidates timed against a kernel that is no longer the kept one of their op and
    class. A sweep that stored no baseline (before the lab kept them) is never called stale."""
    stale = Q(pk__in=[])
    for (op, hardware), source in workspace.kept_sources().items():
        stale |= Q(sweep__thesis__op=op, sweep__hardware=hardware) & ~Q(sweep__baseline_source=source)
    return stale & ~Q(sweep__baseline_source="")


def stale_reason(candidate: Candidate) -> str | None:
    sweep = candidate.sweep
    kept = workspace.kept_sources().get((sweep.thesis.op, sweep.hardware))
    if kept is None or not sweep.baseline_source or kept == sweep.baseline_source:
        return None
    return (f"timed against {sweep.baseline_kernel or 'a kernel'} of {sweep.base_commit[:12] or 'its sweep'}, "
            f"no longer the kept {sweep.thesis.op} kernel on {sweep.get_hardware_display()}: "
            "re-time it against today's to keep it")


def retimings(candidate: Candidate) -> list[Candidate]:
    """The candidates of every RETIME sweep of `candidate`, newest first."""
    return list(Candidate.objects.filter(sweep__retimes=candidate, sweep__strategy=Sweep.Strategy.RETIME)
                .select_related("sweep").order_by("-sweep__created_at", "-sweep_id"))


def retime_start(*, candidate: Candidate, requested_by) -> Candidate:
    """Queue the stale win's source against today's kept kernel; returns the new candidate.

    Whoever asks starts the sweep, so produces its candidate: they may not decide it.
    Refused for anything but an undecided stale win, and while a re-time of it waits."""
    sweep, thesis = candidate.sweep, candidate.sweep.thesis
    if thesis.archived_at is not None:
        raise ValidationError("this thesis is archived: restore it to re-time its wins", code="archived")
    if candidate.status != Candidate.Status.DONE or candidate.verdict != "win":
        raise ValidationError("only a win is re-timed", code="not-a-win")
    if sweep.strategy == Sweep.Strategy.HEAD_TO_HEAD:
        # It was timed against another win on purpose: re-timing it would just re-time its challenger.
        raise ValidationError(f"a head-to-head is never kept, so never re-timed: re-time candidate "
                              f"{sweep.challenger.label} itself", code="head-to-head")
    with workspace.lock(), transaction.atomic():
        locked = Candidate.objects.select_for_update().select_related("sweep__thesis").get(pk=candidate.pk)
        if locked.reviews.filter(revision=locked.revision).exists():
            raise ValidationError("this revision is already decided", code="decided")
        reason = stale_reason(locked)
        if reason is None:
            raise ValidationError("it was timed against today's kept kernel: nothing to re-time", code="fresh")
        waiting = [run for run in retimings(locked) if run.status in (Candidate.Status.QUEUED,
                                                                      Candidate.Status.RUNNING)]
        if waiting:
            raise ValidationError(f"re-time {waiting[0].label} is {waiting[0].status} already", code="pending")
        kept = workspace.kept_kernel(thesis.op, sweep.hardware)
        if kept.source == locked.source:
            raise ValidationError(f"its source is the kept {kept.name} itself now: nothing to gain", code="kept")
        # Forked from today's main: its diff and its timing have the base a keep needs.
        return sweeps.sweep_of_one(
            thesis=thesis, started_by=requested_by, kernel=sweep.kernel, strategy=Sweep.Strategy.RETIME,
            hardware=sweep.hardware, base_commit=kept.commit, baseline_source=kept.source,
            baseline_kernel=kept.name, context=f"Candidate {locked.label} re-timed against the kept {kept.name}",
            source=locked.source, params=locked.params, fork=kept.commit, retimes=locked)
