"""The issue "Security": websockets, CSRF for htmx, rate limits, production settings, bandit,
and secrets shown once and never logged. docs/security.md says why each is so."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from config.asgi import application
from config.ratelimit import RateLimited, parse_rate, rate_limit_hit
from research.api_tokens import api_token_authenticate, api_token_create
from tests.reviewing import no_enqueue, people, waiting_win, workspace_dir  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent
SOCKETS = ["/ws/reviews/", "/ws/sweeps/1/"]


# Websockets: a session from an allowed origin, or nothing.

@database_sync_to_async
def _session_cookie() -> bytes:
    user = get_user_model().objects.create_user("mallory-target", password="pw-for-tests-only")
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", SOCKETS)
async def test_a_socket_without_a_session_is_refused(path):
    communicator = WebsocketCommunicator(application, path, headers=[(b"origin", b"http://localhost:8000"),
                                                                     (b"host", b"localhost:8000")])
    connected, code = await communicator.connect()
    assert not connected and code == 4401


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", SOCKETS)
@pytest.mark.parametrize("origin", [b"http://evil.example", b"http://localhost.evil.example", None,
                                    # the same host, on another port or scheme: another origin
                                    b"http://localhost:8001", b"https://localhost:8000", b"http://localhost",
                                    b"null"])
async def test_a_logged_in_socket_from_another_or_no_origin_is_refused(path, origin):
    # Cross-site websocket hijacking: the browser sends the victim's cookie with a socket
    # that another site's page opens; only the Origin header tells them apart.
    headers = [(b"cookie", await _session_cookie()), (b"host", b"localhost:8000")] + (
        [(b"origin", origin)] if origin else [])
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await communicator.connect()
    assert not connected


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("origin", "host", "extra", "allowed"), [
    (b"http://localhost:8000", b"localhost:8000", [], True),
    (b"http://127.0.0.1:8000", b"127.0.0.1:8000", [], True),
    (b"http://evil.example:8000", b"evil.example:8000", [], False),  # a Host ALLOWED_HOSTS refuses
    (b"http://localhost:8000", None, [], False),  # no Host: nothing to be the same as
    (b"https://lab.example", b"lab.example", [(b"x-forwarded-proto", b"https")], True),
    (b"http://lab.example", b"lab.example", [(b"x-forwarded-proto", b"https")], False),
])
async def test_a_socket_is_allowed_only_from_its_own_scheme_host_and_port(settings, origin, host, extra, allowed):
    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1", "lab.example"]
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    headers = [(b"cookie", await _session_cookie()), (b"origin", origin), *extra] + (
        [(b"host", host)] if host else [])
    communicator = WebsocketCommunicator(application, "/ws/reviews/", headers=headers)
    connected, _ = await communicator.connect()
    assert connected is allowed
    await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_page_served_from_a_trusted_origin_on_purpose_may_open_a_socket(settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://dashboard.example:8443"]
    headers = [(b"cookie", await _session_cookie()), (b"origin", b"https://dashboard.example:8443"),
               (b"host", b"localhost:8000")]
    communicator = WebsocketCommunicator(application, "/ws/reviews/", headers=headers)
    connected, _ = await communicator.connect()
    assert connected
    await communicator.disconnect()


# CSRF: htmx posts carry the token from <body hx-headers>, and nothing else gets in.

@pytest.mark.django_db
def test_an_htmx_post_without_the_csrf_token_is_refused_and_with_it_goes_through(user):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    refused = client.post(reverse("thesis_new"), {"title": "t"}, HTTP_HX_REQUEST="true")
    assert refused.status_code == 403

    page = client.get(reverse("dashboard")).content.decode()
    token = json.loads(re.search(r"<body hx-headers='([^']+)'", page).group(1))["X-CSRFToken"]
    accepted = client.post(reverse("thesis_new"), {"title": "t"}, HTTP_HX_REQUEST="true", HTTP_X_CSRFTOKEN=token)
    assert accepted.status_code == 422  # past CSRF: the empty form's own errors
    assert b"This field is required" in accepted.content


@pytest.mark.django_db
def test_a_post_with_a_forged_csrf_token_is_refused(user):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    client.get(reverse("dashboard"))
    forged = client.post(reverse("thesis_new"), {"title": "t"}, HTTP_HX_REQUEST="true", HTTP_X_CSRFTOKEN="x" * 32)
    assert forged.status_code == 403


# Rate limits: per user and action, from settings, refused with 429 and when to retry.

# Login throttling: wrong passwords for one username from one address, then the right one.

@pytest.mark.django_db
@pytest.mark.parametrize("login_url", ["/login/", "/admin/login/"])
def test_after_five_wrong_passwords_even_the_right_one_is_refused(settings, login_url):
    User = get_user_model()
    User.objects.create_superuser("target", password="the-right-password")
    User.objects.create_user("bystander", password="another-right-password")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert client.post(login_url, {"username": "target", "password": "wrong"}).status_code == 200
    locked = client.post(login_url, {"username": "target", "password": "wrong"})
    assert locked.status_code == 429 and "Too many failed logins" in locked.content.decode()
    right = client.post(login_url, {"username": "target", "password": "the-right-password"})
    assert right.status_code == 429 and "_auth_user_id" not in client.session
    # The lockout is that username's from that address: another account still logs in.
    assert client.post("/login/", {"username": "bystander", "password": "another-right-password"}).status_code == 302


@pytest.mark.django_db
def test_a_right_password_before_the_limit_clears_the_count():
    get_user_model().objects.create_user("forgetful", password="the-right-password")
    client = Client()
    for _ in range(3):
        client.post("/login/", {"username": "forgetful", "password": "wrong"})
    assert client.post("/login/", {"username": "forgetful", "password": "the-right-password"}).status_code == 302
    client.logout()
    for _ in range(3):
        assert client.post("/login/", {"username": "forgetful", "password": "wrong"}).status_code == 200


@pytest.mark.django_db
def test_behind_a_trusted_proxy_the_address_it_saw_is_counted_and_what_the_client_adds_is_not(settings):
    """Behind a TLS proxy every login comes from the proxy: counted by that address, five
    wrong passwords from anywhere would lock the username out everywhere."""
    get_user_model().objects.create_user("target", password="the-right-password")
    through_proxy = {"REMOTE_ADDR": "127.0.0.1"}

    def login(forwarded: str, password: str = "wrong") -> int:
        return Client().post("/login/", {"username": "target", "password": password},
                             HTTP_X_FORWARDED_FOR=forwarded, **through_proxy).status_code

    settings.TRUSTED_PROXIES = 1
    # The attacker names other addresses in front of its own: the proxy appends the one it saw.
    for spoofed in range(settings.AXES_FAILURE_LIMIT - 1):
        assert login(f"198.51.100.{spoofed}, 203.0.113.5") == 200
    assert login("198.51.100.99, 203.0.113.5") == 429
    assert login("203.0.113.5", "the-right-password") == 429
    # The colleague behind the same proxy, from another address, still logs in.
    assert login("203.0.113.9", "the-right-password") == 302

    # Served directly, the header is the client's own words: it is ignored.
    settings.TRUSTED_PROXIES = 0
    for fresh in range(settings.AXES_FAILURE_LIMIT):
        login(f"192.0.2.{fresh}")  # every one from the peer 127.0.0.1, whatever it claims
    assert login("192.0.2.200", "the-right-password") == 429


def test_rates_read_as_count_per_period():
    assert parse_rate("20/h") == (20, 3600)
    assert parse_rate("100/10m") == (100, 600)
    assert parse_rate(" 5 / d ") == (5, 86400)
    with pytest.raises(ValueError, match="COUNT/PERIOD"):
        parse_rate("20 per hour")


@pytest.mark.django_db
def test_the_limit_counts_per_user_and_action(settings, user):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "thesis-submit": "2/h", "sweep-start": "1/h"}
    other = get_user_model().objects.create_user("grace", password="pw-for-tests-only")
    rate_limit_hit(user=user, action="thesis-submit")
    rate_limit_hit(user=user, action="thesis-submit")
    with pytest.raises(RateLimited) as refusal:
        rate_limit_hit(user=user, action="thesis-submit")
    assert str(refusal.value).startswith("Too many theses filed: at most 2 every 1 hour. Try again in ")
    assert 0 < refusal.value.retry_after_s <= 3601
    rate_limit_hit(user=other, action="thesis-submit")  # someone else's count
    rate_limit_hit(user=user, action="sweep-start")  # another action's count


def _assert_limited(response, what: str) -> None:
    assert response.status_code == 429
    assert f"Too many {what}" in response.content.decode()
    assert int(response["Retry-After"]) > 0


@pytest.mark.django_db
def test_filing_theses_is_rate_limited(settings, logged_in_client):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "thesis-submit": "2/h"}
    for _ in range(2):
        assert logged_in_client.post(reverse("thesis_new"), {"title": "t"}, HTTP_HX_REQUEST="true").status_code == 422
    _assert_limited(logged_in_client.post(reverse("thesis_new"), {"title": "t"}, HTTP_HX_REQUEST="true"), "theses filed")
    assert logged_in_client.get(reverse("thesis_new")).status_code == 200  # reading the form is not


@pytest.mark.django_db
def test_starting_sweeps_is_rate_limited(settings, logged_in_client, make_thesis):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "sweep-start": "2/h"}
    url = reverse("sweep_start", args=[make_thesis().pk])
    for _ in range(2):
        assert logged_in_client.post(url, {}, HTTP_HX_REQUEST="true").status_code == 422
    _assert_limited(logged_in_client.post(url, {}, HTTP_HX_REQUEST="true"), "sweeps started")


@pytest.mark.django_db
def test_deciding_is_rate_limited(settings, client, people, waiting_win):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "candidate-decide": "2/h"}
    client.force_login(people.reviewer)
    url = reverse("candidate_decide", args=[waiting_win.pk])
    for _ in range(2):
        assert client.post(url, {}, HTTP_HX_REQUEST="true").status_code == 422
    _assert_limited(client.post(url, {}, HTTP_HX_REQUEST="true"), "keep or revert decisions")


@pytest.mark.django_db
def test_the_apis_posts_are_rate_limited_with_a_json_429(settings, user, make_thesis):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "api-post": "2/h"}
    client = Client()
    _, token = api_token_create(user=user, name="h200-box")
    user.user_permissions.add(Permission.objects.get(codename="import_results"))
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    assert client.post("/api/theses", {}, **auth).status_code == 422
    assert client.post(f"/api/theses/{make_thesis().pk}/results", b"", content_type="application/x-ndjson",
                       **auth).status_code == 422
    refused = client.post("/api/theses", {}, **auth)
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert refused.json()["detail"].startswith("Too many API writes: at most 2 every 1 hour.")
    assert client.get(f"/api/theses/{make_thesis().pk}", **auth).status_code == 200  # reads are not


# Production settings: HTTPS=1 with a SECRET_KEY passes Django's deployment checks.

def _production_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in {"DEBUG", "SECRET_KEY", "DJANGO_SETTINGS_MODULE"}}
    return {**env, "ALLOWED_HOSTS": "lab.example", "CSRF_TRUSTED_ORIGINS": "https://lab.example", **extra}


def test_the_production_settings_pass_check_deploy():
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=_production_env(HTTPS="1", SECRET_KEY=secrets.token_urlsafe(50)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_https_without_a_secret_key_refuses_to_start():
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=_production_env(HTTPS="1"),
    )
    assert result.returncode != 0 and "set SECRET_KEY too" in result.stderr


# Static analysis: bandit finds nothing of medium severity or more that is not justified.

PACKAGES = ["config", "research", "reviews", "webhooks", "runners"]


def test_bandit_finds_nothing_unjustified():
    result = subprocess.run([sys.executable, "-m", "bandit", "-q", "-r", *PACKAGES, "-ll", "-f", "json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads(result.stdout)
    findings = [f"{r['filename']}:{r['line_number']} {r['test_id']} {r['issue_text']}" for r in report["results"]]
    assert findings == [] and result.returncode == 0, "\n".join(findings) or result.stderr


def test_every_nosec_is_justified_in_docs_security():
    justified = (ROOT / "docs" / "security.md").read_text()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                if "# nosec" in line:
                    relative = str(path.relative_to(ROOT))
                    assert f"`{relative}`" in justified, f"{relative}: a nosec that docs/security.md does not justify"


# Secrets: shown once, never logged.

@pytest.mark.django_db
def test_the_first_login_password_is_printed_once_and_its_note_goes_when_it_is_changed(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    first, again = StringIO(), StringIO()
    call_command("first_login", stdout=first)
    password = (tmp_path / "first-login.txt").read_text().split("password: ")[1].strip()
    assert f"password: {password}" in first.getvalue()
    assert (tmp_path / "first-login.txt").stat().st_mode & 0o077 == 0

    call_command("first_login", stdout=again)
    assert password not in again.getvalue() and "first-login.txt" in again.getvalue()

    admin = get_user_model().objects.get(username="admin")
    admin.last_login = timezone.now()
    admin.save(update_fields=["last_login"])  # a login leaves the note alone
    assert (tmp_path / "first-login.txt").exists()
    admin.set_password("a-new-password-for-tests")
    admin.save()
    # Gone with the change, not at the next start (it once outlived it while the app ran).
    assert not (tmp_path / "first-login.txt").exists()
    call_command("first_login", stdout=StringIO())
    assert not (tmp_path / "first-login.txt").exists()


@pytest.mark.django_db
def test_the_first_login_note_never_follows_a_link_planted_at_its_name(settings, tmp_path):
    """Whoever can write DATA_DIR could plant first-login.txt as a link to a file they
    read: the password would be written there (and that file made the owner's only)."""
    settings.DATA_DIR = tmp_path / "data"
    settings.DATA_DIR.mkdir()
    bait = tmp_path / "readable-by-others.txt"
    bait.write_text("nothing yet\n")
    bait.chmod(0o644)
    (settings.DATA_DIR / "first-login.txt").symlink_to(bait)
    printed = StringIO()
    call_command("first_login", stdout=printed)
    note = settings.DATA_DIR / "first-login.txt"
    assert not note.is_symlink() and note.stat().st_mode & 0o777 == 0o600
    password = note.read_text().split("password: ")[1].strip()
    assert f"password: {password}" in printed.getvalue()
    assert bait.read_text() == "nothing yet\n" and bait.stat().st_mode & 0o777 == 0o644

    # A link planted later, to a file that looks like the note, is removed, not read.
    note.unlink()
    bait.write_text(f"username: admin\npassword: {password}\n")
    note.symlink_to(bait)
    again = StringIO()
    call_command("first_login", stdout=again)
    assert again.getvalue() == "" and not note.is_symlink() and not note.exists()
    assert bait.exists()


@pytest.mark.django_db
def test_api_tokens_and_webhook_secrets_never_reach_the_logs(caplog, logged_in_client, user):
    caplog.set_level(logging.DEBUG)
    _, token = api_token_create(user=user, name="h200-box")
    assert api_token_authenticate(token) is not None
    client = Client()
    client.get("/api/theses/999999", HTTP_AUTHORIZATION=f"Bearer {token}")
    client.get("/api/theses/999999", HTTP_AUTHORIZATION=f"Bearer {token}x")  # a wrong one too

    logged_in_client.post(reverse("webhook_new"), {"url": "https://hooks.example/kl", "events": ["thesis.created"]})
    from webhooks.models import Endpoint

    endpoint_secret = Endpoint.objects.get().secret
    logged_in_client.get(Endpoint.objects.get().get_absolute_url())
    logged = "\n".join(record.getMessage() + str(record.args) for record in caplog.records)
    assert token not in logged and token[len("kl_"):] not in logged
    assert endpoint_secret not in logged and endpoint_secret.removeprefix("whsec_") not in logged


def _asgi_post(app, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes, int]:
    """(status, body, chunks the app was handed) of one POST through an ASGI app."""
    import asyncio

    pending = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
               for i, chunk in enumerate(chunks)]
    handed, sent = [], []

    async def receive():
        message = pending.pop(0)
        handed.append(message)
        return message

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), len(handed)


