from __future__ import annotations

from django.apps import AppConfig


class ReviewsConfig(AppConfig):
    name = "reviews"
    verbose_name = "Reviews: keep or revert decisions on candidates"

    def ready(self) -> None:
        # Reviews builds on research and reacts to what happens there; research never
        # imports reviews.
        from research import signals
        from reviews import live

        signals.candidate_recorded.connect(live.queue_changed_on_a_win,
                                           dispatch_uid="reviews.live.queue_changed_on_a_win")
        signals.candidate_revised.connect(live.queue_changed_on_a_revision,
                                          dispatch_uid="reviews.live.queue_changed_on_a_revision")
