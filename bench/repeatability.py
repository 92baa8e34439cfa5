"""How repeatable the harness's medians are: the same evaluation run several times.

    python3 bench/repeatability.py dsa_indexer_topk baseline \
        runners/ops/dsa_indexer_topk/kernels/chunked_topk.py --device cuda --repeats 3 --out DIR

Each candidate is evaluated `--repeats` times, each time by a fresh
`python -m runners.harness evaluate OP CANDIDATE --json` (so every run draws its own
secret seed, its own inputs and its own processes). Every JSON result and its progress
log are written under --out. The table gives, per workload, the median of each run and
the spread between runs: (largest - smallest) / mean of the runs' medians.

Needs only the harness's own dependencies (torch, numpy, scipy): it runs on a bare
GPU host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spread_pct(values: list[float]) -> float:
    """(max - min) / mean, in percent: the widest disagreement between repeated runs."""
    return 100.0 * (max(values) - min(values)) / statistics.fmean(values)


def evaluate(op: str, candidate: str, device: str, extra: list[str], log: Path) -> dict:
    command = [sys.executable, "-m", "runners.harness", "evaluate", op, candidate,
               "--device", device, "--json", *extra]
    with log.open("w") as stderr:
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}; see {log}")
    return json.loads(done.stdout)


def table(name: str, runs: list[dict]) -> list[str]:
    verdicts = ", ".join(run["verdict"] for run in runs)
    durations = ", ".join(f"{run['duration_s']:.0f} s" for run in runs)
    lines = [f"{name}: verdicts {verdicts}; {durations}"]
    failing = {guard["name"] for run in runs for guard in run["guards"] if guard["status"] != "pass"}
    if failing:
        lines.append(f"  guards not passing: {', '.join(sorted(failing))}")
    header = f"  {'workload':<22} {'baseline ms (runs)':<30} {'spread':>7}  {'candidate ms (runs)':<30} {'spread':>7}  speedups"
    lines.append(header)
    names = [workload["name"] for workload in runs[0]["workloads"]]
    for index, workload_name in enumerate(names):
        rows = [run["workloads"][index] for run in runs]
        base = [row["baseline_ms"] for row in rows if row["baseline_ms"]]
        cand = [row["candidate_ms"] for row in rows if row["candidate_ms"]]
        if len(base) < len(rows) or len(cand) < len(rows):
            lines.append(f"  {workload_name:<22} not timed in every run")
            continue
        speedups = " ".join(f"{row['speedup']:.3f}{'*' if row['significant'] else ''}" for row in rows)
        lines.append(
            f"  {workload_name:<22} {' '.join(f'{ms:.4g}' for ms in base):<30} {spread_pct(base):6.2f}%"
            f"  {' '.join(f'{ms:.4g}' for ms in cand):<30} {spread_pct(cand):6.2f}%  {speedups}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op")
    parser.add_argument("candidates", nargs="+", help="'baseline' or candidate files")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--time-budget", default="1.0")
    parser.add_argument("--ctx", help="context lengths, e.g. 4096,65536 (default: the op's)")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 to measure a spread")

    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--time-budget", args.time_budget] + (["--ctx", args.ctx] if args.ctx else [])
    report: list[str] = []
    for candidate in args.candidates:
        name = Path(candidate).stem
        runs = []
        for repeat in range(args.repeats):
            started = time.monotonic()
            result = evaluate(args.op, candidate, args.device, extra,
                              args.out / f"{name}.run{repeat + 1}.log")
            (args.out / f"{name}.run{repeat + 1}.json").write_text(json.dumps(result, indent=1))
            print(f"{name} run {repeat + 1}: {result['verdict']} in {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
            runs.append(result)
        report += table(name, runs)
    text = "\n".join(report)
    (args.out / "table.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
