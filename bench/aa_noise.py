"""How far a candidate lands from the baseline by process luck alone: A/A evaluations.

    python3 bench/aa_noise.py rmsnorm --device cpu --runs 40 --ctx 64 [--time-budget 0.1]
        [--out aa.jsonl]

Runs `evaluate OP baseline` --runs times, each with its own secret seed and its own
processes, so the "candidate" is the baseline too, and reports over every workload of
every run: the candidate's effect against the two pooled baseline processes
(|log speedup|, in percent), the A/A pair's own effect, how many workloads came out
significant either way, and the verdicts. No run may be a win; the largest effect seen
is what the device's minimum noise floor (runners/harness/stats.py) must stay above.

Needs only the harness's dependencies (torch, numpy): it runs on a bare GPU host.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from runners.harness import evaluate  # noqa: E402
from runners.harness.stats import MIN_NOISE_FLOOR  # noqa: E402


def percentiles(values: list[float]) -> str:
    p50, p90, p99 = (float(np.percentile(values, q)) for q in (50, 90, 99))
    return f"p50 {p50:.2f}%  p90 {p90:.2f}%  p99 {p99:.2f}%  max {max(values):.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--ctx", help="context lengths, e.g. 64,4096 (default: the op's)")
    parser.add_argument("--time-budget", type=float, default=0.1)
    parser.add_argument("--out", type=Path, help="one JSON line per run")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    contexts = [int(c) for c in args.ctx.split(",")] if args.ctx else None
    effects, pair_effects, verdicts, faster, slower, floors = [], [], [], 0, 0, []
    started = time.monotonic()
    out = args.out.open("w") if args.out else None
    for run in range(args.runs):
        result = evaluate(args.op, "baseline", device=args.device, context_lengths=contexts,
                          time_budget_s=args.time_budget)
        verdicts.append(result.verdict)
        rows = []
        for workload in result.workloads:
            if workload.speedup is None:
                continue
            effects.append(100 * abs(math.log(workload.speedup)))
            pair_effects.append(100 * abs(math.log(workload.aa_speedup)))
            floors.append(100 * workload.noise_floor)
            faster += workload.significant and workload.speedup > 1
            slower += workload.significant and workload.speedup < 1
            rows.append({"name": workload.name, "speedup": workload.speedup,
                         "aa_speedup": workload.aa_speedup, "noise_floor": workload.noise_floor,
                         "significant": workload.significant, "p_value": workload.p_value,
                         "samples": workload.samples})
        if out:
            out.write(json.dumps({"run": run + 1, "verdict": result.verdict, "seed": result.seed,
                                  "duration_s": result.duration_s, "workloads": rows}) + "\n")
            out.flush()
        print(f"run {run + 1}/{args.runs}: {result.verdict}", file=sys.stderr, flush=True)
    if not effects:
        sys.exit("no workload was timed: every run was rejected")
    tally = ", ".join(f"{verdicts.count(v)} {v}" for v in ("win", "no-gain", "rejected") if v in verdicts)
    print(f"{args.op} on {args.device}: {args.runs} A/A runs, {len(effects)} workloads, "
          f"{time.monotonic() - started:.0f} s")
    print(f"  verdicts: {tally}")
    print(f"  significant: {faster} faster, {slower} slower")
    print(f"  candidate vs pooled baselines |effect|: {percentiles(effects)}")
    print(f"  A/A pair |effect|:                      {percentiles(pair_effects)}")
    print(f"  noise floor applied: median {float(np.median(floors)):.2f}% "
          f"(never under {100 * MIN_NOISE_FLOOR[args.device]:g}% on {args.device})")


if __name__ == "__main__":
    main()
