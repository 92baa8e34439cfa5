"""Server time of the sweep page and its partial/JSON endpoints for a sweep of 2,000 results.

    .venv/bin/python bench/sweep_page.py [--results 2000] [--repeats 20]

Runs against a throw-away test database of the configured backend (DATABASE_URL, or
SQLite by default), filled through the same services the workers use, and reports the
median of `--repeats` requests per endpoint, measured inside the process (no network).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402
from django.urls import reverse  # noqa: E402

from bench import _common  # noqa: E402
from research import events  # noqa: E402


def fill(results: int):
    user = get_user_model().objects.create_user("bench", password="bench-only-password")
    return user, _common.sweep_with_results(user, results)


def median_ms(client: Client, url: str, repeats: int, **headers) -> tuple[float, int]:
    samples = []
    size = 0
    for _ in range(repeats):
        start = time.perf_counter()
        response = client.get(url, **headers)
        samples.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (url, response.status_code)
        size = len(response.content)
    return statistics.median(samples), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    # Publishing is irrelevant here and needs no Redis: the events are stored either way.
    events.publish_sweep_event = lambda message: None
    _common.keep_evaluations_here()
    try:
        started = time.perf_counter()
        user, sweep = fill(args.results)
        fill_s = time.perf_counter() - started
        client = Client()
        client.force_login(user)
        endpoints = [
            ("sweep page", sweep.get_absolute_url(), {}),
            ("results partial (htmx, after #1000)", reverse("sweep_results", args=[sweep.pk]) + "?after=1000",
             {"HTTP_HX_REQUEST": "true"}),
            ("events JSON (after seq 0, first 1,000)", reverse("sweep_events", args=[sweep.pk]) + "?after=0", {}),
            ("chart JSON (all points)", reverse("sweep_chart", args=[sweep.pk]), {}),
        ]
        print(f"backend: {connection.vendor}; {args.results} results filled in {fill_s:.1f} s; "
              f"median of {args.repeats} requests")
        print("| endpoint | median server time (ms) | response size (KB) |\n|---|---|---|")
        for name, url, headers in endpoints:
            ms, size = median_ms(client, url, args.repeats, **headers)
            print(f"| {name} | {ms:.1f} | {size / 1024:.0f} |")
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
