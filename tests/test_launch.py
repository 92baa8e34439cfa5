"""The quick start's launcher on a fresh data directory: embedded Redis, SQLite in WAL."""

from __future__ import annotations

import socket
import sqlite3
import time
import urllib.request

import pytest

from tests.app_process import AppProcess


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def app(tmp_path):
    process = AppProcess(tmp_path / "data")
    yield process
    process.stop()


def test_it_comes_up_on_the_embedded_defaults_and_stops_cleanly_on_ctrl_c(app):
    app.wait_until_up()
    output = app.output()
    assert "Embedded Redis on redis://127.0.0.1:" in output
    redis_port = int(output.split("Embedded Redis on redis://127.0.0.1:")[1].split("/")[0])
    assert _port_open(redis_port)
    assert "username: admin" in output and "password: " in output

    with sqlite3.connect(app.data_dir / "db.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with urllib.request.urlopen(f"{app.url}/static/plotly/plotly.min.js") as response:
        assert response.status == 200 and b"plotly" in response.read(4096).lower()
    with urllib.request.urlopen(f"{app.url}/static/django_htmx/htmx-2.min.js") as response:
        assert response.status == 200

    assert app.interrupt() == 0
    assert "Stopped." in app.output()
    assert not _port_open(app.port) and not _port_open(redis_port)


def test_killing_the_launcher_outright_takes_its_processes_with_it(app):
    app.wait_until_up()
    redis_port = int(app.output().split("Embedded Redis on redis://127.0.0.1:")[1].split("/")[0])
    app.process.kill()  # SIGKILL: no chance to stop its children itself
    app.process.wait()
    deadline = time.monotonic() + 30
    while (_port_open(app.port) or _port_open(redis_port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _port_open(app.port) and not _port_open(redis_port)
