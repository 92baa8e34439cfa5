"""The pages' own work: CPU time and queries per request of the dashboard, a sweep page,
its chart's JSON and a review page, in one process, without the network.

    .venv/bin/python bench/page_work.py [--results 200] [--repeats 8]

Runs against a throw-away test database of the configured backend (DATABASE_URL, or
SQLite by default) and the configured cache (Redis when REDIS_URL is set, as the
servers use it), filled as bench/page_load.py fills its own: a sweep of --results
recorded candidates and a win waiting for review. Each page is asked for once to warm up
(templates compiled, fragments drawn into the cache), then --repeats times; reported is
the median CPU time of this process per request (time.process_time: the load of other
work on the machine changes it far less than wall time; git processes a page starts are
not counted) and the queries of one more request.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
# A data directory of this run's own (SQLite's test database, the kernel workspace the
# review page's win is committed in), removed at the end: never an installation's files.
_DATA = tempfile.mkdtemp(prefix="kernel-lab-bench-")
atexit.register(shutil.rmtree, _DATA, True)
os.environ["DATA_DIR"] = _DATA
os.environ["KERNEL_WORKSPACE"] = str(Path(_DATA) / "workspace")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext, setup_test_environment  # noqa: E402
from django.urls import reverse  # noqa: E402

from bench import _common  # noqa: E402
from bench.page_load import reviewer  # noqa: E402
from research import events  # noqa: E402


def cpu_ms(client: Client, url: str, repeats: int) -> tuple[float, int, int]:
    """Median CPU ms per request, the queries of one more, and the response's size."""
    client.get(url)
    samples = []
    for _ in range(repeats):
        started = time.process_time()
        response = client.get(url)
        samples.append((time.process_time() - started) * 1000)
        assert response.status_code == 200, (url, response.status_code)
    with CaptureQueriesContext(connection) as queries:
        client.get(url)
    return statistics.median(samples), len(queries.captured_queries), len(response.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    events.publish_sweep_event = lambda message: None  # the events are stored either way
    _common.keep_evaluations_here()
    try:
        from tests.reviewing import create_waiting_win

        win = create_waiting_win()
        sweep = _common.sweep_with_results(get_user_model().objects.get(username="ada"), args.results)
        client = Client()
        client.force_login(reviewer("reviewer1"))
        pages = [("dashboard", reverse("dashboard")),
                 (f"sweep page ({args.results} results)", sweep.get_absolute_url()),
                 ("its chart (JSON)", reverse("sweep_chart", args=[sweep.pk])),
                 ("review page (a win)", reverse("candidate_review", args=[win]))]
        print(f"backend: {connection.vendor}; cache: {os.environ.get('REDIS_URL') and 'Redis' or 'in-process'}; "
              f"load average {os.getloadavg()[0]:.1f}; median of {args.repeats} requests")
        print("| page | CPU per request (ms) | queries | response (KB) |\n|---|---|---|---|")
        for name, url in pages:
            ms, queries, size = cpu_ms(client, url, args.repeats)
            print(f"| {name} | {ms:.1f} | {queries} | {size / 1024:.0f} |")
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
