"""Shared by the scripts under bench/: a run's own servers, and data filled through services.

The load benchmarks run the app as production does, on loopback: Daphne processes
serving config.asgi:application, the channel layer on Redis, one database that Daphne
and the benchmark share. `app_environment()` gives a run its own Redis (REDIS_URL's, or
an embedded one) and its own fresh database (a new one on DATABASE_URL's server, or
SQLite in a temporary directory), `daphne()` the server; both clean up on exit, Ctrl-C,
SIGTERM and errors included.

Django is set up by `app_environment()`, after it has prepared the environment the
settings read, so the functions below that use the ORM import the app when called.
"""

from __future__ import annotations

import http.client
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from config.embedded_redis import EmbeddedRedis, die_with_parent, free_port

ROOT = Path(__file__).resolve().parent.parent

# Debian's Chromium, never a browser Playwright downloads; headless, nothing of its own running
# (the browser tests and the chart renderer use it alike).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
DAPHNE_START_TIMEOUT_S = 60
DAPHNE_STOP_TIMEOUT_S = 15


@contextmanager
def app_environment() -> Iterator[str]:
    """Django set up on a fresh, migrated database and a Redis of this run, removed on
    exit; yields a line that says which servers they are.

    The run's DATA_DIR and kernel workspace are a temporary directory, whatever the
    environment says: a benchmark never writes into an installation's files.
    """
    # SIGTERM ends a run the way Ctrl-C does: through every cleanup below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with ExitStack() as stack:
        data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kernel-lab-bench-")))
        os.environ["DATA_DIR"] = str(data_dir)
        os.environ["KERNEL_WORKSPACE"] = str(data_dir / "workspace")
        redis = os.environ.get("REDIS_URL")
        if not redis:
            embedded = EmbeddedRedis(data_dir / "redis")
            stack.callback(embedded.stop)
            os.environ["REDIS_URL"] = embedded.start()
            redis = "embedded"
        # Keys of this run's own (channel layer and cache): every run's sweep is sweep 1, and
        # a shared Redis may still hold the group members of an interrupted run.
        os.environ["CHANNEL_PREFIX"] = prefix = f"bench-{os.getpid()}-"
        stack.callback(_delete_keys, os.environ["REDIS_URL"], prefix)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
        import django

        django.setup()
        database = stack.enter_context(_fresh_database())
        # On a shared machine other work competes for the cores: say how much there was.
        yield f"database: {database}; Redis: {redis}; load average {os.getloadavg()[0]:.1f} at the start"


def _delete_keys(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)


@contextmanager
def _fresh_database() -> Iterator[str]:
    from django.core.management import call_command
    from django.db import connection

    url = os.environ.get("DATABASE_URL")
    if connection.vendor == "sqlite":
        if url:
            raise SystemExit("Run the benchmark on a database server (DATABASE_URL=postgres://…) "
                             "or on SQLite of its own (DATABASE_URL unset), not on a SQLite file.")
        # The app's default, DATA_DIR/db.sqlite3 with the app's SQLite options, in this
        # run's new directory: Daphne finds the same file through DATA_DIR.
        call_command("migrate", verbosity=0)
        try:
            yield "SQLite (WAL) in a temporary directory"
        finally:
            connection.close()
        return
    # A new database beside the named one, never the named one itself; the pid keeps two
    # runs (or a run and the test suite's own test database) apart.
    named = connection.settings_dict["NAME"]
    connection.settings_dict["TEST"]["NAME"] = f"{named}_run_{os.getpid()}"
    fresh = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    os.environ["DATABASE_URL"] = urlunsplit(urlsplit(url)._replace(path=f"/{fresh}"))  # for Daphne
    try:
        version = ".".join(map(str, connection.get_database_version()))
        yield f"{connection.display_name} {version}, a new database {fresh}"
    finally:
        connection.creation.destroy_test_db(named, verbosity=0)


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    pids: tuple[int, ...]  # its Daphne processes
    log_path: Path

    @property
    def pid(self) -> int:
        """The first (with one process, the only) Daphne process."""
        return self.pids[0]

    def log_errors(self, lines: int = 60) -> str:
        """The end of Daphne's log without its access lines: what went wrong inside it."""
        access = re.compile(r'^\S+:\d+ - - \[[^]]*\] "')
        kept = [line for line in self.log_path.read_text(errors="replace").splitlines() if not access.match(line)]
        return "\n".join(kept[-lines:])

    def show_log_errors(self) -> None:
        """log_errors() on stderr, under a heading: where a run went wrong."""
        print(f"--- Daphne's log, less its access lines ---\n{self.log_errors()}", file=sys.stderr)


