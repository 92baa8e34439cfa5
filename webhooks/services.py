"""Writes: endpoints, the outbox of deliveries, and the attempts that empty it.

The network is never touched inside a transaction: an attempt is claimed in one,
the POST happens outside, and its outcome is recorded in another.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from webhooks import outbound, signing
from webhooks.models import ACTIVE_STATUSES, EVENT_TYPES, Attempt, Delivery, Endpoint

logger = logging.getLogger(__name__)

MAX_URL_LENGTH = 2000
MAX_ERROR_CHARS = 1000
# Past this many doublings the cap has long been reached; stops float overflow.
MAX_BACKOFF_DOUBLINGS = 40


def endpoint_create(*, owner, url: str, events: list[str]) -> Endpoint:
    """A new endpoint of `owner`'s, within their quota (WEBHOOK_ENDPOINTS_PER_USER): every
    event owes a delivery, and up to a dozen retries, to each endpoint subscribed to it,
    so one user's endpoints must not make every event cost the lab hundreds of sends."""
    url = url.strip()
    _check_endpoint_url(url)
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown:
        raise ValidationError({"events": f"unknown event types: {', '.join(unknown)}"})
    if not events:
        raise ValidationError({"events": "subscribe to at least one event type"})
    quota = settings.WEBHOOK_ENDPOINTS_PER_USER
    with transaction.atomic():
        # The owner's row, locked: two creates at once cannot both take the last place.
        get_user_model().objects.select_for_update().get(pk=owner.pk)
        if Endpoint.objects.filter(owner=owner).count() >= quota:
            raise ValidationError({NON_FIELD_ERRORS: (
                f"you have {quota} endpoints, the most one user may have: delete one first")})
        return Endpoint.objects.create(
            owner=owner,
            url=url,
            events=[event for event in EVENT_TYPES if event in events],
            secret=signing.secret_generate(),
        )


def _check_endpoint_url(url: str) -> None:
    if len(url) > MAX_URL_LENGTH:
        raise ValidationError({"url": f"at most {MAX_URL_LENGTH} characters"})
    try:
        _, host, _ = outbound.check_url(url)
    except outbound.Refused as exc:
        raise ValidationError({"url": str(exc)}) from exc
    # A literal address can be judged now. A name is judged at every attempt instead,
    # because what it resolves to can change after it was saved.
    if settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS:
        return
    try:
        reason = outbound.address_refusal(host)
    except ValueError:
        return  # a name, not an address
    if reason:
        raise ValidationError(
            {"url": f"{host} is a {reason} address; webhooks may only reach public addresses"}
        )


def endpoint_set_enabled(*, endpoint: Endpoint, enabled: bool) -> Endpoint:
    with transaction.atomic():
        Endpoint.objects.filter(pk=endpoint.pk).update(
            enabled=enabled, disabled_reason="" if enabled else "disabled by its owner"
        )
        if not enabled:
            _give_up_owed(endpoint.pk, "the endpoint was disabled by its owner")
    endpoint.refresh_from_db()
    return endpoint


def endpoint_delete(*, endpoint: Endpoint) -> None:
    # Its deliveries and their log go with it: they cannot be sent anywhere any more.
    endpoint.delete()


def _give_up_owed(endpoint_id: int, reason: str) -> None:
    """Settle what a disabled endpoint is still owed; redelivery can send it later.

    Only waiting deliveries: an attempt in flight settles itself when it returns.
    """
    Delivery.objects.filter(
        endpoint_id=endpoint_id, status__in=[Delivery.Status.PENDING, Delivery.Status.FAILED]
    ).update(status=Delivery.Status.GAVE_UP, next_attempt_at=None, last_error=reason)


