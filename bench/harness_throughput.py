"""Harness throughput and overhead on the CPU: a 24-point rmsnorm sweep with all checks.

    .venv/bin/python bench/harness_throughput.py [--points 24] [--time-budget 1.0]

Each point of the `blocked` kernel's SPACE is materialised into a candidate file and
evaluated exactly as a worker does it: `python -m runners.harness evaluate rmsnorm FILE
--json` in a fresh process. Reports evaluations per minute and the overhead: wall time
of an evaluation over the time spent inside timed kernel calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runners import space  # noqa: E402
from runners.ops import get_op  # noqa: E402


def timed_kernel_ms(result: dict) -> float:
    """Time spent inside timed calls, every side included (medians × calls: a sample is
    a request of `calls_per_request` calls)."""
    total = 0.0
    for workload in result["workloads"]:
        samples = (workload.get("samples") or 0) * (workload.get("calls_per_request") or 1)
        sides = [workload.get("baseline_ms"), workload.get("candidate_ms")]
        sides += [workload.get("aa_baseline_ms")] if workload.get("aa_baseline_ms") else []
        total += samples * sum(ms for ms in sides if ms)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=24)
    parser.add_argument("--time-budget", type=float, default=1.0)
    parser.add_argument("--kernel", default="blocked")
    args = parser.parse_args()

    source = get_op("rmsnorm").kernels()[args.kernel].read_text()
    points = space.grid_points(space.read_literals(source)[1])[: args.points]
    if len(points) < args.points:
        sys.exit(f"the {args.kernel} kernel has only {len(points)} points")

    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for number, point in enumerate(points, start=1):
            path = Path(scratch) / f"candidate_{number}.py"
            path.write_text(space.materialize(source, point))
            began = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm", str(path),
                 "--json", "--time-budget", str(args.time_budget)],
                cwd=ROOT, capture_output=True, text=True, check=True,
            )
            wall_s = time.monotonic() - began
            result = json.loads(done.stdout)
            rows.append((wall_s, timed_kernel_ms(result) / 1000, result["verdict"]))
            print(f"{number:3d} {wall_s:6.2f} s  verdict {result['verdict']:8s} {point}", file=sys.stderr)
    total_s = time.monotonic() - started

    walls = [wall for wall, _, _ in rows]
    overheads = [wall / timed for wall, timed, _ in rows if timed > 0]
    verdicts = [verdict for _, _, verdict in rows]
    print(f"rmsnorm/{args.kernel}: {len(rows)} candidates in {total_s:.1f} s "
          f"({60 * len(rows) / total_s:.1f} evaluations per minute); time budget {args.time_budget} s per workload")
    print(f"wall per evaluation: median {statistics.median(walls):.2f} s, max {max(walls):.2f} s")
    if overheads:
        print(f"overhead (wall / time inside timed calls): median {statistics.median(overheads):.2f}x")
    print("verdicts: " + ", ".join(f"{v} {verdicts.count(v)}" for v in sorted(set(verdicts))))


if __name__ == "__main__":
    main()
