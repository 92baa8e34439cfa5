"""Pages under concurrent users: the dashboard, a sweep page and a review page, served by Daphne.

    .venv/bin/python bench/page_load.py [--users 20] [--seconds 60 | --requests N] [--results 200]
                                        [--web-processes N]

Everything runs on loopback against real servers this script starts, as bench/live_load.py
does (bench/_common.py): Daphne serving config.asgi:application (--web-processes
processes behind one port, by default one per usable core as the quick start runs it),
Redis and a fresh database. The database is filled through the services: a sweep of --results recorded
candidates, and a win of another sweep waiting for review (the review tests' data,
tests/reviewing.py). Each user is a thread with a requests.Session logged in as a
reviewer of its own (never the author, so the review page offers the decision): it
requests the three pages in turn (the sweep page followed by its chart's JSON, which the
browser fetches after it), each as soon as the last answered, for --seconds or
until --requests in all. Before that, one unmeasured request per page warms each up,
and one user alone requests each page a few times: its time without load.

Reports per page the p50 and p95 of the app's time (the Server-Timing header,
config/server_timing.py: from the outermost middleware, so it includes the wait for the
thread that runs views) and of the round trip the client saw. Exits 1 when a page
answers anything but 200.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests  # noqa: E402

from bench import _common  # noqa: E402

SERVER_TIMING = re.compile(r"\bapp;dur=([0-9.]+)")
ALONE_REPEATS = 5  # requests per page by one user alone, before the load: the unloaded time
REQUEST_TIMEOUT_S = 60


@dataclass
class Sample:
    page: str
    round_trip_ms: float
    app_ms: float
    size: int


class Budget:
    """The requests left to all users together: none left, or the time is up, ends a user."""

    def __init__(self, requests_in_all: int | None, seconds: float) -> None:
        self.left = requests_in_all
        self.deadline = time.monotonic() + seconds
        self.lock = threading.Lock()

    def take(self) -> bool:
        if time.monotonic() >= self.deadline:
            return False
        with self.lock:
            if self.left is None:
                return True
            self.left -= 1
            return self.left >= 0

    def end(self) -> None:
        self.deadline = 0.0


def get(http: requests.Session, url: str, page: str) -> Sample:
    started = time.perf_counter()
    response = http.get(url, allow_redirects=False, timeout=REQUEST_TIMEOUT_S)  # a redirect is the login page
    round_trip_ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{page} ({url}) answered {response.status_code}")
    timing = SERVER_TIMING.search(response.headers.get("Server-Timing", ""))
    if timing is None:
        raise RuntimeError(f"{page} ({url}) has no Server-Timing header")
    return Sample(page, round_trip_ms, float(timing.group(1)), len(response.content))


def user(session_cookie: tuple[str, str], pages: list[tuple[str, str]], first: int, budget: Budget,
         samples: list[Sample], errors: list[str]) -> None:
    with requests.Session() as http:
        http.cookies.set(*session_cookie)
        turn = first  # users start on different pages, so every page is asked for all along
        try:
            while budget.take():
                page, url = pages[turn % len(pages)]
                samples.append(get(http, url, page))
                turn += 1
        except Exception as error:  # the run goes on; the report says what went wrong
            errors.append(f"{type(error).__name__}: {error}")


def reviewer(name: str):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    person = get_user_model().objects.create_user(name)
    person.user_permissions.add(Permission.objects.get(codename="decide_candidate",
                                                       content_type__app_label="reviews"))
    return person


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--requests", type=int, default=None, help="stop after this many in all")
    parser.add_argument("--results", type=int, default=200, help="recorded candidates on the sweep page")
    _common.add_web_processes_argument(parser)
    args = parser.parse_args()

    with _common.app_environment() as servers:
        from django.contrib.auth import get_user_model
        from django.urls import reverse

        from tests.reviewing import create_waiting_win

        _common.keep_evaluations_here()
        win = create_waiting_win()  # a thesis by ada, a sweep started by bob, its candidate 1 a win
        sweep = _common.sweep_with_results(get_user_model().objects.get(username="ada"), args.results)
        cookies = [_common.session_cookie(reviewer(f"reviewer{n}")) for n in range(1, args.users + 1)]
        with _common.daphne(processes=args.web_processes) as server:
            # The sweep page's chart comes after it, from its JSON, as the browser asks for it.
            pages = [("dashboard", server.url + reverse("dashboard")),
                     (f"sweep page ({args.results} results)", server.url + sweep.get_absolute_url()),
                     ("its chart (JSON, after the page)", server.url + reverse("sweep_chart", args=[sweep.pk])),
                     ("review page (a win)", server.url + reverse("candidate_review", args=[win]))]
            with requests.Session() as http:
                http.cookies.set(*cookies[0])
                for page, url in pages:
                    get(http, url, page)  # the first request compiles templates, fills caches
                alone = {page: statistics.median(get(http, url, page).app_ms for _ in range(ALONE_REPEATS))
                         for page, url in pages}
            samples: list[Sample] = []
            errors: list[str] = []
            budget = Budget(args.requests, args.seconds)
            clocks = _common.cpu_clocks(server)
            users = [threading.Thread(target=user, args=(cookie, pages, n, budget, samples, errors), daemon=True)
                     for n, cookie in enumerate(cookies)]
            try:
                for thread in users:
                    thread.start()
                for thread in users:
                    thread.join()
            finally:
                budget.end()  # on Ctrl-C too: no user starts another request
            cpu = _common.cpu_use_since(clocks, server)
            if errors:  # what the server said about them
                server.show_log_errors()
        return report(servers, args, pages, alone, samples, errors, cpu)


def report(servers: str, args, pages, alone: dict[str, float], samples: list[Sample], errors: list[str],
           cpu: _common.CpuUse) -> int:
    print(f"{servers}; {args.web_processes} Daphne processes\n{args.users} users, {len(samples)} requests in {cpu.wall_s:.1f} s "
          f"({len(samples) / cpu.wall_s:.1f}/s); CPU, share of one core: {cpu}")
    print("| page | requests | app p50 (ms) | app p95 (ms) | round trip p50 (ms) | round trip p95 (ms) "
          "| app, one user alone (ms) | response (KB) |")
    print("|---|---|---|---|---|---|---|---|")
    for page, _ in pages:
        mine = [s for s in samples if s.page == page]
        if not mine:
            print(f"| {page} | 0 | | | | | {alone[page]:.1f} | |")
            continue
        app = [s.app_ms for s in mine]
        trip = [s.round_trip_ms for s in mine]
        print(f"| {page} | {len(mine)} | {_common.percentile(app, 50):.1f} | {_common.percentile(app, 95):.1f} "
              f"| {_common.percentile(trip, 50):.1f} | {_common.percentile(trip, 95):.1f} "
              f"| {alone[page]:.1f} | {mine[-1].size / 1024:.0f} |")
    if errors:
        print("\nFAILED:", *errors, sep="\n")
        return 1
    return 0


if __name__ == "__main__":
    _common.run(main)
