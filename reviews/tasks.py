"""Celery tasks of reviews: load, call, done."""

from __future__ import annotations

from celery import shared_task

from reviews import compounding


@shared_task(acks_late=True, reject_on_worker_lost=True)
def measure_compound(run_id: int) -> None:
    """A hardware class's waterfall, on that class's queue (reviews.compounding)."""
    compounding.measure(run_id)
