"""Webhook deliveries end to end: a real Celery worker (a thread) through the real Redis
broker POSTs to a real HTTP receiver on 127.0.0.1, which verifies every signature with
the `standardwebhooks` package, as a user's receiver would."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import worker_ready
from django.core.management import call_command
from django.db import connection, transaction
from django.db.backends.signals import connection_created
from standardwebhooks import Webhook, WebhookVerificationError
from standardwebhooks.webhooks import EmptyWebhookSecretError

from config.celery import app
from webhooks import outbound, services, tasks
from webhooks.models import Attempt, Delivery, Endpoint

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: str
    verified: dict | None  # the payload, when the signature verified
    verification_error: str | None


class Receiver:
    """A receiver: answers with the scripted status codes in turn, then 200."""

    def __init__(self) -> None:
        self.secret = ""
        self.answers: list[int] = []
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"])).decode()
                headers = {name.lower(): value for name, value in self.headers.items()}
                try:
                    verified, error = Webhook(receiver.secret).verify(body, headers), None
                except (WebhookVerificationError, EmptyWebhookSecretError) as exc:
                    verified, error = None, str(exc)
                with receiver._lock:
                    receiver.requests.append(Received(self.path, headers, body, verified, error))
                    status = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/kernel-lab"

    def webhook_ids(self) -> set[str]:
        return {r.headers["webhook-id"] for r in self.requests}


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(autouse=True)
def sqlite_readers_take_no_locks(transactional_db):
    """On SQLite the test database lives in memory with a shared cache, where a reader
    in one thread and a writer in another make each other fail at once ("table is
    locked") instead of waiting. Reading uncommitted rows takes no read locks, so the
    test can watch the worker's progress. PostgreSQL needs nothing of the kind."""
    if connection.vendor != "sqlite":
        yield
        return

    def read_uncommitted(sender, connection, **kwargs) -> None:
        if connection.vendor == "sqlite":
            connection.cursor().execute("PRAGMA read_uncommitted = 1")

    connection_created.connect(read_uncommitted)
    connection.cursor().execute("PRAGMA read_uncommitted = 1")
    yield
    connection_created.disconnect(read_uncommitted)
    connection.cursor().execute("PRAGMA read_uncommitted = 0")


@pytest.fixture
def webhook_settings(settings):
    # Loopback is allowed in tests only: the receiver runs on 127.0.0.1. Backoff is
    # shortened so three attempts take well under a second.
    settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS = True
    settings.WEBHOOKS_RETRY_BASE_S = 0.2
    settings.WEBHOOKS_RETRY_CAP_S = 0.4
    settings.WEBHOOKS_MAX_ATTEMPTS = 3
    return settings


@pytest.fixture
def worker(webhook_settings):
    with start_worker(app, pool="solo", perform_ping_check=False, queues=["webhooks"],
                      shutdown_timeout=30) as running:
        yield running


@pytest.fixture
def endpoint(user, receiver, webhook_settings):
    made = services.endpoint_create(owner=user, url=receiver.url, events=["candidate.kept", "sweep.finished"])
    receiver.secret = made.secret
    return made


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def _settled(delivery_id: int) -> Callable[[], bool]:
    return lambda: Delivery.objects.get(pk=delivery_id).status in {
        Delivery.Status.SUCCEEDED, Delivery.Status.GAVE_UP
    }


def _kept_event() -> Delivery:
    # As the review service does: the event in the same transaction as the decision.
    with transaction.atomic():
        services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 7, "speedup": 1.4}})
    return Delivery.objects.get()


def test_a_subscriber_receives_a_delivery_that_verifies_with_the_standardwebhooks_package(endpoint, receiver, worker):
    delivery = _kept_event()
    _wait_for(_settled(delivery.pk))

    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.SUCCEEDED and delivery.delivered_at
    [request] = receiver.requests
    assert request.verification_error is None
    assert request.verified == {"type": "candidate.kept", "timestamp": request.verified["timestamp"],
                                "data": {"candidate": {"id": 7, "speedup": 1.4}}}
    assert request.path == "/hooks/kernel-lab"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["webhook-id"] == delivery.webhook_id and delivery.webhook_id.startswith("msg_")
    assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 30
    assert request.headers["webhook-signature"].startswith("v1,")
    assert request.body == delivery.body
    [attempt] = Attempt.objects.filter(delivery=delivery)
    assert attempt.status_code == 200 and attempt.succeeded and attempt.duration_ms is not None


