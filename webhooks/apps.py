from __future__ import annotations

from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"
    verbose_name = "Webhooks: signed notifications, their deliveries and attempts"

    def ready(self) -> None:
        # Connects the worker_ready handler: every worker that starts sends what a
        # crash or a lost message left behind (see webhooks.tasks).
        from webhooks import tasks  # noqa: F401
