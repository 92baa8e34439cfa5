"""The harness's own cost around a call, per device: what the clock check's margin rests on.

    python3 bench/harness_overhead.py [--op rmsnorm] [--ctx 64,4096] [--device cpu] [--runs 5]
                                      [--candidate FILE --dsl triton]

Runs the baseline against itself (an A/A evaluation, every process honest), or an
honest kernel against the baseline, several times and prints, per workload and run, how
much longer than their reported times the requests of the candidate's process and of the
two baseline processes took on the judge's clock (the request, the wake-up, the reply,
the stop; a request runs a batch of calls when they are short), and the difference: how
far apart two honest processes land. The clock check accepts a candidate whose calls take
up to a margin longer than the baselines' beyond the upper end of their CI
(runners/harness/measure.py); the check's own figure is printed beside its margin,
and in honest runs it must stay below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runners.harness import evaluate  # noqa: E402
from runners.harness.measure import EXCESS_FRACTION, EXCESS_MARGIN_MS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="rmsnorm")
    parser.add_argument("--ctx", default="64,4096")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=0.5)
    parser.add_argument("--candidate", default="baseline", help="an honest kernel file (default: A/A)")
    parser.add_argument("--dsl", default="torch", choices=["torch", "triton", "cute"])
    args = parser.parse_args()
    contexts = [int(part) for part in args.ctx.split(",")]
    rows, clock_failures = [], 0
    for run in range(args.runs):
        result = evaluate(args.op, args.candidate, device=args.device, context_lengths=contexts,
                          time_budget_s=args.time_budget, dsl=args.dsl)
        clock_failures += any(g.name == "clock" and g.status == "fail" for g in result.guards)
        for guard in result.guards:
            if guard.status == "fail":
                print(f"run {run + 1}: {guard.name} failed: {guard.detail}", file=sys.stderr)
        for workload in result.workloads:
            if workload.overhead_ms is None or workload.baseline_overhead_ms is None:
                continue
            rows.append((run + 1, workload.name, workload.samples, workload.calls_per_request,
                         workload.overhead_ms,
                         workload.baseline_overhead_ms,
                         workload.overhead_ms - workload.baseline_overhead_ms,
                         workload.clock_excess_ms, workload.clock_margin_ms))
    what = "A/A" if args.candidate == "baseline" else f"{Path(args.candidate).name} against the baseline"
    print(f"{args.op} on {args.device}, {what}, {args.runs} runs; margin the larger of "
          f"{EXCESS_MARGIN_MS[args.device]:g} ms and {EXCESS_FRACTION[args.device]:g} of the "
          "baselines' overhead")
    print("run | workload | samples | calls a request | candidate's process (ms) | baselines' (ms) "
          "| difference (ms) | clock check's excess (ms) | its margin (ms)")
    for run, name, samples, batch, candidate, baseline, difference, excess, margin in rows:
        print(f"{run} | {name} | {samples} | {batch} | {candidate:.4f} | {baseline:.4f} | {difference:+.4f} "
              f"| {excess:+.4f} | {margin:.4f}")
    largest = max((abs(row[6]) for row in rows), default=float("nan"))
    closest = max((row[7] - row[8] for row in rows), default=float("nan"))
    print(f"largest difference: {largest:.4f} ms; closest to failing: excess {closest:+.4f} ms "
          f"from its margin; clock failures in A/A runs: {clock_failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
