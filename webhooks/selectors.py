"""Reads for the endpoint pages and the dispatcher. A user sees only their endpoints."""

from __future__ import annotations

from django.db.models import Count, Prefetch, Q, QuerySet
from django.shortcuts import get_object_or_404
from django.utils import timezone

from webhooks.models import ACTIVE_STATUSES, Attempt, Delivery, Endpoint

DELIVERY_LOG_SIZE = 50


def endpoint_list_for_owner(owner) -> QuerySet[Endpoint]:
    # Explicit order: Meta.ordering does not apply to queries that aggregate.
    return Endpoint.objects.filter(owner=owner).annotate(
        delivery_count=Count("deliveries"),
        failing_count=Count(
            "deliveries",
            filter=Q(deliveries__status__in=[Delivery.Status.FAILED, Delivery.Status.GAVE_UP]),
        ),
    ).order_by("-created_at", "-id")


def endpoint_get_for_owner(owner, endpoint_id: int) -> Endpoint:
    return get_object_or_404(Endpoint, pk=endpoint_id, owner=owner)


def delivery_log(endpoint: Endpoint, *, limit: int = DELIVERY_LOG_SIZE) -> list[Delivery]:
    """The newest deliveries of an endpoint, each with its attempts in order."""
    return list(
        endpoint.deliveries.prefetch_related(
            Prefetch("attempt_log", queryset=Attempt.objects.order_by("number"))
        )[:limit]
    )


def delivery_get_for_owner(owner, delivery_id: int) -> Delivery:
    return get_object_or_404(
        Delivery.objects.select_related("endpoint").prefetch_related("attempt_log"),
        pk=delivery_id,
        endpoint__owner=owner,
    )


def delivery_due_ids(*, limit: int = 100) -> list[int]:
    return list(
        Delivery.objects.filter(status__in=ACTIVE_STATUSES, next_attempt_at__lte=timezone.now())
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )
