"""Faults injected into real processes and servers: a worker killed with SIGKILL in the
middle of a candidate, Redis restarted during a sweep, Daphne restarted under an open
websocket, a webhook receiver that is down for a while.

Workers and Daphne run as real subprocesses (`celery -A config worker`, `daphne`) on
the test's database and a private redis-server the test starts, so what is exercised
is what a deployment does: acks late, rejection on worker loss, the broker's
visibility timeout, claiming by a conditional update, replay by seq.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from celery.contrib.testing.worker import start_worker
from django.db import connection, transaction
from django.test import Client

from config.celery import app
from config.embedded_redis import free_port
from research import candidates, queueing, selectors, sweeps
from research.events import event_append
from research.models import Candidate, Event, Sweep
from research.recovery import REQUEUED
from webhooks import services as webhook_services
from webhooks.models import Attempt, Delivery

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The evaluation's hard limit in the worker subprocesses; the broker's visibility
# timeout is twice that (config.settings), so a task held by a dead worker is handed
# out again after about 2 × this. One evaluation here takes about 8 s on 2 idle cores
# (10 s with both cores spun by other processes); the margin is for a machine that is
# busy with other work (one took over 25 s during a full CI run).
CANDIDATE_TIME_LIMIT_S = 40


def _database_url() -> str:
    """The test database, as a URL a subprocess's settings read."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{db['USER']}{password}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DATABASE_URL=_database_url(), PYTHONUNBUFFERED="1", DB_CONN_MAX_AGE="0",
               CANDIDATE_TIME_LIMIT_S=str(CANDIDATE_TIME_LIMIT_S), **extra)
    return env