async def _reads_the_whole_body(scope, receive, send):
    """What Django does with a request before any view runs: read the body, all of it."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def test_the_server_answers_a_body_declared_too_large_at_once_and_stops_reading_it(tmp_path):
    """Daphne under config.serve: a client that declares 10^15 bytes and keeps sending
    once streamed 4.3 GB in 5 s into a server that read on until it stopped."""
    import socket
    import time

    from django.conf import settings
    from config.serve import LINGER_S

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "daphne.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "config.serve", "-b", "127.0.0.1", "-p", str(port),
                               "config.asgi:application"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "daphne.log").read_text()
            time.sleep(0.1)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /api/theses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000000000\r\n\r\n")
        sock.setblocking(False)
        sent, answer, closed_after = 0, b"", None
        started = time.monotonic()
        while time.monotonic() - started < LINGER_S + 30:
            try:
                sent += sock.send(b"\0" * 65536)
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - started
                break
            try:
                got = sock.recv(4096)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                closed_after = time.monotonic() - started
                break
            if not got:
                closed_after = time.monotonic() - started
                break
            if not answer:
                answered_at = sent
            answer += got
        sock.close()
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
        # Answered before the client had sent even the cap (nothing to wait for), and cut
        # off at the end of the linger instead of reading on.
        assert answered_at < settings.REQUEST_MAX_BYTES
        assert closed_after is not None and closed_after < LINGER_S + 30
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_a_request_body_over_the_cap_is_refused_before_the_app_reads_it():
    from config.request_limits import RequestBodyLimit

    limited = RequestBodyLimit(_reads_the_whole_body, max_bytes=1000)
    # Unlimited, the app reads whatever is sent.
    assert _asgi_post(_reads_the_whole_body, [b"x" * 600] * 3, [])[:2] == (200, b"1800")
    # Declared too large: refused without one chunk read.
    status, body, handed = _asgi_post(limited, [b"x" * 600] * 3, [(b"content-length", b"1800")])
    assert (status, handed) == (413, 0) and b"over 1,000 bytes" in body
    # Not declared (chunked): stopped at the chunk that crosses the cap.
    status, _, handed = _asgi_post(limited, [b"x" * 600] * 3, [])
    assert (status, handed) == (413, 2)
    # A nonsense length is no length.
    assert _asgi_post(limited, [b"x"], [(b"content-length", b"-1")])[0] == 413
    # Within the cap, nothing changes.
    assert _asgi_post(limited, [b"x" * 600], [(b"content-length", b"600")])[:2] == (200, b"600")


def test_a_text_is_rendered_once_and_its_html_kept_under_its_digest(monkeypatch):
    from django.utils.safestring import SafeString

    from research import markdown as rendering

    calls: list[str] = []
    real = rendering.md.markdown
    monkeypatch.setattr(rendering.md, "markdown", lambda text, **kw: calls.append(text) or real(text, **kw))
    idea = "Rows in **blocks** <script>alert(1)</script> [x](javascript:alert(1))"
    first, again = rendering.render_markdown(idea), rendering.render_markdown(idea)
    assert len(calls) == 1 and first == again and isinstance(again, SafeString)
    assert "<strong>blocks</strong>" in again and "<script>" not in again and "javascript:" not in again
    assert "<em>" in rendering.render_markdown(idea + " *more*") and len(calls) == 2  # a new text, a new key


def test_markdown_never_sees_more_link_brackets_than_it_can_scan_quickly(monkeypatch):
    """Python-Markdown scans ahead at every "[" for the end of a link: 8,000 unmatched ones
    in a thesis idea took 12 s a page view (docs/security.md has the figures). Past
    MAX_LINK_BRACKETS they are set aside while rendering and come back as text."""
    import markdown as md

    from research import markdown as rendering

    seen: list[str] = []
    real = md.markdown
    monkeypatch.setattr(rendering.md, "markdown", lambda text, **kw: seen.append(text) or real(text, **kw))
    idea = "See [the trace](https://example.com/t). " + "[" * 20_000 + " <script>x</script>"
    html = str(rendering.render_markdown(idea))
    assert seen[-1].count("[") == 0
    assert html.count("[") == 20_001 and "<script>" not in html  # every bracket shown, nothing unsafe
    assert 'href="https://example.com/t"' not in html  # no link is made of them past the limit
    few = str(rendering.render_markdown("See [the trace](https://example.com/t). " + "[" * 10))
    assert seen[-1].count("[") == 11 and 'href="https://example.com/t"' in few
