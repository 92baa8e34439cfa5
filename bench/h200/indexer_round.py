"""One round of the indexer search on a GPU lease: scout every point, then have the
harness evaluate the best ones in full.

    python3 bench/h200/indexer_round.py --out DIR [--kernels NAME,...] [--top 2]
        [--points-file points.jsonl] [--time-budget 0.5] [--deadline-s 540]

1. Scouting (bench/h200/indexer_points.py, unless --points-file gives its output): every
   SPACE point of the kernels, correct or not, and its CUDA-graph time per context.
2. For each kernel, its --top points by the geometric mean of their times at the two
   largest contexts (where the op's cost lies) are swept by the harness itself,
   `python -m runners.harness sweep OP KERNEL --strategy listed --points ...`: isolated
   processes, every guard, the A/A noise floor, the end-to-end check. The fastest
   kernels go first; a sweep that would not end before --deadline-s is not started.

Each sweep's results file (DIR/sweep_OP_KERNEL.jsonl) is what the app imports
(`manage.py import_results`); the scouting numbers only choose what to sweep.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH_KERNELS = {"baseline", "chunked_topk"}  # no search here: the torch references


def parse_point(label: str, space_keys: list[str], values: dict[str, list]) -> dict:
    """'BLOCK_N=128,SPLITS=8' back into typed values, by matching SPACE's own values."""
    point = {}
    for part in label.split(","):
        key, text = part.split("=", 1)
        matches = [value for value in values[key] if str(value) == text]
        if len(matches) != 1:
            raise ValueError(f"{label}: {key}={text} is not one value of SPACE")
        point[key] = matches[0]
    return {key: point[key] for key in space_keys}


def best_points(rows: list[dict], top: int) -> dict[tuple[str, str], list[tuple[float, str]]]:
    """(op, kernel) -> its `top` labels with their score (ms), fastest first."""
    contexts = sorted({row["context"] for row in rows if "context" in row})[-2:]
    times: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    for row in rows:
        if row["kernel"] in TORCH_KERNELS or "median_ms" not in row:
            continue
        times[(row["op"], row["kernel"], row["point"])][row["context"]] = row["median_ms"]
    ranked: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for (op, kernel, label), by_context in times.items():
        if all(context in by_context for context in contexts):
            score = math.exp(sum(math.log(by_context[c]) for c in contexts) / len(contexts))
            ranked[(op, kernel)].append((score, label))
    return {key: sorted(found)[:top] for key, found in ranked.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernels", help="only these kernels (names without .py)")
    parser.add_argument("--ops", default="dsa_indexer_topk,dsa_indexer_topk_fp8")
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--points-file", type=Path, help="scouting output to reuse")
    parser.add_argument("--time-budget", default="0.5")
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--scouting-s", type=float, default=270, help="the most the scouting may take")
    parser.add_argument("--per-candidate-s", type=float, default=90,
                        help="what one full evaluation is assumed to take until one was timed")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)

    points_file = args.points_file or args.out / "points.jsonl"
    if args.points_file is None:
        command = [sys.executable, str(ROOT / "bench/h200/indexer_points.py"), "--ops", args.ops,
                   "--out", str(points_file)] + (["--kernels", args.kernels] if args.kernels else [])
        with (args.out / "points.log").open("w") as log:
            try:
                scouted = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                                         timeout=args.scouting_s).stdout
            except subprocess.TimeoutExpired:  # the points written so far still count
                scouted = f"scouting stopped after {args.scouting_s:g} s\n"
        (args.out / "points.txt").write_text(scouted)
        print(scouted, flush=True)
    rows = [json.loads(line) for line in points_file.read_text().splitlines() if line.strip()]

    sys.path.insert(0, str(ROOT))
    from runners.ops import get_op
    from runners.space import read_literals

    chosen = best_points(rows, args.top)
    per_candidate = args.per_candidate_s
    report = []
    for (op_name, kernel), picks in sorted(chosen.items(), key=lambda item: item[1][0][0]):
        if args.kernels and kernel not in args.kernels.split(","):
            continue
        left = args.deadline_s - (time.monotonic() - started)
        if left < per_candidate * len(picks):
            report.append(f"{op_name} {kernel}: not swept ({left:.0f} s left)")
            continue
        space = read_literals(get_op(op_name).kernels()[kernel].read_text())[1]
        points = [parse_point(label, list(space), space) for _, label in picks]
        out = args.out / f"sweep_{op_name}_{kernel}.jsonl"
        command = [sys.executable, "-m", "runners.harness", "sweep", op_name, kernel, "--device", "cuda",
                   "--strategy", "listed", "--points", json.dumps(points),
                   "--time-budget", args.time_budget, "--out", str(out)]
        began = time.monotonic()
        with (args.out / f"sweep_{op_name}_{kernel}.log").open("w") as log:
            done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        per_candidate = max(per_candidate * 0.5, (time.monotonic() - began) / len(points))
        verdicts = []
        if out.exists():
            for line in out.read_text().splitlines()[1:]:
                entry = json.loads(line)
                result = entry["result"]
                speedups = " ".join(f"{w['speedup']:.2f}{'*' if w.get('significant') else ''}"
                                    for w in result.get("workloads", []) if w.get("speedup"))
                verdicts.append(f"{entry['params']} {result['verdict']} [{speedups}]")
        report.append(f"{op_name} {kernel}: exit {done.returncode}, {time.monotonic() - began:.0f} s; "
                      + "; ".join(verdicts))
    text = "\n".join(report)
    (args.out / "round.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
