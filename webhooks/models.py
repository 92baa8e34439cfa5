"""Webhook endpoints, the deliveries owed to them (the outbox) and every attempt made.

A Delivery is written in the same transaction as the event it announces, so an event
that happened is never left unannounced and one that was rolled back is never sent.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.urls import reverse

EVENT_CHOICES = [
    ("candidate.kept", "candidate.kept — a reviewer kept a kernel"),
    ("candidate.reverted", "candidate.reverted — a reviewer reverted a candidate"),
    ("candidate.undone", "candidate.undone — a second reviewer undid a keep"),
    ("sweep.finished", "sweep.finished — every candidate of a sweep was evaluated"),
    ("thesis.created", "thesis.created — someone filed a thesis"),
]
EVENT_TYPES = [value for value, _ in EVENT_CHOICES]


class Endpoint(models.Model):
    """A URL that wants some event types, and the secret its deliveries are signed with."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhook_endpoints"
    )
    url = models.URLField(max_length=2000)
    events = models.JSONField(help_text="The event types it is subscribed to.")
    # Stored because every delivery is signed with it; shown to its owner only once.
    secret = models.CharField(max_length=100)
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.url

    def get_absolute_url(self) -> str:
        return reverse("webhook_detail", args=[self.pk])

    @property
    def secret_hint(self) -> str:
        """Enough to tell secrets apart, too little to sign with."""
        return f"{self.secret[:9]}…"


class Delivery(models.Model):
    """One event owed to one endpoint: the exact signed body, sent until it lands.

    pending: waiting for its first attempt (or a redelivery); sending: an attempt is
    in flight; failed: the last attempt failed and another is due at next_attempt_at;
    succeeded: the receiver answered 2xx; gave_up: no more automatic attempts (out of
    attempts, 410 Gone, or the endpoint was disabled).
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        SENDING = "sending"
        FAILED = "failed"
        SUCCEEDED = "succeeded"
        GAVE_UP = "gave_up", "gave up"

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="deliveries")
    event_type = models.CharField(max_length=40)
    # The same id on every attempt, so receivers can deduplicate retries.
    webhook_id = models.CharField(max_length=40, unique=True)
    payload = models.JSONField()
    # The body as signed: every attempt sends these exact bytes.
    body = models.TextField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # When the next attempt is due; while one is in flight, when its claim expires.
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="delivery_due")]

    def __str__(self) -> str:
        return f"{self.event_type} {self.webhook_id}"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES


ACTIVE_STATUSES = [Delivery.Status.PENDING, Delivery.Status.SENDING, Delivery.Status.FAILED]


class Attempt(models.Model):
    """One POST of a delivery: the delivery log. Written when claimed, completed after."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    succeeded = models.BooleanField(default=False)

    class Meta:
        ordering = ["delivery_id", "number"]
        constraints = [
            # The database's guarantee that one attempt is never sent twice.
            models.UniqueConstraint(fields=["delivery", "number"], name="attempt_number_per_delivery")
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.delivery_id}"
