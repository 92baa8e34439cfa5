"""Appending to a sweep's event stream (CONTRACTS §6)."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from research.live import publish_sweep_event
from research.models import Event, Sweep


def event_append(*, sweep_id: int, type: str, payload: dict) -> Event:
    """Store the next event of a sweep and publish it once the transaction commits.

    The seq comes from an UPDATE on the sweep row: the row lock it takes serialises
    concurrent writers, so seqs are 1, 2, 3, … with no gaps and no duplicates.
    """
    with transaction.atomic():
        Sweep.objects.filter(pk=sweep_id).update(last_seq=F("last_seq") + 1)
        seq = Sweep.objects.values_list("last_seq", flat=True).get(pk=sweep_id)
        event = Event.objects.create(sweep_id=sweep_id, seq=seq, type=type, payload=payload)
        message = event.as_message()
        transaction.on_commit(lambda: publish_sweep_event(message))
    return event
