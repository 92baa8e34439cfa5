"""The web processes borrow their PostgreSQL connections from a pool (config.settings,
config.asgi): each request used to open one, a backend forked and set up for it (3.5 ms
of the machine's CPU against 0.1 ms borrowed; docs/benchmarks.md). Each case runs in a
fresh interpreter, since settings are read once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent

# Five "requests" of a web process: each asks PostgreSQL which backend serves it, then
# closes its connection as Django does at a request's end.
BACKENDS = """
import json, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
import config.asgi
from django.db import connection
backends = []
for _ in range(5):
    with connection.cursor() as cursor:
        cursor.execute("select pg_backend_pid()")
        backends.append(cursor.fetchone()[0])
    connection.close()
print(json.dumps({"backends": backends, "options": connection.settings_dict["OPTIONS"],
                  "max_age": connection.settings_dict["CONN_MAX_AGE"]}))
"""

SETTINGS = """
import json, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
import django
django.setup()
from django.conf import settings
print(json.dumps({"options": settings.DATABASES["default"].get("OPTIONS", {}),
                  "max_age": settings.DATABASES["default"]["CONN_MAX_AGE"]}))
"""


def _postgres_url() -> str:
    """The suite's PostgreSQL server, its maintenance database: it always exists, and the
    cases only ask which backend serves them."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        url = "postgres://postgres@127.0.0.1:5432/postgres"
    return urlunsplit(urlsplit(url)._replace(path="/postgres"))


def _run(code: str, **env: str | None) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, value in env.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_web_process_serves_its_requests_from_pooled_backends():
    found = _run(BACKENDS, DATABASE_URL=_postgres_url(), DB_CONN_MAX_AGE=None, DB_POOL_MAX=None)
    assert found["max_age"] == 0 and found["options"]["pool"]["max_size"] == 8
    # Borrowed again, not opened: fewer backends than requests (the pool may have grown
    # a second connection while the first was being opened, so not always one).
    assert len(set(found["backends"])) < 5, found


def test_without_the_pool_each_request_of_a_web_process_gets_a_new_backend():
    # What the pool saves: the same five requests with it turned off.
    found = _run(BACKENDS, DATABASE_URL=_postgres_url(), DB_CONN_MAX_AGE=None, DB_POOL_MAX="0")
    assert "pool" not in found["options"]
    assert len(set(found["backends"])) == 5, found


def test_workers_keep_their_persistent_connections_and_sqlite_gets_no_pool():
    # Workers (no config.asgi) keep one connection for a minute, as before; a pool needs
    # CONN_MAX_AGE 0 (Django refuses both) and exists only for PostgreSQL.
    worker = _run(SETTINGS, DATABASE_URL=_postgres_url(), DB_CONN_MAX_AGE=None, DB_POOL_MAX=None)
    assert worker["max_age"] == 60 and "pool" not in worker["options"]
    sqlite = _run(SETTINGS, DATABASE_URL=None, DB_CONN_MAX_AGE="0", DB_POOL_MAX="8")
    assert "pool" not in sqlite["options"]