def test_a_receiver_answering_500_500_200_gets_three_attempts_with_one_webhook_id(endpoint, receiver, worker):
    receiver.answers = [500, 500]
    delivery = _kept_event()
    _wait_for(_settled(delivery.pk))

    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.SUCCEEDED and delivery.attempts == 3
    assert len(receiver.requests) == 3
    assert receiver.webhook_ids() == {delivery.webhook_id}
    # The same bytes every time, each signed afresh and each verifiable.
    assert {r.body for r in receiver.requests} == {delivery.body}
    assert all(r.verified for r in receiver.requests)
    log = list(Attempt.objects.filter(delivery=delivery).values_list("number", "status_code", "succeeded"))
    assert log == [(1, 500, False), (2, 500, False), (3, 200, True)]


def test_it_gives_up_after_the_last_allowed_attempt(endpoint, receiver, worker):
    receiver.answers = [503, 503, 503, 200]
    delivery = _kept_event()
    _wait_for(_settled(delivery.pk))

    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.GAVE_UP
    assert delivery.attempts == 3 and len(receiver.requests) == 3
    assert delivery.last_status_code == 503 and "HTTP 503" in delivery.last_error
    assert Endpoint.objects.get().enabled  # failing is not the receiver asking to stop


def test_410_gone_disables_the_endpoint_and_stops_retrying(endpoint, receiver, worker):
    receiver.answers = [410]
    delivery = _kept_event()
    _wait_for(_settled(delivery.pk))

    delivery.refresh_from_db()
    endpoint.refresh_from_db()
    assert delivery.status == Delivery.Status.GAVE_UP and delivery.attempts == 1
    assert not endpoint.enabled and "410 Gone" in endpoint.disabled_reason
    assert len(receiver.requests) == 1
    with transaction.atomic():
        services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 8}})
    assert Delivery.objects.count() == 1  # a disabled endpoint is owed nothing new


def test_a_private_address_is_refused_at_send_time_when_private_networks_are_not_allowed(
    endpoint, receiver, worker, webhook_settings
):
    # Allowed when the endpoint was saved, forbidden since: checked at every attempt.
    webhook_settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS = False
    webhook_settings.WEBHOOKS_MAX_ATTEMPTS = 1
    delivery = _kept_event()
    _wait_for(_settled(delivery.pk))

    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.GAVE_UP and delivery.last_status_code is None
    assert "refused" in delivery.last_error and "loopback" in delivery.last_error
    assert "WEBHOOKS_ALLOW_PRIVATE_NETWORKS" in delivery.last_error
    assert Attempt.objects.get(delivery=delivery).error == delivery.last_error
    assert receiver.requests == []


def test_a_hostname_that_resolves_to_loopback_is_refused_too(user, receiver, webhook_settings, monkeypatch):
    webhook_settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS = False
    monkeypatch.setattr(tasks.send_delivery, "delay", lambda *args: None)  # attempted by hand below
    made = services.endpoint_create(owner=user, url=f"http://localhost:{receiver.port}/hooks",
                                    events=["sweep.finished"])
    receiver.secret = made.secret
    with transaction.atomic():
        services.webhook_event(type="sweep.finished", payload={"sweep": {"id": 1}})
    delivery = Delivery.objects.get()

    outcome = services.delivery_attempt(delivery_id=delivery.pk)

    delivery.refresh_from_db()
    assert outcome is not None and outcome.status == Delivery.Status.FAILED
    assert "localhost resolves to" in delivery.last_error and "loopback" in delivery.last_error
    assert receiver.requests == []


