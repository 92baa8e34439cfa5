"""Reads for pages, partials and the live stream."""

from __future__ import annotations

from django.db.models import Count, Q, QuerySet
from django.shortcuts import get_object_or_404

from research.hardware import HARDWARE
from research.models import Candidate, Event, Measurement, Sweep, Thesis
from runners import ops
from runners.harness.dsl import kernel_dsl

RESULT_PAGE_SIZE = 200


def thesis_list_for_dashboard(*, archived: bool = False) -> QuerySet[Thesis]:
    """The theses in play, or with `archived` the archived ones."""
    return Thesis.objects.filter(archived_at__isnull=not archived).select_related("author", "evidence").annotate(
        sweep_count=Count("sweeps")
    )


def sweep_list_recent(limit: int = 10) -> QuerySet[Sweep]:
    return Sweep.objects.select_related("thesis", "started_by")[:limit]


def thesis_get(thesis_id: int) -> Thesis:
    return get_object_or_404(Thesis.objects.select_related("author", "evidence"), pk=thesis_id)


def thesis_kernels(thesis: Thesis) -> list[str]:
    """The op's tunable kernels written in the DSL the thesis requires."""
    return sorted(
        name for name, path in ops.get_op(thesis.op).kernels().items()
        if kernel_dsl(path) == thesis.required_dsl
    )


def sweep_get(sweep_id: int) -> Sweep:
    return get_object_or_404(Sweep.objects.select_related("thesis", "started_by"), pk=sweep_id)


def candidate_get(candidate_id: int) -> Candidate:
    return get_object_or_404(
        Candidate.objects.select_related("sweep__thesis__author", "sweep__thesis__evidence",
                                         "sweep__started_by"),
        pk=candidate_id,
    )


def sweep_results(sweep: Sweep, *, after_number: int = 0, limit: int = RESULT_PAGE_SIZE) -> list[Candidate]:
    """Recorded candidates in sweep order, without their measurements: research.result_rows
    reads those of the rows it has to draw."""
    return list(
        sweep.candidates.filter(
            status__in=[Candidate.Status.DONE, Candidate.Status.FAILED], number__gt=after_number
        )
        .only(
            "id", "sweep_id", "number", "params", "status", "verdict", "correct",
            "geomean_speedup", "best_speedup", "error",
        )[:limit]
    )


def sweep_refused(sweep: Sweep) -> list[Candidate]:
    """Proposals refused before evaluation (an agent sweep's), with their reasons."""
    return list(sweep.candidates.filter(status=Candidate.Status.REFUSED).only(
        "id", "sweep_id", "number", "params", "refusal"))


def sweep_speedup_points(sweep: Sweep) -> list[tuple[int, int, float]]:
    return list(
        Measurement.objects.filter(candidate__sweep=sweep, speedup__isnull=False)
        .order_by("candidate__number", "position")
        .values_list("candidate__number", "position", "speedup")
    )


def sweep_counts(sweep: Sweep) -> dict[str, int]:
    return sweep.candidates.aggregate(
        running=Count("id", filter=Q(status=Candidate.Status.RUNNING)),
        wins=Count("id", filter=Q(verdict="win")),
        rejected=Count("id", filter=Q(verdict="rejected")),
    )


def sweep_events_after(sweep_id: int, seq: int, *, limit: int = 1000) -> list[dict]:
    return [
        event.as_message()
        for event in Event.objects.filter(sweep_id=sweep_id, seq__gt=seq).order_by("seq")[:limit]
    ]


def sweep_last_seq(sweep_id: int) -> int:
    """The seq of the sweep's latest event (0 for none or no such sweep)."""
    return Sweep.objects.filter(pk=sweep_id).values_list("last_seq", flat=True).first() or 0


def sweep_workload_names(sweep: Sweep) -> list[str]:
    thesis = sweep.thesis
    target = ops.get_op(thesis.op)
    device = HARDWARE[sweep.hardware].device
    try:
        return [w.name for w in target.workloads(device, thesis.context_lengths, thesis.batch_sizes)]
    except ops.WorkloadError:
        # A sweep started before such sweeps were refused: its hardware cannot make the
        # thesis's sizes, so it has no workload to chart (its candidates say why they failed).
        return []
