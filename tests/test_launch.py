"""The quick start's launcher on a fresh data directory: embedded Redis, SQLite in WAL."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from django.conf import settings

from bench._common import post_mebibytes
from config import launcher_state
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


def test_killing_the_launcher_outright_takes_its_processes_with_it(app):
    app.wait_until_up()
    redis_port = int(app.output().split("Embedded Redis on redis://127.0.0.1:")[1].split("/")[0])
    app.process.kill()  # SIGKILL: no chance to stop its children itself
    app.process.wait()
    deadline = time.monotonic() + 30
    while (_port_open(app.port) or _port_open(redis_port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _port_open(app.port) and not _port_open(redis_port)


def test_the_embedded_redis_never_follows_a_link_planted_in_its_folder(tmp_path):
    """Its configuration (with the password), its log and its append-only files are
    written by name: links planted there once emptied the files they named, wrote the
    password into one and made them the owner's alone."""
    import stat

    import redis

    from config.embedded_redis import EmbeddedRedis

    victims = {name: tmp_path / f"victim-{name}" for name in ("conf", "log", "aof")}
    for victim in victims.values():
        victim.write_text("important content\n")
        victim.chmod(0o644)
    folder = tmp_path / "data" / "redis"
    (folder / "appendonlydir").mkdir(parents=True)
    (folder / "redis.conf").symlink_to(victims["conf"])
    (folder / "redis.log").symlink_to(victims["log"])
    (folder / "appendonlydir" / "appendonly.aof.1.incr.aof").symlink_to(victims["aof"])
    server = EmbeddedRedis(folder)
    url = server.start()
    try:
        assert redis.Redis.from_url(url).ping()
    finally:
        server.stop()
    for victim in victims.values():
        assert victim.read_text() == "important content\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not (folder / "redis.conf").is_symlink() and server.password in (folder / "redis.conf").read_text()
    assert not any(path.is_symlink() for path in folder.rglob("*"))

    # A link at the folder itself is removed and a folder of its own made in its place.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o755)
    folder_link = tmp_path / "data" / "linked"
    folder_link.symlink_to(elsewhere)
    again = EmbeddedRedis(folder_link)
    again.start()
    again.stop()
    assert not folder_link.is_symlink() and stat.S_IMODE(folder_link.stat().st_mode) == 0o700
    assert list(elsewhere.iterdir()) == [] and stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


def test_the_embedded_redis_asks_for_a_password_no_other_user_can_read(tmp_path):
    import stat

    import redis

    from config.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    try:
        assert redis.Redis.from_url(url).ping()
        # The port is reachable by anyone on the machine; without the password it answers nothing.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        redis.Redis.from_url(url).set("queued", "an evaluation")
        assert server.password not in open(f"/proc/{server.process.pid}/cmdline", "rb").read().decode()
        assert server.password not in server.address
        folder = tmp_path / "redis"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        made = [path for path in folder.rglob("*") if path.is_file()]
        assert {path.name for path in made} >= {"redis.conf", "redis.log"}
        assert all(stat.S_IMODE(path.stat().st_mode) & 0o077 == 0 for path in made), \
            {path.name: oct(path.stat().st_mode) for path in made}
    finally:
        server.stop()
    # A second start makes a new password; the old one no longer opens it.
    again = EmbeddedRedis(tmp_path / "redis", port=server.port)
    new_url = again.start()
    try:
        assert new_url != url and redis.Redis.from_url(new_url).get("queued") == b"an evaluation"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()
    finally:
        again.stop()


def test_a_launcher_that_is_gone_leaves_nothing_that_points_at_its_servers(tmp_path):
    launcher_state.write(tmp_path, site_url="http://127.0.0.1:8123", redis_url="redis://:pw@127.0.0.1:1/0")
    assert launcher_state.read(tmp_path)["site_url"] == "http://127.0.0.1:8123"  # this process wrote it
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    state = json.loads((tmp_path / launcher_state.FILE).read_text())
    (tmp_path / launcher_state.FILE).write_text(json.dumps({**state, "pid": int(gone.stdout)}))
    assert launcher_state.read(tmp_path) == {}
    (tmp_path / launcher_state.FILE).write_text("not json")
    assert launcher_state.read(tmp_path) == {}


def test_the_launchers_state_is_trusted_only_as_its_owners_private_file(tmp_path):
    path = launcher_state.write(tmp_path, site_url="http://127.0.0.1:8123", redis_url=None)
    assert path.stat().st_mode & 0o777 == 0o600 and launcher_state.read(tmp_path)
    path.chmod(0o644)  # readable by others: someone could have written it, and read the password
    assert launcher_state.read(tmp_path) == {}
    # A link planted at its name is replaced by the next write, never written through.
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    path.symlink_to(target)
    assert launcher_state.read(tmp_path) == {}
    launcher_state.write(tmp_path, site_url="http://127.0.0.1:8123", redis_url=None)
    assert target.read_text() == "keep me" and not path.is_symlink()
    # Removing it leaves another launcher's file alone.
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "pid": 1}))
    path.chmod(0o600)
    launcher_state.remove(tmp_path)
    assert path.exists()
