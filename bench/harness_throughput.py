"""Harness throughput and overhead on the CPU: a 24-point rmsnorm sweep with all checks.

    .venv/bin/python bench/harness_throughput.py [--points 24] [--time-budget 1.0] [--beside DIR]

Each point of the `blocked` kernel's SPACE is materialised into a candidate file and
evaluated exactly as a worker does it: `python -m runners.harness evaluate rmsnorm FILE
--json` in a fresh process. Reports evaluations per minute and the overhead: wall time
of an evaluation over the time spent inside timed kernel calls.

`--beside DIR` evaluates every point with the harness in DIR too (another checkout, e.g.
`git archive BASE | tar -x -C DIR`), the two in turn, each first on every other point,
so that both see the same load on a shared machine: their ratio is the figure to trust.
"""

from __future__ import annotations

import argparse
import json
import os
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


def evaluate_point(root: Path, path: Path, time_budget: float) -> tuple[float, float, str]:
    """(wall seconds, seconds inside timed calls, verdict) of one evaluation by the harness in `root`."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm", str(path),
         "--json", "--time-budget", str(time_budget)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, check=True,
    )
    result = json.loads(done.stdout)
    return time.monotonic() - began, timed_kernel_ms(result) / 1000, result["verdict"]


def report(label: str, rows: list[tuple[float, float, str]], time_budget: float) -> None:
    walls = [wall for wall, _, _ in rows]
    overheads = [wall / timed for wall, timed, _ in rows if timed > 0]
    verdicts = [verdict for _, _, verdict in rows]
    print(f"{label}: {len(rows)} candidates in {sum(walls):.1f} s of evaluations "
          f"({60 * len(rows) / sum(walls):.1f} evaluations per minute); time budget {time_budget} s per workload")
    print(f"  wall per evaluation: median {statistics.median(walls):.2f} s, max {max(walls):.2f} s")
    if overheads:
        print(f"  overhead (wall / time inside timed calls): median {statistics.median(overheads):.2f}x")
    print("  verdicts: " + ", ".join(f"{v} {verdicts.count(v)}" for v in sorted(set(verdicts))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=24)
    parser.add_argument("--time-budget", type=float, default=1.0)
    parser.add_argument("--kernel", default="blocked")
    parser.add_argument("--beside", type=Path, help="another checkout whose harness evaluates every point too")
    args = parser.parse_args()
    if args.beside is not None and not (args.beside / "runners" / "harness").is_dir():
        sys.exit(f"--beside {args.beside}: no runners/harness there")

    source = get_op("rmsnorm").kernels()[args.kernel].read_text()
    points = space.grid_points(space.read_literals(source)[1])[: args.points]
    if len(points) < args.points:
        sys.exit(f"the {args.kernel} kernel has only {len(points)} points")

    roots = {"this tree": ROOT, **({f"beside ({args.beside})": args.beside.resolve()} if args.beside else {})}
    rows: dict[str, list[tuple[float, float, str]]] = {label: [] for label in roots}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for number, point in enumerate(points, start=1):
            path = Path(scratch) / f"candidate_{number}.py"
            path.write_text(space.materialize(source, point))
            path.chmod(0o644)
            labels = list(roots) if number % 2 else list(reversed(roots))
            for label in labels:
                row = evaluate_point(roots[label], path, args.time_budget)
                rows[label].append(row)
                print(f"{number:3d} {label:12.12s} {row[0]:6.2f} s  verdict {row[2]:8s} {point}", file=sys.stderr)
    print(f"rmsnorm/{args.kernel}, {len(points)} points, {time.monotonic() - started:.1f} s in all")
    for label, found in rows.items():
        report(f"rmsnorm/{args.kernel} ({label})", found, args.time_budget)


if __name__ == "__main__":
    main()
