"""Live delivery under load: websocket clients follow one sweep that produces events at a fixed rate.

    .venv/bin/python bench/live_load.py [--clients 50] [--rate 20] [--seconds 60] [--web-processes N]

Everything runs on loopback against real servers this script starts (bench/_common.py):
Daphne serving config.asgi:application, the channel layer on Redis (REDIS_URL, or an
embedded one) and a fresh database (a new one on DATABASE_URL's server, or SQLite in a
temporary directory). Each client is a user of its own with a real login session: it
connects to /ws/sweeps/<id>/ from the app's origin, sends {"after": <last seq>} and, like
the sweep page, connects again when the server ends its socket; it notes when each frame
arrives. Meanwhile this process claims and records candidates through the services
workers call (each call commits one event, whose frame carries rendered HTML), paced to
--rate, and notes when each event committed. Delivery latency is arrival minus commit,
both on this process's time.perf_counter.

Exits 1 when any client lost (had not received 30 s after the last commit), duplicated or
reordered an event, naming which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidHandshake  # noqa: E402

from bench import _common  # noqa: E402

SETTLE_S = 1.0  # after every client subscribed, before the first event
DRAIN_TIMEOUT_S = 30.0  # the longest the clients may take to receive the last event
RECONNECT_DELAY_S = 0.25  # the sweep page's first retry


@dataclass
class Follower:
    """One browser tab on the sweep page: what it received and when. Like the page's
    script (static/js/sweep_live.js) it connects again when the server ends its socket,
    sending the last seq it saw; each such reconnection is noted."""

    number: int
    cookie: tuple[str, str]  # the session cookie's name and value
    base_url: str
    sweep_id: int
    arrivals: list[tuple[int, float]] = field(default_factory=list)  # (seq, perf_counter)
    highest: int = 0  # the last seq seen
    frame_bytes: int = 0
    reconnections: list[str] = field(default_factory=list)  # why the server ended each socket
    socket: ClientConnection | None = None
    done: bool = False

    async def subscribe(self) -> None:
        # The page's own origin and login: the app refuses anonymous and cross-origin sockets.
        self.socket = await connect(
            f"{self.base_url.replace('http', 'ws', 1)}/ws/sweeps/{self.sweep_id}/", origin=self.base_url,
            additional_headers={"Cookie": "=".join(self.cookie)})
        await self.socket.send(json.dumps({"after": self.highest}))

    async def follow(self) -> None:
        while True:
            try:
                async for message in self.socket:
                    arrived = time.perf_counter()  # before parsing: the frame is here
                    seq = json.loads(message)["seq"]
                    self.arrivals.append((seq, arrived))
                    self.highest = max(self.highest, seq)
                    self.frame_bytes += len(message)
                why = f"closed with {self.socket.close_code}"
            except ConnectionClosed as error:
                why = str(error)
            if self.done:
                return
            self.reconnections.append(why)
            await asyncio.sleep(RECONNECT_DELAY_S)
            if self.done:
                return
            try:
                await self.subscribe()
            except (OSError, InvalidHandshake) as error:  # what it misses from now on shows as lost
                self.reconnections.append(f"could not connect again: {error}")
                return

    async def close(self) -> None:
        self.done = True
        if self.socket:
            await self.socket.close()

    def faults(self, expected: range) -> dict[str, list[int]]:
        seen: set[int] = set()
        duplicated, out_of_order = [], []
        highest = 0
        for seq, _ in self.arrivals:
            if seq in seen:
                duplicated.append(seq)
            elif seq < highest:
                out_of_order.append(seq)
            seen.add(seq)
            highest = max(highest, seq)
        return {"lost": sorted(set(expected) - seen), "duplicated": duplicated, "out of order": out_of_order}


class DroppedPushes(logging.Handler):
    """Counts the pushes the channel layer refused because Daphne's queue in Redis was full
    (channels_redis logs each); the consumer fills such gaps from the database."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        logger = logging.getLogger("channels_redis.core")
        logger.addHandler(self)
        logger.propagate = False  # counted here instead of a log line per push

    def emit(self, record: logging.LogRecord) -> None:
        if "over capacity" in record.getMessage():
            self.count += 1


class Producer:
    """A worker's side of a sweep, paced: claims and records candidates through the
    services, one committed event per call, and notes each event's commit time by seq."""

    def __init__(self, sweep, rate: float, events: int) -> None:
        from research import selectors

        self.sweep = sweep
        self.rate = rate
        self.events = events
        self.workloads = selectors.sweep_workload_names(sweep)
        self.committed: dict[int, float] = {}
        self.stop = threading.Event()

    def observe_commits(self) -> None:
        """Note each event's commit time, then publish it as always. The services publish
        from their on_commit hook, so the hook's start is the commit."""
        from research import events

        publish = events.publish_sweep_event

        def noted_then_published(message: dict) -> None:
            self.committed[message["seq"]] = time.perf_counter()
            publish(message)

        events.publish_sweep_event = noted_then_published

    def run(self) -> float:
        """Produce until `events` events committed (or told to stop); returns the seconds it took."""
        from django.db import connection

        from research import candidates

        self.started = time.perf_counter()
        try:
            for candidate in self.sweep.candidates.order_by("number"):
                if not self._next_is_due():
                    break
                candidates.candidate_claim(candidate_id=candidate.pk)
                if not self._next_is_due():
                    break
                candidates.candidate_record_result(
                    candidate_id=candidate.pk, result=_common.synthetic_result(candidate.number, self.workloads))
            return time.perf_counter() - self.started
        finally:
            connection.close()  # this thread's own: the database is dropped at the end

    def _next_is_due(self) -> bool:
        """Waits until the next event is due, so the events so far fill the rate exactly;
        False when there is nothing more to produce."""
        if len(self.committed) >= self.events or self.stop.is_set():
            return False
        time.sleep(max(0.0, self.started + len(self.committed) / self.rate - time.perf_counter()))
        return True


