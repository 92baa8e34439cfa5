"""Sends the webhook deliveries that are due, in this process.

For cron, or for an installation whose workers are down: it needs no Celery worker and
no broker. Running it next to workers is safe, since every attempt is claimed first.
Failed attempts are scheduled as usual and sent by the next run (or by a worker).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand

from webhooks import selectors, services


class Command(BaseCommand):
    help = "Send every webhook delivery that is due now, without a worker."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--limit", type=int, default=100, help="at most this many deliveries")

    def handle(self, *args, limit: int, **options) -> None:
        attempted = 0
        for delivery_id in selectors.delivery_due_ids(limit=limit):
            outcome = services.delivery_attempt(delivery_id=delivery_id)
            if outcome is not None:
                attempted += 1
                self.stdout.write(f"delivery {delivery_id}: {outcome.status}")
        self.stdout.write(f"{attempted} attempted")
