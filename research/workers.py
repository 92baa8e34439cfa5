"""Which queues a live Celery worker serves, so a page can say when no one will take a
sweep's candidates: a sweep of a hardware class this installation has no host for (the
form offers every class) otherwise stays "queued" without a word.

Workers are asked with Celery's broadcast `inspect().active_queues()`; the answer is
cached briefly, so a page waits for it at most once every CACHE_S seconds. A worker of
the quick start answers while it evaluates (its pool runs the task in a child process).
"""

from __future__ import annotations

from django.core.cache import cache

from config.celery import app

CACHE_KEY = "live-worker-queues"
CACHE_S = 30
# A broadcast waits its whole timeout for replies: long enough for a worker across a LAN,
# short enough that the page that asks (once every CACHE_S) hardly notices.
INSPECT_TIMEOUT_S = 0.25


def live_queues() -> frozenset[str] | None:
    """The queues some worker consumes now; None when the broker cannot be asked."""
    cached = cache.get(CACHE_KEY)
    if cached is not None:
        return frozenset(cached)
    try:
        replies = app.control.inspect(timeout=INSPECT_TIMEOUT_S).active_queues() or {}
    except Exception:  # noqa: BLE001 — a broker that is down: say nothing rather than fail the page
        return None
    queues = sorted({queue["name"] for consumed in replies.values() for queue in consumed})
    cache.set(CACHE_KEY, queues, CACHE_S)
    return frozenset(queues)


def start_command(queue: str) -> str:
    """How to start a worker for `queue` on a host of its class (docs/operations.md, "A GPU host as a worker")."""
    return f"celery -A config worker -Q {queue} --concurrency 1 --hostname {queue}@%h"