async def measure(server: _common.Server, followers: list[Follower],
                  producer: Producer) -> tuple[float, _common.CpuUse]:
    """Subscribes every follower, produces, and waits for the last event to reach them all:
    the seconds producing took, and the CPU used from the first event to the last arrival."""
    await asyncio.gather(*(f.subscribe() for f in followers))
    listening = [asyncio.create_task(f.follow()) for f in followers]
    await asyncio.sleep(SETTLE_S)
    try:
        clocks = _common.cpu_clocks(server)
        produce_s = await asyncio.to_thread(producer.run)
        last = max(producer.committed)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(f.highest < last for f in followers) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return produce_s, _common.cpu_use_since(clocks, server)
    finally:
        producer.stop.set()  # on Ctrl-C too: the thread must not outlive the run
        for follower in followers:
            await follower.close()
        await asyncio.gather(*listening)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rate", type=float, default=20.0, help="events per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    _common.add_web_processes_argument(parser)
    args = parser.parse_args()
    events = round(args.rate * args.seconds)

    with _common.app_environment() as servers:
        from django.contrib.auth import get_user_model

        _common.keep_evaluations_here()
        User = get_user_model()
        author = User.objects.create_user("author")
        # Each claim and each result is one event: half as many candidates, and a spare.
        sweep = _common.sweep_of(author, events // 2 + 2)
        producer = Producer(sweep, args.rate, events)
        producer.observe_commits()
        dropped = DroppedPushes()
        after = sweep.last_seq  # what a page opened now has seen
        with _common.daphne(processes=args.web_processes) as server:
            followers = [Follower(n, _common.session_cookie(User.objects.create_user(f"watcher{n}")),
                                  server.url, sweep.pk, highest=after)
                         for n in range(1, args.clients + 1)]
            produce_s, cpu = asyncio.run(measure(server, followers, producer))
        failed = report(servers, args, after, producer, produce_s, cpu, dropped.count, followers)
        if failed or any(f.reconnections for f in followers):
            print(f"\nDaphne's log, less its access lines:\n{server.log_errors()}")
        return failed


def report(servers: str, args, after: int, producer: Producer, produce_s: float, cpu: _common.CpuUse,
           dropped: int, followers: list[Follower]) -> int:
    expected = range(after + 1, max(producer.committed) + 1)
    latencies = [(arrived - producer.committed[seq]) * 1000
                 for f in followers for seq, arrived in f.arrivals if seq in producer.committed]
    print(f"{servers}; {args.web_processes} Daphne processes\n{args.clients} clients, {args.rate:g} events/s for {args.seconds:g} s")
    print("| figure | value |\n|---|---|")
    commits = sorted(producer.committed.values())
    print(f"| events produced | {len(commits)} in {produce_s:.1f} s "
          f"({(len(commits) - 1) / max(commits[-1] - commits[0], 1e-9):.1f}/s) |")
    frames = sum(len(f.arrivals) for f in followers)
    print(f"| frames received | {frames} (mean {sum(f.frame_bytes for f in followers) / max(frames, 1) / 1024:.1f} KB, "
          "with their rendered HTML) |")
    if latencies:
        print(f"| delivery latency p50 / p99 / max (ms) | {_common.percentile(latencies, 50):.1f} / "
              f"{_common.percentile(latencies, 99):.1f} / {max(latencies):.1f} |")
    faults = [f.faults(expected) for f in followers]
    totals = " / ".join(str(sum(len(fault[kind]) for fault in faults))
                        for kind in ("lost", "duplicated", "out of order"))
    print(f"| lost / duplicated / out of order | {totals} |")
    print(f"| sockets the server ended (the client reconnected) | {sum(len(f.reconnections) for f in followers)} |")
    print(f"| pushes dropped by the channel layer, Daphne's queue full (gaps filled from the database) | {dropped} |")
    print(f"| CPU, share of one core from the first event to the last arrival | {cpu} |")
    print(f"| Daphne CPU per frame delivered (ms) | {cpu.daphne_s * 1000 / max(frames, 1):.2f} |")

    print("\n| client | frames | lost | duplicated | out of order | reconnections |\n|---|---|---|---|---|---|")
    for follower, fault in zip(followers, faults):
        print(f"| {follower.number} | {len(follower.arrivals)} | {len(fault['lost'])} | "
              f"{len(fault['duplicated'])} | {len(fault['out of order'])} | {len(follower.reconnections)} |")
    problems = [
        f"client {follower.number}: " + "; ".join(
            [f"{kind} seq {_seqs(seqs)}" for kind, seqs in fault.items() if seqs]
            + [f"the server ended its socket: {why}" for why in follower.reconnections])
        for follower, fault in zip(followers, faults) if any(fault.values())
    ]
    if problems:
        print(f"\nFAILED: not every client received every event once and in order "
              f"(within {DRAIN_TIMEOUT_S:g} s of the last one)", *problems, sep="\n")
        return 1
    print(f"\nEvery client received all {len(expected)} events once, in order.")
    return 0


def _seqs(seqs: list[int], shown: int = 10) -> str:
    return ", ".join(map(str, seqs[:shown])) + (f" and {len(seqs) - shown} more" if len(seqs) > shown else "")


if __name__ == "__main__":
    _common.run(main)