def test_the_connection_goes_to_the_vetted_address_with_the_original_host_header(receiver, monkeypatch):
    # DNS rebinding: the name must be resolved once, and the socket opened to the
    # address that was checked, while Host (and SNI for HTTPS) keep the name.
    real_getaddrinfo = socket.getaddrinfo
    lookups = []

    def fake_getaddrinfo(host, *args, **kwargs):
        if host == "hooks.example.test":
            lookups.append(host)
            return real_getaddrinfo("127.0.0.1", *args, **kwargs)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(outbound.socket, "getaddrinfo", fake_getaddrinfo)
    response = outbound.post(f"http://hooks.example.test:{receiver.port}/in?x=1", body=b"{}",
                             headers={"content-type": "application/json"}, timeout_s=5,
                             allow_private=True)

    assert response.status == 200
    assert lookups == ["hooks.example.test"]
    [request] = receiver.requests
    assert request.headers["host"] == f"hooks.example.test:{receiver.port}"
    assert request.path == "/in?x=1"


def test_a_receiver_that_drips_its_answer_is_cut_off_at_the_attempts_deadline():
    """Each read's timeout was the only bound: one header line a second held a worker
    for as long as the receiver liked (12 s under a 2 s timeout)."""
    class Drip(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for number in range(20):
                try:
                    self.wfile.write(f"x-drip-{number}: 1\r\n".encode())
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.5)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no whole answer within 1 s"):
            outbound.post(f"http://127.0.0.1:{server.server_address[1]}/in", body=b"{}", headers={},
                          timeout_s=1, allow_private=True)
        # Cut off at its deadline, long before the receiver's 10 s of dripping ends.
        assert time.monotonic() - started < 5
    finally:
        server.shutdown()
        server.server_close()


def test_redeliver_sends_the_same_webhook_id_again_as_a_new_attempt(endpoint, receiver, worker, client, user):
    delivery = _kept_event()
    _wait_for(_settled(delivery.pk))
    client.force_login(user)

    response = client.post(f"/webhooks/deliveries/{delivery.pk}/redeliver/", HTTP_HX_REQUEST="true")

    assert response.status_code == 200 and delivery.webhook_id in response.content.decode()
    _wait_for(lambda: Delivery.objects.get(pk=delivery.pk).attempts == 2)
    _wait_for(_settled(delivery.pk))
    assert len(receiver.requests) == 2 and receiver.webhook_ids() == {delivery.webhook_id}
    assert all(r.verified for r in receiver.requests)
    assert list(Attempt.objects.filter(delivery=delivery).values_list("number", flat=True)) == [1, 2]


def test_a_delivery_whose_message_was_lost_is_sent_when_a_worker_starts(
    endpoint, receiver, webhook_settings, monkeypatch
):
    # The broker is unreachable at the commit: the decision still commits, and its
    # delivery waits in the database.
    def broker_down(*args, **kwargs):
        raise ConnectionError("redis is down")

    monkeypatch.setattr(tasks.send_delivery, "delay", broker_down)
    delivery = _kept_event()
    monkeypatch.undo()
    assert delivery.status == Delivery.Status.PENDING
    webhook_settings.WEBHOOKS_RECOVER_AFTER_S = 0

    with start_worker(app, pool="solo", perform_ping_check=False, queues=["webhooks"], shutdown_timeout=30):
        # The test worker does not send worker_ready itself; a real one does.
        worker_ready.send(sender=None)
        _wait_for(_settled(delivery.pk))

    assert Delivery.objects.get(pk=delivery.pk).status == Delivery.Status.SUCCEEDED
    [request] = receiver.requests
    assert request.verified and request.headers["webhook-id"] == delivery.webhook_id


def test_webhooks_dispatch_sends_what_is_due_without_any_worker(endpoint, receiver, monkeypatch, capsys):
    monkeypatch.setattr(tasks.send_delivery, "delay", lambda *args: None)  # no broker, no worker
    delivery = _kept_event()

    call_command("webhooks_dispatch")

    assert Delivery.objects.get(pk=delivery.pk).status == Delivery.Status.SUCCEEDED
    assert receiver.requests[0].verified and "1 attempted" in capsys.readouterr().out


def test_a_committed_decision_is_delivered_and_a_rolled_back_one_never_is(endpoint, receiver, worker):
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 1}})
            raise RuntimeError("the decision failed")
    with transaction.atomic():
        services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 2}})
    delivery = Delivery.objects.get()
    _wait_for(_settled(delivery.pk))

    assert [json.loads(r.body)["data"]["candidate"]["id"] for r in receiver.requests] == [2]
