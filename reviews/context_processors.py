"""The review queue's count for the navigation, on every page of a logged-in user."""

from __future__ import annotations

from django.http import HttpRequest
from django.utils.functional import SimpleLazyObject


def review_queue(request: HttpRequest) -> dict:
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {}
    from reviews import queue_count

    # Lazy: pages that do not show the navigation never ask for it.
    return {"review_queue_count": SimpleLazyObject(queue_count.count)}