@contextmanager
def daphne(*, capped: bool = True, processes: int = 1) -> Iterator[Server]:
    """config.asgi:application served on a free loopback port, as in production: by
    `processes` Daphne processes sharing the port (config.web_processes, as the quick
    start runs them; each one config.serve), or with `capped=False` by one process of
    Daphne's own command, whose requests read any body whole. Stopped (SIGTERM, then
    SIGKILL) on exit."""
    from config import web_processes

    log_path = Path(os.environ["DATA_DIR"]) / "daphne.log"
    # Out of the terminal's process group, so Ctrl-C reaches the benchmark, which stops
    # them in order; they die with the benchmark even on SIGKILL.
    child = {"env": os.environ, "stdin": subprocess.DEVNULL, "start_new_session": True,
             "preexec_fn": die_with_parent}
    with ExitStack() as stack:
        log = stack.enter_context(log_path.open("w"))
        child.update(stdout=log, stderr=subprocess.STDOUT)
        if capped:
            with web_processes.listening_socket("127.0.0.1", 0) as listener:  # theirs once started
                port = listener.getsockname()[1]
                started = web_processes.start(listener, processes, **child)
        else:
            if processes != 1:
                raise ValueError("Daphne's own command runs one process")
            port = free_port()
            started = [subprocess.Popen([str(Path(sys.executable).parent / "daphne"), "-b", "127.0.0.1",
                                         "-p", str(port), "config.asgi:application"], cwd=ROOT, **child)]
        for process in started:
            stack.callback(_stop, process)
        server = Server(f"http://127.0.0.1:{port}", tuple(process.pid for process in started), log_path)
        try:
            _wait_until_serving(started, server.url)
            yield server
        except Exception:
            server.show_log_errors()
            raise


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(DAPHNE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


MIB = b"x" * (1 << 20)


def post_mebibytes(url: str, megabytes: int, *, declared: bool) -> int:
    """The status of a POST of `megabytes` MiB to the results import, with its
    Content-Length or chunked: what a client that ignores the server's limit sends."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    headers = {"Content-Type": "application/x-ndjson"}
    if declared:
        headers["Content-Length"] = str(len(MIB) * megabytes)
    connection.request("POST", "/api/theses/1/results", body=(MIB for _ in range(megabytes)),
                       headers=headers, encode_chunked=not declared)
    status = connection.getresponse().status
    connection.close()
    return status


def _wait_until_serving(processes: list[subprocess.Popen], url: str) -> None:
    deadline = time.monotonic() + DAPHNE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise RuntimeError(f"a Daphne process exited with {[process.poll() for process in processes]}")
        try:
            with urllib.request.urlopen(f"{url}/login/", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"Daphne did not answer within {DAPHNE_START_TIMEOUT_S} s")


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) a process has used so far, from Linux's /proc; NaN elsewhere."""
    try:
        # The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds used by Daphne (all its processes) and by this process (all its threads)
    over a stretch of wall time."""

    wall_s: float
    daphne_s: float
    own_s: float

    def __str__(self) -> str:
        return f"Daphne {self.daphne_s / self.wall_s:.0%}, this process {self.own_s / self.wall_s:.0%}"


def cpu_clocks(server: Server) -> tuple[float, float, float]:
    return time.perf_counter(), sum(cpu_seconds(pid) for pid in server.pids), time.process_time()


def cpu_use_since(clocks: tuple[float, float, float], server: Server) -> CpuUse:
    return CpuUse(*(now - then for then, now in zip(clocks, cpu_clocks(server))))


def session_cookie(user) -> tuple[str, str]:
    """A real login session of `user`, stored where Daphne reads sessions: the name and
    value of the cookie a logged-in browser sends."""
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    return settings.SESSION_COOKIE_NAME, client.cookies[settings.SESSION_COOKIE_NAME].value


def keep_evaluations_here() -> None:
    """This process records the results itself: no evaluation is handed to a worker's queue."""
    from research import queueing

    queueing.evaluations_enqueue = lambda candidate_ids, queue: None


def sweep_of(author, candidates: int):
    """A grid sweep of rmsnorm's `blocked` kernel filed and started by `author` through the
    services, grown to `candidates` queued candidates (all with the first one's point)."""
    from research import sweeps, theses

    thesis = theses.thesis_submit(author=author, title="bench", idea="bench", op="rmsnorm",
                                  hardware="cpu", required_dsl="torch")
    sweep = sweeps.sweep_start(thesis=thesis, started_by=author, kernel="blocked", strategy="grid", budget=1)
    template = sweep.candidates.get()
    sweep.candidates.model.objects.bulk_create(
        sweep.candidates.model(sweep=sweep, number=n, params=template.params, source=template.source)
        for n in range(2, candidates + 1)
    )
    type(sweep).objects.filter(pk=sweep.pk).update(total=candidates, budget=candidates)
    sweep.refresh_from_db()
    return sweep


def synthetic_result(number: int, workloads: list[str]) -> dict:
    """A harness result for candidate `number`: speedups spread around 1 (some wins),
    a guard, CIs and p-values, in the shape workers record. Not a measurement."""
    speedups = [1.0 + ((number * 7 + i) % 13 - 6) / 100 for i in range(len(workloads))]
    return {
        "verdict": "win" if max(speedups) > 1.05 else "no-gain", "correct": True, "error": None,
        "guards": [{"name": "correctness", "status": "pass", "detail": "ok"}],
        "workloads": [
            {"name": name, "baseline_ms": 1.0, "candidate_ms": 1.0 / s, "speedup": s,
             "speedup_ci": [s - 0.01, s + 0.01], "p_value": 0.001, "significant": s > 1.05}
            for name, s in zip(workloads, speedups)
        ],
    }


def sweep_with_results(author, results: int):
    """A sweep of `results` candidates, each claimed and recorded through the services
    exactly as workers do (events included)."""
    from research import candidates, selectors

    sweep = sweep_of(author, results)
    workloads = selectors.sweep_workload_names(sweep)
    for candidate in sweep.candidates.order_by("number"):
        candidates.candidate_claim(candidate_id=candidate.pk)
        candidates.candidate_record_result(candidate_id=candidate.pk,
                                           result=synthetic_result(candidate.number, workloads))
    return sweep


def add_web_processes_argument(parser) -> None:
    """--web-processes: Daphne processes behind the port; by default the quick start's count."""
    from config import web_processes

    parser.add_argument("--web-processes", type=int, default=web_processes.usable_cores(),
                        help="Daphne processes sharing the port (default: one per usable core, as the quick start)")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile: a value that was measured, never an interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run(main) -> None:
    """Exits with `main()`'s status; Ctrl-C ends the run quietly once everything is stopped."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("Interrupted: the servers are stopped and the database removed.", file=sys.stderr)
        sys.exit(130)
