"""Harness throughput and overhead on the CPU: a 24-point rmsnorm sweep with all checks.

    .venv/bin/python bench/harness_throughput.py [--points 24] [--time-budget 1.0] [--beside DIR] [--sweep]

Each point of the `blocked` kernel's SPACE is materialised into a candidate file and
evaluated exactly as a worker does it: `python -m runners.harness evaluate rmsnorm FILE
--json` in a fresh process. Reports evaluations per minute and the overhead: wall time
of an evaluation over the time spent inside timed kernel calls.

`--sweep` runs the first POINTS points as one sweep instead, `python -m runners.harness
sweep rmsnorm blocked --budget POINTS`, as a GPU host runs one: one judge for every
candidate, one secret seed, the inputs and references it makes kept across them
(runners.harness.memo). The wall of the whole command counts, its start included.

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


def sweep_points(root: Path, kernel: str, points: int, time_budget: float) -> tuple[float, list[tuple[float, float, str]]]:
    """(wall seconds of the whole sweep command, a row per candidate as evaluate_point's)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "results.jsonl"
        began = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "runners.harness", "sweep", "rmsnorm", kernel, "--strategy", "grid",
             "--budget", str(points), "--time-budget", str(time_budget), "--out", str(out)],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, check=True,
        )
        wall = time.monotonic() - began
        lines = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    return wall, [(line["result"]["duration_s"], timed_kernel_ms(line["result"]) / 1000,
                   line["result"]["verdict"]) for line in lines]


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
    parser.add_argument("--sweep", action="store_true", help="one sweep command for all the points")
    args = parser.parse_args()
    if args.beside is not None and not (args.beside / "runners" / "harness").is_dir():
        sys.exit(f"--beside {args.beside}: no runners/harness there")

    source = get_op("rmsnorm").kernels()[args.kernel].read_text()
    points = space.grid_points(space.read_literals(source)[1])[: args.points]
    if len(points) < args.points:
        sys.exit(f"the {args.kernel} kernel has only {len(points)} points")

    roots = {"this tree": ROOT, **({f"beside ({args.beside})": args.beside.resolve()} if args.beside else {})}
    if args.sweep:
        started = time.monotonic()
        # Each tree's whole sweep, in turn: the second one sees what the first left behind.
        for label in reversed(roots) if args.beside else roots:
            wall, found = sweep_points(roots[label], args.kernel, args.points, args.time_budget)
            print(f"rmsnorm/{args.kernel} sweep ({label}): {len(found)} candidates in {wall:.1f} s, "
                  f"the command's start included: {60 * len(found) / wall:.2f} evaluations per minute")
            report(f"  its evaluations ({label})", found, args.time_budget)
        print(f"{time.monotonic() - started:.1f} s in all")
        return
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
