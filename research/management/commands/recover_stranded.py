"""Sends again the work whose queue message was lost (research.recovery), once.

Workers do this themselves every RECOVER_EVERY_S; this is for cron, or by hand after
the broker lost its data. Running it next to workers is safe: each piece of work is
re-sent by one of them, under a fresh dispatch token.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand

from research.recovery import stranded_resend


class Command(BaseCommand):
    help = "Send again every evaluation and agent proposal whose queue message was lost."

    def handle(self, *args, **options) -> None:
        recovered = stranded_resend()
        self.stdout.write(
            f"queued again: {len(recovered.queued)} waiting and {len(recovered.running)} "
            f"abandoned candidates; failed after their last attempt: {len(recovered.failed)}; "
            f"agent proposals asked again: {len(recovered.proposals)}")
