"""Runs the whole app on one machine: Daphne (one process per core, behind one port), a
Celery worker for evaluations and one for webhook deliveries, and Redis if needed.

    python -m config.launch [--host 127.0.0.1] [--port 8000] [--web-processes N]

Without REDIS_URL an embedded Redis starts; without DATABASE_URL the app uses SQLite in
WAL mode under DATA_DIR. Ctrl-C (or SIGTERM) stops every process, worker first so it
can finish or hand back its task.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from config import launcher_state, web_processes
from config.private_files import private_data_dir
from config.embedded_redis import EmbeddedRedis, die_with_parent

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 20


def _manage(*args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], check=True, cwd=ROOT)


# Own session: the terminal's Ctrl-C reaches only this launcher, which then stops the
# children in order instead of all at once; they end with it even if it is killed.
_CHILD = {"stdin": subprocess.DEVNULL, "start_new_session": True, "preexec_fn": die_with_parent}


def _spawn(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, **_CHILD)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _link_host(host: str) -> str:
    """Where a link to the site can point: a wildcard address is where it listens, not that."""
    try:
        return "127.0.0.1" if ipaddress.ip_address(host).is_unspecified else host
    except ValueError:
        return host or "127.0.0.1"


def _wait_until_answering(host: str, port: int, children: list[subprocess.Popen], timeout_s: float = 120) -> bool:
    """Until the site answers HTTP on host:port ("up" is said only then: the port is
    bound before any server process runs, so a connection alone proves nothing); False
    if a child exited or it never did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children):
            return False
        connection = http.client.HTTPConnection(host, port, timeout=5)
        try:
            connection.request("GET", "/login/")
            connection.getresponse()  # any status: an answer all the same
            return True
        except (OSError, http.client.HTTPException):  # not listening yet, or cut off mid-answer
            time.sleep(0.1)
        finally:
            connection.close()
    return False


def _web_processes(value: str) -> int:
    count = int(value) if value.isdigit() else 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"a whole number of processes, 1 or more, not {value!r}")
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--queues", default="default,runner.cpu",
                        help="Celery queues the worker serves (comma-separated)")
    parser.add_argument("--web-processes", type=_web_processes,
                        default=os.environ.get("WEB_PROCESSES") or str(web_processes.usable_cores()),
                        help="Daphne processes behind the port (default: WEB_PROCESSES, or one per usable core)")
    args = parser.parse_args(argv)
    try:  # bound now: a port in use is said before anything starts
        listener = web_processes.listening_socket(args.host, args.port)
    except OSError as error:
        parser.exit(2, f"Cannot listen on {args.host}:{args.port}: {error.strerror or error}\n")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    data_dir = Path(os.environ.get("DATA_DIR", ROOT / "var"))
    # Everything the app and its children write under it is their owner's alone: the
    # database, the workspace, uploads, logs (private_files.private_data_dir says why).
    os.umask(0o077)
    private_data_dir(data_dir)

    redis_server = None
    if not os.environ.get("REDIS_URL"):
        redis_server = EmbeddedRedis(data_dir / "redis")
        os.environ["REDIS_URL"] = redis_server.start()
        print(f"Embedded Redis on {redis_server.address} (its password: {redis_server.directory / 'redis.conf'})",
              flush=True)
    # Links in webhooks and API answers name the port this site really serves on.
    os.environ.setdefault("SITE_URL", f"http://{_link_host(args.host)}:{args.port}")
    launcher_state.write(data_dir, site_url=os.environ["SITE_URL"],
                         redis_url=redis_server.url if redis_server else None)

    children: list[subprocess.Popen] = []
    stopping = False

    def request_stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        _manage("migrate", "--noinput", "-v", "0")
        _manage("workspace_init")
        _manage("first_login")
        bin_dir = Path(sys.executable).parent
        children.append(_spawn([
            str(bin_dir / "celery"), "-A", "config", "worker", "-Q", args.queues,
            "--concurrency", "1", "--loglevel", "INFO", "--hostname", "runner@%h",
        ]))
        # Webhook deliveries apart: a receiver that hangs never holds up an evaluation.
        children.append(_spawn([
            str(bin_dir / "celery"), "-A", "config", "worker", "-Q", "webhooks",
            "--concurrency", "2", "--loglevel", "INFO", "--hostname", "webhooks@%h",
        ]))
        # Daphne, with request bodies capped as they arrive, in processes sharing the port.
        children.extend(web_processes.start(listener, args.web_processes, **_CHILD))
        listener.close()  # theirs now: a port nobody serves is a refused connection, not a hang
        if not _wait_until_answering(_link_host(args.host), args.port, children):
            print("Daphne did not come up; stopping the rest.", file=sys.stderr, flush=True)
            return 1
        print(f"\nKernel Lab is up: http://{args.host}:{args.port}/  ({args.web_processes} web processes; "
              "Ctrl-C stops it)\n", flush=True)
        while not stopping:
            if any(child.poll() is not None for child in children):
                print("A process exited; stopping the rest.", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        listener.close()
        for child in children:  # the worker first: it hands back what it holds
            _stop(child)
        launcher_state.remove(data_dir)
        if redis_server:
            redis_server.stop()
        print("Stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
