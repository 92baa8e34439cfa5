"""Celery tasks that send webhook deliveries: thin, the rules live in services.

How a delivery reaches its receiver whatever crashes, with no Celery beat (the quick
start runs none):

1. webhook_event writes the Delivery in the caller's transaction and enqueues
   send_delivery once that commits.
2. send_delivery makes one attempt; after a failure it re-enqueues itself with the
   backoff as countdown.
3. Whatever is lost in between (the broker was down at the commit, a worker died
   holding the message or in the middle of a POST) is still an active row in the
   database. deliver_due finds rows overdue by WEBHOOKS_RECOVER_AFTER_S and enqueues
   them again. Every worker runs it when it starts (worker_ready) and after every
   attempt it makes, so recovery needs no scheduler; `manage.py webhooks_dispatch`
   sends what is due from cron, without any worker.

Extra messages are harmless: each attempt is claimed by a conditional update first.
All of these go to the webhooks queue (WEBHOOKS_QUEUE, by CELERY_TASK_ROUTES), which
the quick start serves with a worker of its own, apart from evaluations.
"""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready

from webhooks import services


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def send_delivery(self, delivery_id: int) -> None:
    outcome = services.delivery_attempt(delivery_id=delivery_id)
    enqueue_overdue()
    if outcome is not None and outcome.retry_in_s is not None:
        # The database bounds the attempts (WEBHOOKS_MAX_ATTEMPTS), hence max_retries=None.
        raise self.retry(countdown=outcome.retry_in_s)


@shared_task(acks_late=True)
def deliver_due() -> None:
    enqueue_overdue()


def enqueue_overdue() -> None:
    for delivery_id in services.delivery_rearm_overdue():
        send_delivery.delay(delivery_id)


@worker_ready.connect
def deliver_due_when_a_worker_starts(sender=None, **kwargs) -> None:
    deliver_due.delay()