def webhook_event(*, type: str, payload: dict) -> None:
    """Owe an event to every enabled endpoint subscribed to it: the outbox.

    Call it inside the transaction that makes the event true (a decision, a new
    thesis): the deliveries commit or roll back with it, and are handed to a worker
    only after the commit. If that hand-over is lost (the broker is down, the process
    dies right after the commit), the rows are still active and the recovery in
    webhooks.tasks sends them.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {type!r}")
    # Few endpoints, and JSON containment is not portable to SQLite: filter here.
    endpoints = [e for e in Endpoint.objects.filter(enabled=True).only("pk", "events") if type in e.events]
    if not endpoints:
        return
    now = timezone.now()
    # Round-trip through JSON once so the stored payload is exactly what is sent.
    data = json.loads(json.dumps(payload, cls=DjangoJSONEncoder))
    body = json.dumps({"type": type, "timestamp": now.isoformat(), "data": data}, separators=(",", ":"))
    with transaction.atomic():
        deliveries = Delivery.objects.bulk_create(
            Delivery(
                endpoint=endpoint,
                event_type=type,
                webhook_id=signing.webhook_id_generate(),
                payload=data,
                body=body,
                next_attempt_at=now,
            )
            for endpoint in endpoints
        )
        delivery_ids = [d.pk for d in deliveries]
        # robust: a broker outage must not fail the caller's request after its commit;
        # the rows stay pending and the recovery sends them.
        transaction.on_commit(lambda: _enqueue_sends(delivery_ids), robust=True)


def _enqueue_sends(delivery_ids: list[int]) -> None:
    from webhooks.tasks import send_delivery

    for delivery_id in delivery_ids:
        send_delivery.delay(delivery_id)


def delivery_redeliver(*, delivery: Delivery) -> Delivery:
    """Send a delivery again now, same webhook-id and body; a new attempt in its log.

    It does not restore the retry budget: if this attempt fails after the automatic
    ones ran out, the delivery gives up again.
    """
    if not delivery.endpoint.enabled:
        raise ValidationError("enable the endpoint before redelivering to it")
    now = timezone.now()
    with transaction.atomic():
        queued = (
            Delivery.objects.filter(pk=delivery.pk)
            # Not while an attempt is in flight (its claim unexpired): that one is the
            # delivery happening now.
            .exclude(status=Delivery.Status.SENDING, next_attempt_at__gt=now)
            .update(status=Delivery.Status.PENDING, next_attempt_at=now)
        )
        if queued:
            transaction.on_commit(lambda: _enqueue_sends([delivery.pk]), robust=True)
    delivery.refresh_from_db()
    return delivery


@dataclass(frozen=True)
class Claim:
    delivery: Delivery
    attempt: Attempt


def _claim_lease() -> timedelta:
    # Longer than one POST can take, so a live attempt is never claimed again; a dead
    # worker's claim expires and the delivery becomes due again.
    return timedelta(seconds=2 * settings.WEBHOOKS_TIMEOUT_S + 30)


def delivery_claim(*, delivery_id: int) -> Claim | None:
    """Claim the next attempt of a due delivery by a conditional update.

    Of two workers holding messages for the same delivery, only one's UPDATE matches;
    the other gets None and sends nothing. The claim also moves next_attempt_at to the
    end of a lease, so the delivery is not due while its attempt is in flight.
    """
    now = timezone.now()
    with transaction.atomic():
        # Conditions on this table only: on PostgreSQL a join in an UPDATE's filter
        # is re-checked against a stale snapshot after a lock wait.
        claimed = Delivery.objects.filter(
            pk=delivery_id, status__in=ACTIVE_STATUSES, next_attempt_at__lte=now
        ).update(
            status=Delivery.Status.SENDING,
            attempts=F("attempts") + 1,
            next_attempt_at=now + _claim_lease(),
        )
        if not claimed:
            return None
        delivery = Delivery.objects.select_related("endpoint").get(pk=delivery_id)
        if not delivery.endpoint.enabled:
            Delivery.objects.filter(pk=delivery_id).update(
                status=Delivery.Status.GAVE_UP,
                attempts=F("attempts") - 1,
                next_attempt_at=None,
                last_error=f"the endpoint is disabled: {delivery.endpoint.disabled_reason}",
            )
            return None
        attempt = Attempt.objects.create(delivery=delivery, number=delivery.attempts, started_at=now)
    return Claim(delivery=delivery, attempt=attempt)


@dataclass(frozen=True)
class Outcome:
    status: str
    # Seconds until the next automatic attempt; None when there is none.
    retry_in_s: float | None


def delivery_attempt(*, delivery_id: int) -> Outcome | None:
    """Make one attempt of a due delivery: claim, sign, POST, record.

    None when there was nothing to attempt (not due, already claimed, or gone) or a
    later attempt superseded this one.
    """
    claim = delivery_claim(delivery_id=delivery_id)
    if claim is None:
        return None
    delivery = claim.delivery
    # A fresh timestamp per attempt: receivers reject stale ones (Standard Webhooks
    # allows five minutes), while id and body stay the same.
    headers = signing.signed_headers(
        secret=delivery.endpoint.secret,
        webhook_id=delivery.webhook_id,
        timestamp=int(time.time()),
        body=delivery.body,
    )
    status_code: int | None = None
    error = ""
    started = time.monotonic()
    try:
        response = outbound.post(
            delivery.endpoint.url,
            body=delivery.body.encode(),
            headers=headers,
            timeout_s=settings.WEBHOOKS_TIMEOUT_S,
            allow_private=settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS,
        )
    except outbound.Refused as exc:
        error = str(exc)
    except TimeoutError:  # socket.timeout
        error = f"no answer within {settings.WEBHOOKS_TIMEOUT_S} s"
    except (OSError, http.client.HTTPException) as exc:
        error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    else:
        status_code = response.status
        if not 200 <= status_code < 300:
            error = f"HTTP {status_code} {response.excerpt}".strip()
    return delivery_record_attempt(
        claim=claim,
        status_code=status_code,
        error=error,
        duration_ms=round((time.monotonic() - started) * 1000),
    )


def retry_delay_s(attempts: int) -> float:
    """Exponential backoff with jitter after the given number of failed attempts.

    The delay doubles from the base up to the cap; each is drawn from its upper half,
    so deliveries that failed together (a receiver was down) do not retry together.
    """
    doublings = min(max(attempts - 1, 0), MAX_BACKOFF_DOUBLINGS)
    delay = min(settings.WEBHOOKS_RETRY_CAP_S, settings.WEBHOOKS_RETRY_BASE_S * 2**doublings)
    return delay / 2 + random.uniform(0, delay / 2)


def delivery_record_attempt(
    *, claim: Claim, status_code: int | None, error: str, duration_ms: int
) -> Outcome | None:
    """Store an attempt's outcome and decide what follows: done, retry later, or give up.

    None when a later attempt superseded this one (see below).
    """
    delivery = claim.delivery
    now = timezone.now()
    succeeded = status_code is not None and 200 <= status_code < 300
    gone = status_code == 410
    retry_in_s = None
    if succeeded:
        status = Delivery.Status.SUCCEEDED
    elif gone or delivery.attempts >= settings.WEBHOOKS_MAX_ATTEMPTS:
        status = Delivery.Status.GAVE_UP
    else:
        status = Delivery.Status.FAILED
        retry_in_s = retry_delay_s(delivery.attempts)
    with transaction.atomic():
        Attempt.objects.filter(pk=claim.attempt.pk).update(
            finished_at=now,
            status_code=status_code,
            error=error[:MAX_ERROR_CHARS],
            duration_ms=duration_ms,
            succeeded=succeeded,
        )
        # Only the holder of the claim settles the delivery: if this attempt outlived
        # its lease and another one was claimed meanwhile, that one decides.
        recorded = Delivery.objects.filter(
            pk=delivery.pk, status=Delivery.Status.SENDING, attempts=delivery.attempts
        ).update(
            status=status,
            next_attempt_at=None if retry_in_s is None else now + timedelta(seconds=retry_in_s),
            last_status_code=status_code,
            last_error=error[:MAX_ERROR_CHARS],
            delivered_at=now if succeeded else None,
        )
        if recorded and gone:
            # 410 is the receiver saying "stop": disable the endpoint, say why.
            reason = f"the receiver answered 410 Gone on {now:%Y-%m-%d %H:%M} UTC"
            Endpoint.objects.filter(pk=delivery.endpoint_id).update(enabled=False, disabled_reason=reason)
            _give_up_owed(delivery.endpoint_id, f"the endpoint was disabled: {reason}")
    if not recorded:
        return None
    if status == Delivery.Status.GAVE_UP:
        # The endpoint by its id and host: a receiver's URL often carries its secret.
        logger.warning("webhook %s to endpoint %s (%s) gave up after %d attempts: %s",
                       delivery.webhook_id, delivery.endpoint_id, urlsplit(delivery.endpoint.url).hostname,
                       delivery.attempts, error)
    return Outcome(status=status, retry_in_s=retry_in_s)


def delivery_rearm_overdue(*, limit: int = 100) -> list[int]:
    """Deliveries whose hand-over to a worker was evidently lost, made due again.

    Overdue means active and due for longer than WEBHOOKS_RECOVER_AFTER_S: its message
    should long have run. Each is re-armed (due now) by an update conditional on the
    value just read, so of several workers sweeping at once only one re-enqueues it,
    and it is not overdue again until another grace period has passed.
    """
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.WEBHOOKS_RECOVER_AFTER_S)
    overdue = (
        Delivery.objects.filter(status__in=ACTIVE_STATUSES, next_attempt_at__lte=cutoff)
        .order_by("next_attempt_at")
        .values_list("pk", "next_attempt_at")[:limit]
    )
    return [
        pk
        for pk, due_at in list(overdue)
        if Delivery.objects.filter(pk=pk, next_attempt_at=due_at).update(next_attempt_at=now)
    ]
