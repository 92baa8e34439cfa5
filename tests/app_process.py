"""Runs the quick start's launcher as a real process, on the embedded defaults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from config.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def launched_app(data_dir: Path, env: dict[str, str] | None = None) -> Iterator[AppProcess]:
    """The app, up and serving, for the length of the block; stopped like Ctrl-C after.
    `env`: settings of the app's own environment (AGENT_COMMANDS_FILE, say)."""
    process = AppProcess(data_dir, env)
    try:
        process.wait_until_up()
        yield process
    finally:
        process.stop()


class AppProcess:
    """`python -m config.launch` with no DATABASE_URL or REDIS_URL: SQLite and embedded Redis."""

    def __init__(self, data_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / "launch.log"
        env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SITE_URL"}}
        env.update(DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", **(extra_env or {}))
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "config.launch", "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_until_up(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the launcher exited:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/login/", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise RuntimeError(f"the app did not come up:\n{self.output()}")

    def login(self) -> tuple[str, str]:
        lines = dict(
            line.split(": ", 1) for line in (self.data_dir / "first-login.txt").read_text().splitlines()
        )
        return lines["username"], lines["password"]

    def interrupt(self, timeout_s: float = 60) -> int:
        """What Ctrl-C in the terminal does: SIGINT to the launcher."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout_s)
        finally:
            self.log.close()

    def stop(self) -> None:
        """Ctrl-C, and SIGKILL if that does not end it (its children die with it)."""
        if self.process.poll() is None:
            try:
                self.interrupt(timeout_s=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()
