"""Celery tasks: the interface between the queue and the services. Load, call, done.

Each worker also runs research.recovery from a thread of its main process, once when
it starts and every RECOVER_EVERY_S after: a lost message must not depend on another
message (a task or a beat schedule) to be noticed.
"""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown
from django.conf import settings
from django.db import close_old_connections, connections

from research import agents, candidates, recovery
from research.evaluation import evaluate_source
from research.hardware import HARDWARE
from research.provenance import worker_provenance

logger = logging.getLogger(__name__)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def evaluate_candidate(candidate_id: int, dispatch: str) -> None:
    candidate = candidates.candidate_claim(candidate_id=candidate_id, dispatch=dispatch)
    if candidate is None:
        return  # already recorded, given up on, sent again, or its sweep is paused or cancelled
    sweep = candidate.sweep
    thesis = sweep.thesis
    result = evaluate_source(
        op=thesis.op,
        source=candidate.source,
        device=HARDWARE[sweep.hardware].device,
        context_lengths=thesis.context_lengths,
        batch_sizes=thesis.batch_sizes,
        dsl=thesis.required_dsl,
        baseline_source=sweep.baseline_source,
        baseline_kernel=sweep.baseline_kernel,
        # The shared kernel code as the candidate's commit and the kept kernel's hold it.
        lib_commit=candidate.commit,
        baseline_lib_commit=sweep.base_commit,
    )
    candidates.candidate_record_result(candidate_id=candidate_id, result=result,
                                       provenance=worker_provenance(queue=sweep.queue))


@shared_task(bind=True)
def propose_with_agent(self, sweep_id: int) -> None:
    """One proposal of an agent sweep (queue "default"): it queues its own follow-up."""
    agents.proposal_make(sweep_id=sweep_id, task_id=self.request.id or "")


_stopping = threading.Event()


@worker_ready.connect
def recover_stranded_while_the_worker_runs(sender=None, **kwargs) -> None:
    if settings.RECOVER_EVERY_S > 0:
        _stopping.clear()
        threading.Thread(target=_recover_until_shutdown, args=(settings.RECOVER_EVERY_S,),
                         name="recover-stranded", daemon=True).start()


@worker_shutdown.connect
def stop_recovering(sender=None, **kwargs) -> None:
    _stopping.set()


def _recover_until_shutdown(every_s: float) -> None:
    while True:
        close_old_connections()
        try:
            recovered = recovery.stranded_resend()
            if recovered:
                logger.warning("sent again what lost its message: %s", recovered)
        except Exception:  # noqa: BLE001 — a database or broker outage: try again next time
            logger.exception("recovering stranded work failed; trying again in %s s", every_s)
        finally:
            connections.close_all()
        if _stopping.wait(every_s):
            return
