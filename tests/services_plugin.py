"""Loaded before Django (pytest -p): points the suite at real servers.

With REDIS_URL set (CI: the machine's Redis) the suite uses that server, on its own
database number so it never shares queues with a running app; without it, the
embedded Redis the app itself would start.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

TEST_REDIS_DB = "14"


def _test_database_of(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{TEST_REDIS_DB}", parts.query, ""))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args) -> None:
    os.environ.setdefault("DATA_DIR", tempfile.mkdtemp(prefix="kernel-lab-test-"))
    if os.environ.get("REDIS_URL"):
        os.environ["REDIS_URL"] = _test_database_of(os.environ["REDIS_URL"])
    else:
        from config.embedded_redis import EmbeddedRedis

        server = EmbeddedRedis(Path(os.environ["DATA_DIR"]) / "redis")
        os.environ["REDIS_URL"] = server.start()
        atexit.register(server.stop)
    # Short timing budgets: the suite checks behaviour, bench/ measures speed.
    os.environ.setdefault("HARNESS_TIME_BUDGET_S", "0.1")
    # Connections opened in sync_to_async threads are closed after each call, so the
    # test database can be dropped at the end.
    os.environ.setdefault("DB_CONN_MAX_AGE", "0")

    import redis

    redis.Redis.from_url(os.environ["REDIS_URL"]).flushdb()
