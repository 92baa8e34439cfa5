from __future__ import annotations

from django.apps import AppConfig


class ResearchConfig(AppConfig):
    name = "research"
    verbose_name = "Research: theses, evidence, sweeps and candidates"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_save

        from research import signals, sweeps
        from research.first_login import forget_on_password_change

        post_save.connect(forget_on_password_change, sender=get_user_model(),
                          dispatch_uid="research.first_login.forget_on_password_change")
        signals.candidate_recorded.connect(sweeps.sweep_after_result,
                                           dispatch_uid="research.sweeps.sweep_after_result")
