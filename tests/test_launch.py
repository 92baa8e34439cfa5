"""The quick start's launcher on a fresh data directory: embedded Redis, SQLite in WAL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings

from bench._common import post_mebibytes
from config import launcher_state
from tests.app_process import ROOT, AppProcess


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
    password = (app.data_dir / "redis" / "redis.conf").read_text().split()[1]
    assert password not in output  # shown nowhere, the launcher's lines and the workers' banners alike
    redis_port = int(output.split("Embedded Redis on redis://127.0.0.1:")[1].split("/")[0])
    assert _port_open(redis_port)
    assert "username: admin" in output and "password: " in output

    with sqlite3.connect(app.data_dir / "db.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with urllib.request.urlopen(f"{app.url}/static/plotly/plotly.min.js") as response:
        assert response.status == 200 and b"plotly" in response.read(4096).lower()
    with urllib.request.urlopen(f"{app.url}/static/django_htmx/htmx-2.min.js") as response:
        assert response.status == 200

    # Daphne hands no body over the cap to Django: 413, before any view or parser reads it.
    too_large = urllib.request.Request(f"{app.url}/api/theses/1/results", data=b"x" * (settings.REQUEST_MAX_BYTES + 1),
                                       method="POST", headers={"Content-Type": "application/x-ndjson"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(too_large)
    assert refused.value.code == 413 and b"the most this server reads" in refused.value.read()
    # Far over it, declared or chunked: dropped as it arrives, then 413.
    assert post_mebibytes(app.url, 200, declared=True) == 413
    assert post_mebibytes(app.url, settings.REQUEST_MAX_BYTES // (1 << 20) + 2, declared=False) == 413
    # Under the cap, the app answers (here: the token is missing).
    assert post_mebibytes(app.url, 1, declared=True) == 401
    # Every page says where its scripts may come from.
    with urllib.request.urlopen(f"{app.url}/login/") as response:
        assert "script-src 'self'" in response.headers["Content-Security-Policy"]

    # Commands run by hand find this installation's Redis and site URL (its real port).
    state = app.data_dir / "launcher.json"
    assert state.stat().st_mode & 0o777 == 0o600
    assert launcher_state.read(app.data_dir)["site_url"] == app.url
    assert f"127.0.0.1:{redis_port}/0" in launcher_state.read(app.data_dir)["redis_url"]

    assert app.interrupt() == 0
    assert "Stopped." in app.output()
    assert not _port_open(app.port) and not _port_open(redis_port)
    assert not state.exists()


def _web_processes_of(launcher_pid: int) -> list[int]:
    """The launcher's Daphne children, from /proc: their parent and their command line."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher_pid and b"config.serve" in command:
            found.append(int(stat.parent.name))
    return found


def _get(url: str) -> int:
    # Generous: the launcher says "up" once one process answers, and on a busy machine the
    # other may still be starting when the first is stopped; its answer then waits for it.
    with urllib.request.urlopen(url, timeout=90) as response:
        return response.status


def test_several_web_processes_serve_one_port_and_any_one_of_them_answers(tmp_path):
    """WEB_PROCESSES Daphne processes share the port: with one of them stopped dead
    (SIGSTOP: it accepts nothing), every request is still answered, by the other."""
    app = AppProcess(tmp_path / "data", {"WEB_PROCESSES": "2"})
    try:
        app.wait_until_up()
        # The launcher says "up" after its own check that a process answers, a moment
        # after the first answer this test saw.
        deadline = time.monotonic() + 30
        while "Kernel Lab is up" not in app.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "(2 web processes;" in app.output()
        servers = _web_processes_of(app.process.pid)
        assert len(servers) == 2
        for frozen in servers:
            os.kill(frozen, signal.SIGSTOP)
            try:
                assert [_get(f"{app.url}/login/") for _ in range(6)] == [200] * 6
            finally:
                os.kill(frozen, signal.SIGCONT)
        assert app.interrupt() == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in servers)
    finally:
        app.stop()


def test_bad_web_process_counts_and_a_taken_port_are_refused_before_anything_starts(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
    env["DATA_DIR"] = str(tmp_path / "data")
    for count in ("0", "two", "-1"):
        refused = subprocess.run([sys.executable, "-m", "config.launch", "--web-processes", count], cwd=ROOT,
                                 env=env, capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 2 and f"1 or more, not '{count}'" in refused.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = subprocess.run([sys.executable, "-m", "config.launch", "--port", str(port)], cwd=ROOT,
                                 env=env, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and f"Cannot listen on 127.0.0.1:{port}: Address already in use" in refused.stderr
    assert not (tmp_path / "data").exists()  # nothing started, nothing written


def test_no_other_local_user_reads_the_database_the_quick_start_writes(app, tmp_path):
    app.wait_until_up()
    database = app.data_dir / "db.sqlite3"
    assert database.exists()
    # The WAL and shared-memory files exist while a connection is open.
    for path in [database, *app.data_dir.glob("db.sqlite3-*"), *(app.data_dir / "workspace").glob("*")]:
        assert path.stat().st_mode & 0o077 == 0, f"{path.name} is {oct(path.stat().st_mode)}"
    assert app.data_dir.stat().st_mode & 0o777 == 0o700
    # As the attack ran: another user (nobody) opens the file for its session keys.
    read = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         f"import sqlite3; sqlite3.connect('file:{database}?mode=ro', uri=True)"
         ".execute('select session_key from django_session').fetchall()"],
        capture_output=True, text=True, timeout=60, check=False)
    assert read.returncode != 0 and "unable to open database file" in read.stderr


def test_an_earlier_installs_world_readable_database_is_made_private(tmp_path):
    from config.private_files import private_data_dir

    folder = tmp_path / "data"
    folder.mkdir(mode=0o755)
    database = folder / "db.sqlite3"
    sqlite3.connect(database).execute("create table t (x)").connection.close()
    database.chmod(0o644)
    (folder / "db.sqlite3-wal").write_text("")
    (folder / "db.sqlite3-wal").chmod(0o644)
    planted = tmp_path / "elsewhere"
    planted.write_text("")
    planted.chmod(0o644)
    (folder / "db.sqlite3-shm").symlink_to(planted)

    private_data_dir(folder, database)

    assert folder.stat().st_mode & 0o777 == 0o700
    assert database.stat().st_mode & 0o777 == 0o600 and (folder / "db.sqlite3-wal").stat().st_mode & 0o777 == 0o600
    assert planted.stat().st_mode & 0o777 == 0o644  # a link at a name is never followed


def test_a_data_directory_another_user_made_first_is_refused():
    """Another user creates the folder (and an empty database) before the app does, in
    /tmp for instance: whatever mode the app gives them later, their maker can read and
    write them, session keys and all."""
    from config.private_files import NotOurs, private_data_dir

    shared = Path("/tmp") / f"kernel-lab-shared-{os.getpid()}"
    try:
        subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
                        f"umask 000; mkdir {shared} && touch {shared}/db.sqlite3"], check=True)
        assert shared.stat().st_uid == 65534 and shared.stat().st_mode & 0o777 == 0o777
        with pytest.raises(NotOurs, match="belongs to uid 65534"):
            private_data_dir(shared, shared / "db.sqlite3")
        env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
        refused = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT,
                                 env={**env, "DATA_DIR": str(shared)}, capture_output=True, text=True,
                                 timeout=120, check=False)
        assert refused.returncode != 0 and "belongs to uid 65534" in refused.stderr
        assert shared.stat().st_mode & 0o777 == 0o777  # refused, not half-fixed
    finally:
        shutil.rmtree(shared, ignore_errors=True)
