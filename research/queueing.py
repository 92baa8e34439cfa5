"""Sending work to the Celery queues: the one way the services ask for it.

Tasks are sent by name, so nothing here (nor in the services that call it) imports
`research.tasks`, which imports the services: the queue is the only thing between them.
"""

from __future__ import annotations

import secrets

from celery import current_app
from django.utils import timezone

from research.models import Candidate

EVALUATE_CANDIDATE = "research.tasks.evaluate_candidate"
PROPOSE_WITH_AGENT = "research.tasks.propose_with_agent"


def evaluations_enqueue(candidate_ids: list[int], queue: str) -> None:
    """Send each still-queued candidate's evaluation, under a fresh dispatch token.

    Only the message that carries a candidate's current token may claim it, so when a
    message is sent again (on resume, or because it was lost: research.recovery) any
    older copy that still turns up is dropped instead of evaluating the candidate twice.
    """
    for candidate_id in candidate_ids:
        dispatch = secrets.token_hex(8)
        if Candidate.objects.filter(pk=candidate_id, status=Candidate.Status.QUEUED).update(
            dispatch=dispatch, dispatched_at=timezone.now()
        ):
            evaluation_send(candidate_id, dispatch, queue)


def evaluation_send(candidate_id: int, dispatch: str, queue: str) -> None:
    current_app.send_task(EVALUATE_CANDIDATE, args=[candidate_id, dispatch], queue=queue)


def proposal_enqueue(sweep_id: int) -> None:
    """Ask for an agent sweep's next proposal (research.agents.proposal_make)."""
    current_app.send_task(PROPOSE_WITH_AGENT, args=[sweep_id], queue="default")
