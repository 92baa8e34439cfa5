"""The load benchmarks still run: each script, at a tiny size, against the real servers it
starts (Daphne, Redis, a fresh database on the suite's DATABASE_URL/REDIS_URL or the
embedded defaults). No timing is asserted: the figures live in docs/benchmarks.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 120


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_live_load_delivers_every_event_to_every_client_once_and_in_order():
    output = _run("live_load.py", "--clients", "5", "--rate", "20", "--seconds", "3")
    assert "| events produced | 60 in" in output
    assert "| lost / duplicated / out of order | 0 / 0 / 0 |" in output
    assert "Every client received all 60 events once, in order." in output


def test_page_load_serves_every_page_with_its_server_timing():
    output = _run("page_load.py", "--users", "3", "--seconds", "3", "--results", "20")
    for page in ("| dashboard |", "| sweep page (20 results) |", "| review page (a win) |"):
        assert page in output
