"""A real Celery worker for end-to-end tests, and waiting on what it does.

The worker runs in this process (solo pool) against the real broker, on the queues a
CPU host serves, so a test exercises the path a deployment takes: no eager tasks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from celery.contrib.testing.worker import start_worker

from config.celery import app
from research.models import Sweep


@contextmanager
def cpu_worker() -> Iterator[None]:
    # A real worker imports the apps' task modules as it starts (the loader's init_worker);
    # this in-process one does not, and the services send tasks by name (research.queueing):
    # a task nothing had imported yet would be refused as unregistered.
    app.loader.import_default_modules()
    with start_worker(app, pool="solo", perform_ping_check=False, queues=["runner.cpu", "default", "webhooks"],
                      shutdown_timeout=30):
        yield


def wait_until_finished(sweep_id: int, *, timeout_s: float = 180) -> Sweep:
    """The sweep once it is finished, or as it stands when the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and Sweep.objects.get(pk=sweep_id).status != Sweep.Status.FINISHED:
        time.sleep(0.2)
    return Sweep.objects.get(pk=sweep_id)