class Subprocess:
    """A server process in its own process group, so SIGKILL takes all of it at once."""

    def __init__(self, command: list[str], log_path: Path, **env: str) -> None:
        self.log_path = log_path
        self.log = log_path.open("a")
        self.process = subprocess.Popen(command, cwd=ROOT, env=_environment(**env), stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """What a power cut does to it: SIGKILL to it and every process it started."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def output(self) -> str:
        return self.log_path.read_text()


class RedisServer:
    """A private redis-server, configured as the embedded one (append-only file), that
    can be restarted on the same port and directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--save", "", "--logfile", str(self.directory / "redis.log")],
            start_new_session=True)

        def answering() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", self.port)) == 0

        _wait_for(answering, 20, "redis-server to listen")

    def lose_data(self) -> None:
        """Stopped, its files gone, started again: a Redis without persistence restarting."""
        self.stop()
        for path in self.directory.iterdir():
            if path.name != "redis.log":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.start()

    def stop(self) -> None:
        """A clean shutdown: SIGTERM, after which Redis writes its append-only file."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def private_redis(tmp_path, monkeypatch) -> Iterator[RedisServer]:
    """A Redis of this test's own, the broker of the workers it starts: no other test
    run on the machine can flush it or take its messages. Evaluations are enqueued
    there (queue declared first, as a worker would)."""
    from research.tasks import evaluate_candidate

    server = RedisServer(tmp_path / "redis")
    server.start()

    def send_on_the_private_redis(candidate_id: int, dispatch: str, queue: str) -> None:
        with app.connection_for_write(server.url) as broker:
            app.amqp.queues[queue](broker.default_channel).declare()
            evaluate_candidate.apply_async(args=[candidate_id, dispatch], queue=queue, connection=broker)

    monkeypatch.setattr(queueing, "evaluation_send", send_on_the_private_redis)
    yield server
    server.stop()


def _worker(tmp_path: Path, name: str, redis: RedisServer, **env: str) -> Subprocess:
    return Subprocess([str(BIN / "celery"), "-A", "config", "worker", "-Q", "runner.cpu,default",
                       "--concurrency", "1", "--loglevel", "INFO", "--hostname", f"{name}@%h"],
                      tmp_path / f"{name}.log", REDIS_URL=redis.url, **env)


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str, logs: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


def _running(candidate_id: int, attempt: int) -> Callable[[], bool]:
    return lambda: Candidate.objects.filter(
        pk=candidate_id, status=Candidate.Status.RUNNING, attempts=attempt).exists()


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


@pytest.fixture
def one_candidate(make_thesis, user, private_redis):
    """A sweep of one candidate on one workload, queued for the runner.cpu queue."""
    thesis = make_thesis(context_lengths=[64], batch_sizes=[1])
    sweep = sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=1)
    return sweep.candidates.get()


def test_a_worker_killed_in_the_middle_of_a_candidate_is_redelivered_and_recorded_once(
    one_candidate, tmp_path, private_redis
):
    first = _worker(tmp_path, "first", private_redis)
    try:
        _wait_for(_running(one_candidate.pk, 1), 60, "the first worker to claim the candidate", first.output)
        claimed_at = time.monotonic()
    finally:
        first.kill()  # the worker, its pool child and the harness it was running
    # The message is unacknowledged in Redis: the broker hands it out again once the
    # visibility timeout has passed, to a worker that starts (or sweeps) after that.
    time.sleep(max(0.0, claimed_at + 2 * CANDIDATE_TIME_LIMIT_S + 1 - time.monotonic()))
    second = _worker(tmp_path, "second", private_redis)
    try:
        _wait_for(lambda: Sweep.objects.get(pk=one_candidate.sweep_id).status == Sweep.Status.FINISHED,
                  90, "the second worker to finish the sweep", second.output)
    finally:
        second.stop()

    one_candidate.refresh_from_db()
    assert one_candidate.status == Candidate.Status.DONE, one_candidate.error
    assert one_candidate.attempts == 2 and one_candidate.correct is True
    # Measured once: one row per workload, not one per delivery.
    assert one_candidate.measurements.count() == len(selectors.sweep_workload_names(one_candidate.sweep))
    types = list(Event.objects.filter(sweep_id=one_candidate.sweep_id).values_list("type", flat=True))
    assert types.count("candidate.started") == 2 and types.count("candidate.result") == 1
    assert Sweep.objects.get(pk=one_candidate.sweep_id).done == 1


def test_a_candidate_that_kills_its_worker_every_time_ends_failed_after_three_attempts(
    one_candidate, tmp_path, private_redis
):
    worker = _worker(tmp_path, "runner", private_redis)
    try:
        for attempt in range(1, candidates.MAX_ATTEMPTS + 1):
            _wait_for(_running(one_candidate.pk, attempt), 60, f"attempt {attempt}", worker.output)
            # The pool process running it dies (and the harness below it); the worker's
            # main process sees the loss and hands the task back to the broker.
            for pid in _descendants(worker.process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _wait_for(lambda: Candidate.objects.get(pk=one_candidate.pk).status == Candidate.Status.FAILED,
                  60, "the candidate to be given up on", worker.output)
    finally:
        worker.stop()

    one_candidate.refresh_from_db()
    assert one_candidate.attempts == candidates.MAX_ATTEMPTS and one_candidate.verdict == "rejected"
    assert f"{candidates.MAX_ATTEMPTS} times" in one_candidate.error
    assert not one_candidate.measurements.exists()
    sweep = Sweep.objects.get(pk=one_candidate.sweep_id)
    assert sweep.status == Sweep.Status.FINISHED and sweep.done == 1
    types = list(Event.objects.filter(sweep=sweep).values_list("type", flat=True))
    assert types.count("candidate.started") == candidates.MAX_ATTEMPTS and types.count("candidate.result") == 1


class WebSocket:
    """A minimal websocket client (RFC 6455) over a plain socket, as a browser speaks it:
    text frames of JSON, masked from the client, with the page's session cookie."""

    def __init__(self, port: int, path: str, cookie: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buffer = b""
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Origin: http://127.0.0.1:{port}\r\nCookie: {cookie}\r\n\r\n").encode())
        while b"\r\n\r\n" not in self.buffer:
            self._receive_more()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def _receive_more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk

    def _read(self, count: int) -> bytes:
        while len(self.buffer) < count:
            self._receive_more()
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def _send(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        length = len(payload)
        if length < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
        else:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send_json(self, content: dict) -> None:
        self._send(0x1, json.dumps(content).encode())

    def receive_json(self, timeout_s: float = 10) -> dict | None:
        """The next frame, or None when nothing arrives within the time."""
        self.sock.settimeout(timeout_s)
        while True:
            try:
                first, second = self._read(2)
            except TimeoutError:
                return None
            length = second & 0x7F
            if length == 126:
                length = struct.unpack("!H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self._read(8))[0]
            payload = self._read(length)
            opcode = first & 0x0F
            if opcode == 0x8:
                raise ConnectionError("the server closed the websocket")
            if opcode == 0x9:
                self._send(0xA, payload)  # pong
                continue
            return json.loads(payload)

    def close(self) -> None:
        self.sock.close()


def _daphne(tmp_path: Path, port: int, redis: RedisServer) -> Subprocess:
    server = Subprocess([sys.executable, "-m", "config.serve", "-b", "127.0.0.1", "-p", str(port),
                         "config.asgi:application"],
                        tmp_path / "daphne.log", REDIS_URL=redis.url)

    def serving() -> bool:
        if server.process.poll() is not None:
            raise AssertionError(f"daphne exited:\n{server.output()}")
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    _wait_for(serving, 60, "daphne to listen", server.output)
    return server


@pytest.fixture
def watched_sweep(make_thesis, user, private_redis, settings) -> tuple[Sweep, str, str]:
    """A sweep, its websocket path and a logged-in page's cookie; this process publishes
    where Daphne listens: the private Redis."""
    layer = settings.CHANNEL_LAYERS["default"]
    host = {**layer["CONFIG"]["hosts"][0], "address": private_redis.url}
    settings.CHANNEL_LAYERS = {"default": {**layer, "CONFIG": {**layer["CONFIG"], "hosts": [host]}}}
    sweep = Sweep.objects.create(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="grid",
                                 budget=1, seed=1, hardware="cpu", queue="runner.cpu", total=1)
    browser = Client()
    browser.force_login(user)
    return sweep, f"/ws/sweeps/{sweep.pk}/", f"sessionid={browser.cookies['sessionid'].value}"


def test_an_idle_page_keeps_its_websocket_and_gets_the_next_event_on_it(watched_sweep, tmp_path, private_redis):
    sweep, path, cookie = watched_sweep
    port = free_port()
    daphne = _daphne(tmp_path, port, private_redis)
    try:
        socket_ = WebSocket(port, path, cookie)
        socket_.send_json({"after": 0})
        # Longer than the channel layer's 5 s blocking reads, with nothing to send: a read
        # timeout there would close the socket (1011) and the page would reconnect.
        assert socket_.receive_json(timeout_s=7) is None
        event_append(sweep_id=sweep.pk, type="note", payload={"n": 1})
        assert socket_.receive_json()["seq"] == 1
        socket_.close()
    finally:
        daphne.stop()


def test_a_page_reconnecting_after_daphne_restarts_is_replayed_exactly_what_it_missed(
    watched_sweep, tmp_path, private_redis
):
    sweep, path, cookie = watched_sweep
    for n in (1, 2):
        event_append(sweep_id=sweep.pk, type="note", payload={"n": n})
    port = free_port()

    daphne = _daphne(tmp_path, port, private_redis)
    try:
        socket_ = WebSocket(port, path, cookie)
        socket_.send_json({"after": 0})
        assert [socket_.receive_json()["seq"] for _ in range(2)] == [1, 2]
        event_append(sweep_id=sweep.pk, type="note", payload={"n": 3})
        assert socket_.receive_json()["seq"] == 3
    finally:
        daphne.kill()
    with pytest.raises(ConnectionError):
        socket_.receive_json()
    socket_.close()

    # While the server is down the sweep goes on: these pushes reach no one.
    for n in (4, 5):
        event_append(sweep_id=sweep.pk, type="note", payload={"n": n})

    daphne = _daphne(tmp_path, port, private_redis)
    try:
        socket_ = WebSocket(port, path, cookie)
        socket_.send_json({"after": 3})  # the last seq the page saw
        missed = [socket_.receive_json(), socket_.receive_json()]
        assert [(f["seq"], f["payload"]) for f in missed] == [(4, {"n": 4}), (5, {"n": 5})]
        assert socket_.receive_json(timeout_s=0.5) is None  # nothing twice
        event_append(sweep_id=sweep.pk, type="note", payload={"n": 6})
        assert socket_.receive_json()["seq"] == 6
        socket_.close()
    finally:
        daphne.stop()


def test_a_webhook_receiver_that_is_down_for_a_while_gets_the_delivery_once_it_is_back(user, settings):
    settings.WEBHOOKS_ALLOW_PRIVATE_NETWORKS = True  # the receiver is on 127.0.0.1
    settings.WEBHOOKS_RETRY_BASE_S = 0.2
    settings.WEBHOOKS_RETRY_CAP_S = 0.4
    settings.WEBHOOKS_MAX_ATTEMPTS = 50
    port = free_port()
    endpoint = webhook_services.endpoint_create(owner=user, url=f"http://127.0.0.1:{port}/hooks",
                                                events=["candidate.kept"])
    received: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"])).decode()
            received.append({"webhook-id": self.headers["webhook-id"], "body": body})
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    with start_worker(app, pool="solo", perform_ping_check=False, queues=["webhooks"], shutdown_timeout=30):
        with transaction.atomic():  # as a decision does: the event commits with it
            webhook_services.webhook_event(type="candidate.kept", payload={"candidate": {"id": 7}})
        delivery = Delivery.objects.get(endpoint=endpoint)
        # Nothing listens on the port: attempts are refused and retried.
        _wait_for(lambda: Delivery.objects.get(pk=delivery.pk).attempts >= 3, 30, "three refused attempts")
        assert Delivery.objects.get(pk=delivery.pk).status != Delivery.Status.GAVE_UP
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            _wait_for(lambda: Delivery.objects.get(pk=delivery.pk).status == Delivery.Status.SUCCEEDED,
                      30, "the delivery to succeed")
        finally:
            server.shutdown()
            server.server_close()

    assert len(received) == 1 and received[0]["webhook-id"] == delivery.webhook_id
    assert json.loads(received[0]["body"])["data"] == {"candidate": {"id": 7}}
    codes = list(Attempt.objects.filter(delivery=delivery).order_by("number").values_list("status_code", flat=True))
    # Every attempt while it was down was refused (no status), the last one got through.
    assert len(codes) >= 4 and codes[-1] == 200 and all(code is None for code in codes[:-1])


def _three_candidates_and_the_first_running(make_thesis, user, worker: Subprocess) -> tuple[Sweep, Candidate]:
    thesis = make_thesis(context_lengths=[64], batch_sizes=[1])
    sweep = sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=3)
    first = sweep.candidates.order_by("number").first()
    _wait_for(_running(first.pk, 1), 60, "the first candidate to start", worker.output)
    return sweep, first


def test_a_sweep_completes_across_a_redis_restart_and_every_event_is_replayed(
    make_thesis, user, tmp_path, private_redis
):
    worker = _worker(tmp_path, "runner", private_redis)
    try:
        sweep, first = _three_candidates_and_the_first_running(make_thesis, user, worker)
        # Redis goes away in the middle of the evaluation and stays away while its result
        # is recorded: that event's push is lost, and so is the task's acknowledgement.
        private_redis.stop()
        _wait_for(lambda: Sweep.objects.get(pk=sweep.pk).done >= 1, 60, "the first result", worker.output)
        private_redis.start()
        _wait_for(lambda: Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.FINISHED,
                  120, "the sweep to finish after the restart", worker.output)
    finally:
        worker.stop()

    sweep.refresh_from_db()
    assert sweep.done == 3
    for candidate in sweep.candidates.all():
        assert candidate.status == Candidate.Status.DONE, candidate.error
        assert candidate.attempts == 1 or candidate.pk == first.pk
    events = list(Event.objects.filter(sweep=sweep).order_by("seq").values_list("seq", "type"))
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    types = [t for _, t in events]
    assert types.count("candidate.result") == 3 and types[-1] == "sweep.finished"
    # A page that saw nothing (or anything) is replayed the rest from the database.
    replayed = selectors.sweep_events_after(sweep.pk, 0)
    assert [e["seq"] for e in replayed] == [seq for seq, _ in events]


def test_a_sweep_completes_after_redis_loses_its_data_and_each_candidate_is_recorded_once(
    make_thesis, user, tmp_path, private_redis
):
    # The worker looks for work that lost its message every second, and calls it lost
    # after 2 s with its queue drained (production: every 60 s, after 120 s).
    worker = _worker(tmp_path, "runner", private_redis, RECOVER_AFTER_S="2", RECOVER_EVERY_S="1")
    try:
        sweep, _ = _three_candidates_and_the_first_running(make_thesis, user, worker)
        # The messages of the other two, waiting in the queue, go with Redis's data.
        private_redis.lose_data()
        _wait_for(lambda: Sweep.objects.get(pk=sweep.pk).status == Sweep.Status.FINISHED,
                  180, "the sweep to finish after Redis lost its data", worker.output)
    finally:
        worker.stop()

    sweep.refresh_from_db()
    assert sweep.done == 3
    candidates = list(sweep.candidates.order_by("number"))
    assert [c.status for c in candidates] == [Candidate.Status.DONE] * 3, [c.error for c in candidates]
    assert [c.attempts for c in candidates] == [1, 1, 1]
    workloads = len(selectors.sweep_workload_names(sweep))
    assert [c.measurements.count() for c in candidates] == [workloads] * 3
    events = list(Event.objects.filter(sweep=sweep).order_by("seq"))
    types = [e.type for e in events]
    assert types.count("candidate.result") == 3 and types[-1] == "sweep.finished"
    assert sorted(e.payload["number"] for e in events if e.type == REQUEUED) == [2, 3]
