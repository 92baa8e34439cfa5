"""Webhooks without the network: the outbox, signing, the SSRF rules, backoff, and the
endpoint pages with and without htmx. Sending is covered in test_webhooks_delivery."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from standardwebhooks import Webhook, WebhookVerificationError

from webhooks import outbound, payloads, services, signing
from webhooks.models import Attempt, Delivery, Endpoint

pytestmark = pytest.mark.django_db


@pytest.fixture
def make_endpoint(user):
    def make(**overrides) -> Endpoint:
        fields = {"owner": user, "url": "https://hooks.example.com/in", "events": ["candidate.kept"]}
        fields.update(overrides)
        return services.endpoint_create(**fields)

    return make


def _delivery(endpoint: Endpoint, **fields) -> Delivery:
    defaults = {"event_type": "candidate.kept", "webhook_id": signing.webhook_id_generate(),
                "payload": {}, "body": "{}", "next_attempt_at": timezone.now()}
    return Delivery.objects.create(endpoint=endpoint, **{**defaults, **fields})


# The outbox

def test_an_event_is_owed_to_every_enabled_endpoint_subscribed_to_it_and_no_other(
    make_endpoint, django_capture_on_commit_callbacks
):
    subscribed = make_endpoint(events=["candidate.kept", "sweep.finished"])
    make_endpoint(events=["sweep.finished"])
    services.endpoint_set_enabled(endpoint=make_endpoint(), enabled=False)

    with django_capture_on_commit_callbacks() as callbacks:
        with transaction.atomic():
            services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 3}})

    [delivery] = Delivery.objects.all()
    assert delivery.endpoint == subscribed and delivery.status == Delivery.Status.PENDING
    assert delivery.webhook_id.startswith("msg_") and delivery.payload == {"candidate": {"id": 3}}
    body = json.loads(delivery.body)
    assert body["type"] == "candidate.kept" and body["data"] == {"candidate": {"id": 3}}
    assert len(callbacks) == 1  # the send is enqueued only after the commit


def test_a_rolled_back_transaction_leaves_no_delivery_and_enqueues_nothing(
    make_endpoint, django_capture_on_commit_callbacks
):
    make_endpoint()
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 3}})
                raise RuntimeError("the keep failed after the event was written")

    assert not Delivery.objects.exists()
    assert callbacks == []


def test_an_unknown_event_type_is_a_programming_error():
    with pytest.raises(ValueError):
        services.webhook_event(type="candidate.merged", payload={})


# Signing

def test_the_secret_is_whsec_and_base64_of_enough_random_bytes():
    secret = signing.secret_generate()
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) >= 24
    assert secret != signing.secret_generate()


def test_a_signature_verifies_with_the_standardwebhooks_package_and_a_changed_body_does_not():
    secret = signing.secret_generate()
    timestamp = int(timezone.now().timestamp())
    headers = signing.signed_headers(secret=secret, webhook_id="msg_1", timestamp=timestamp, body='{"a":1}')

    assert Webhook(secret).verify('{"a":1}', headers) == {"a": 1}
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify('{"a":2}', headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(signing.secret_generate()).verify('{"a":1}', headers)


# The SSRF rules

@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fd00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"), ("0.0.0.0", "unspecified"), ("240.0.0.1", "reserved"),
    ("100.64.0.1", "non-public"), ("fec0::1", "site-local"), ("2002:7f00:1::1", "6to4"),
])
def test_non_public_addresses_are_refused_with_their_kind(address, reason):
    assert outbound.address_refusal(address) == reason


@pytest.mark.parametrize("address", ["93.184.215.14", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert outbound.address_refusal(address) is None


@pytest.mark.parametrize("url, message", [
    ("ftp://hooks.example.com/", "only http and https"),
    ("http://10.0.0.5/hook", "private"),
    ("http://[::1]:8080/hook", "loopback"),
    ("http://169.254.169.254/latest/meta-data", "link-local"),
    ("https://user:pw@hooks.example.com/", "credentials"),
])
def test_it_refuses_to_save_an_endpoint_that_could_never_be_reached_safely(make_endpoint, url, message):
    with pytest.raises(ValidationError) as error:
        make_endpoint(url=url)
    assert message in str(error.value.message_dict["url"])
    assert not Endpoint.objects.exists()


def test_a_private_address_may_be_saved_when_the_setting_allows_it(make_endpoint, settings):
    settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS = True
    assert make_endpoint(url="http://10.0.0.5/hook").pk


# Retries and claims

def test_the_retry_delay_doubles_with_jitter_up_to_the_cap(settings):
    settings.WEBHOOKS_RETRY_BASE_S = 10
    settings.WEBHOOKS_RETRY_CAP_S = 100
    for attempts, full in [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (500, 100)]:
        delays = [services.retry_delay_s(attempts) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays)
        assert len(set(delays)) > 1  # jittered, so failures do not retry in lockstep


def test_an_attempt_is_claimed_once_so_two_workers_never_send_it_twice(make_endpoint):
    delivery = _delivery(make_endpoint())

    first = services.delivery_claim(delivery_id=delivery.pk)
    second = services.delivery_claim(delivery_id=delivery.pk)

    assert first is not None and first.attempt.number == 1
    assert second is None
    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.SENDING and delivery.attempts == 1
    assert delivery.next_attempt_at > timezone.now()  # not due while in flight
    assert Attempt.objects.filter(delivery=delivery).count() == 1


def test_a_delivery_to_a_disabled_endpoint_gives_up_instead_of_sending(make_endpoint):
    endpoint = make_endpoint()
    delivery = _delivery(endpoint)
    Endpoint.objects.filter(pk=endpoint.pk).update(enabled=False, disabled_reason="the receiver answered 410 Gone")

    assert services.delivery_claim(delivery_id=delivery.pk) is None
    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.GAVE_UP and delivery.attempts == 0
    assert "410 Gone" in delivery.last_error


def test_a_lost_delivery_is_rearmed_once_per_grace_period(make_endpoint, settings):
    settings.WEBHOOKS_RECOVER_AFTER_S = 60
    endpoint = make_endpoint()
    lost = _delivery(endpoint, next_attempt_at=timezone.now() - timedelta(minutes=5))
    _delivery(endpoint)  # just written: its message is surely still on its way
    _delivery(endpoint, status=Delivery.Status.SUCCEEDED, next_attempt_at=None)

    assert services.delivery_rearm_overdue() == [lost.pk]
    assert services.delivery_rearm_overdue() == []  # a second sweep does not enqueue it again


# The pages

def test_the_secret_is_shown_once_after_creating_an_endpoint(logged_in_client):
    response = logged_in_client.post("/webhooks/new/", {
        "url": "https://hooks.example.com/kernel-lab", "events": ["candidate.kept", "thesis.created"],
    })
    endpoint = Endpoint.objects.get()
    assert response.status_code == 302 and response.url == f"/webhooks/{endpoint.pk}/"
    assert endpoint.events == ["candidate.kept", "thesis.created"]

    first = logged_in_client.get(response.url).content.decode()
    again = logged_in_client.get(response.url).content.decode()
    listing = logged_in_client.get("/webhooks/").content.decode()

    assert endpoint.secret in first
    assert endpoint.secret not in again and endpoint.secret_hint in again
    assert endpoint.secret not in listing and endpoint.secret_hint in listing


def test_the_form_needs_at_least_one_event_and_an_http_url(logged_in_client):
    response = logged_in_client.post("/webhooks/new/", {"url": "ftp://hooks.example.com/"})
    assert response.status_code == 422
    assert not Endpoint.objects.exists()


def test_disabling_with_htmx_returns_the_state_fragment_and_gives_up_what_was_owed(
    logged_in_client, make_endpoint
):
    endpoint = make_endpoint()
    owed = _delivery(endpoint)

    response = logged_in_client.post(f"/webhooks/{endpoint.pk}/toggle/", {"enabled": "0"}, HTTP_HX_REQUEST="true")

    body = response.content.decode()
    assert response.status_code == 200 and "<html" not in body
    assert "disabled" in body and 'value="1"' in body
    assert "webhook-log-changed" in response["HX-Trigger"]  # the page's log reloads
    endpoint.refresh_from_db()
    assert not endpoint.enabled
    assert Delivery.objects.get(pk=owed.pk).status == Delivery.Status.GAVE_UP


def test_enabling_without_javascript_redirects_to_the_endpoint(logged_in_client, make_endpoint):
    endpoint = make_endpoint()
    services.endpoint_set_enabled(endpoint=endpoint, enabled=False)

    response = logged_in_client.post(f"/webhooks/{endpoint.pk}/toggle/", {"enabled": "1"})

    assert response.status_code == 302 and response.url == f"/webhooks/{endpoint.pk}/"
    endpoint.refresh_from_db()
    assert endpoint.enabled and endpoint.disabled_reason == ""


def test_deleting_an_endpoint_removes_its_delivery_log(logged_in_client, make_endpoint):
    endpoint = make_endpoint()
    _delivery(endpoint)

    response = logged_in_client.post(f"/webhooks/{endpoint.pk}/delete/", HTTP_HX_REQUEST="true")

    assert response.status_code == 200 and response["HX-Redirect"] == "/webhooks/"
    assert not Endpoint.objects.exists() and not Delivery.objects.exists()


def test_the_delivery_log_shows_each_attempt_and_refreshes_itself_while_a_delivery_is_under_way(
    logged_in_client, make_endpoint
):
    endpoint = make_endpoint()
    delivery = _delivery(endpoint, status=Delivery.Status.FAILED, attempts=1, last_status_code=502,
                         last_error="HTTP 502 bad gateway")
    Attempt.objects.create(delivery=delivery, number=1, started_at=timezone.now(), finished_at=timezone.now(),
                           status_code=502, error="HTTP 502 bad gateway", duration_ms=12)

    fragment = logged_in_client.get(f"/webhooks/{endpoint.pk}/deliveries/", HTTP_HX_REQUEST="true").content.decode()

    assert delivery.webhook_id in fragment and "HTTP 502" in fragment and "12 ms" in fragment
    assert "every 2s" in fragment
    Delivery.objects.filter(pk=delivery.pk).update(status=Delivery.Status.SUCCEEDED)
    settled = logged_in_client.get(f"/webhooks/{endpoint.pk}/deliveries/", HTTP_HX_REQUEST="true").content.decode()
    assert "every 2s" not in settled


def test_redeliver_without_javascript_queues_a_new_attempt_of_the_same_delivery(
    logged_in_client, make_endpoint, django_capture_on_commit_callbacks
):
    endpoint = make_endpoint()
    delivery = _delivery(endpoint, status=Delivery.Status.GAVE_UP, attempts=3, next_attempt_at=None)

    with django_capture_on_commit_callbacks() as callbacks:
        response = logged_in_client.post(f"/webhooks/deliveries/{delivery.pk}/redeliver/")

    assert response.status_code == 302 and response.url == f"/webhooks/{endpoint.pk}/"
    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.PENDING and delivery.next_attempt_at <= timezone.now()
    assert len(callbacks) == 1


def test_redelivering_to_a_disabled_endpoint_asks_to_enable_it_first(logged_in_client, make_endpoint):
    endpoint = make_endpoint()
    delivery = _delivery(endpoint, status=Delivery.Status.GAVE_UP, next_attempt_at=None)
    services.endpoint_set_enabled(endpoint=endpoint, enabled=False)

    response = logged_in_client.post(f"/webhooks/deliveries/{delivery.pk}/redeliver/", HTTP_HX_REQUEST="true")

    assert "enable the endpoint" in response.content.decode()
    assert Delivery.objects.get(pk=delivery.pk).status == Delivery.Status.GAVE_UP


def test_a_user_can_neither_see_nor_change_someone_elses_endpoint(client, make_endpoint):
    endpoint = make_endpoint()
    delivery = _delivery(endpoint)
    client.force_login(get_user_model().objects.create_user("mallory", password="pw-for-tests-only"))

    assert client.get(f"/webhooks/{endpoint.pk}/").status_code == 404
    assert client.post(f"/webhooks/{endpoint.pk}/toggle/", {"enabled": "0"}).status_code == 404
    assert client.post(f"/webhooks/{endpoint.pk}/delete/").status_code == 404
    assert client.post(f"/webhooks/deliveries/{delivery.pk}/redeliver/").status_code == 404
    assert endpoint.url not in client.get("/webhooks/").content.decode()


def test_the_pages_need_a_login(client, make_endpoint):
    response = client.get("/webhooks/")
    assert response.status_code == 302 and "/login/" in response.url


# Payloads

def test_the_thesis_created_payload_names_the_thesis_and_links_back_to_it(make_thesis, make_endpoint, settings):
    settings.SITE_URL = "https://lab.example.com/"
    thesis = make_thesis()
    make_endpoint(events=["thesis.created"])

    services.webhook_event(type="thesis.created", payload=payloads.thesis_created(thesis))

    data = json.loads(Delivery.objects.get(event_type="thesis.created").body)["data"]
    assert data["thesis"]["id"] == thesis.pk and data["thesis"]["author"] == "ada"
    assert data["thesis"]["url"] == f"https://lab.example.com/theses/{thesis.pk}/"


def test_one_user_may_have_only_so_many_endpoints(settings, logged_in_client, make_endpoint, user):
    """Every event owes a delivery and its retries to each endpoint: a user with hundreds
    would make every event cost the lab hundreds of sends."""
    settings.WEBHOOK_ENDPOINTS_PER_USER = 3
    for index in range(3):
        make_endpoint(url=f"https://hooks.example.com/{index}")
    with pytest.raises(ValidationError, match="the most one user may have"):
        make_endpoint(url="https://hooks.example.com/4")
    response = logged_in_client.post("/webhooks/new/", {"url": "https://hooks.example.com/5",
                                                        "events": ["candidate.kept"]})
    assert response.status_code == 422 and "the most one user may have" in response.content.decode()
    assert Endpoint.objects.filter(owner=user).count() == 3
    # Another user's quota is their own.
    other = get_user_model().objects.create_user("other-owner", password="pw-for-tests-only")
    make_endpoint(owner=other)


def test_deliveries_go_to_a_queue_of_their_own_apart_from_evaluations():
    from config.celery import app
    from research.tasks import evaluate_candidate
    from webhooks.tasks import deliver_due, send_delivery

    def queue_of(task, **options):
        return app.amqp.router.route(options, task.name)["queue"].name

    assert queue_of(send_delivery) == queue_of(deliver_due) == "webhooks"
    assert queue_of(evaluate_candidate, queue="runner.cpu") == "runner.cpu"


@pytest.mark.django_db
def test_the_admin_never_tells_a_secret_through_its_filters(make_endpoint):
    """?secret__startswith=whsec_S answered one row or none: the secret a character at a time."""
    from django.test import Client

    endpoint = make_endpoint()
    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", "", "x"))
    for guess in (endpoint.secret[:7], "whsec_?", endpoint.secret):
        for lookup in ("secret__startswith", "secret", "owner__webhook_endpoints__secret__startswith"):
            filtered = admin.get("/admin/webhooks/endpoint/", {lookup: guess})
            assert filtered.status_code == 400 and endpoint.url not in filtered.content.decode(), lookup
    assert endpoint.url in admin.get("/admin/webhooks/endpoint/").content.decode()
