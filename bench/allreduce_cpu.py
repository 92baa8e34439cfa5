"""The one-shot all-reduce against gloo on this CPU, per message size: one harness run.

    python3 bench/allreduce_cpu.py [--sizes 4096,65536,1048576,4194304] [--time-budget 1.0]
        [--kernel shared_memory_one_shot]

Evaluates the op's kernel with the harness (`runners.harness.evaluate`, two ranks in one
jail, the baseline `torch.distributed.all_reduce` over gloo in another), so both sides'
times come from the judge's clock in one run, rounds alternating. Prints, per workload,
the median time per call of each with its 95% confidence interval, the speedup with
its interval, whether it is significant, each side's bandwidth (the message over the
time), the dispatch range the harness proposes, and the end-to-end tensor-parallel
decode step's line (its all-reduces between layers the kernel's against gloo's). The machine's load average is
printed before and after: other work on a shared machine moves both sides.

Needs only the harness's dependencies (torch, numpy): it runs on a bare host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runners.harness import evaluate  # noqa: E402
from runners.ops import get_op  # noqa: E402

OP = "allreduce_sum"


def _interval(ci: list[float] | None, digits: int) -> str:
    return f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "—"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="message sizes in bytes per rank (default: the op's for the CPU)")
    parser.add_argument("--time-budget", type=float, default=1.0, help="seconds of timing per workload")
    parser.add_argument("--kernel", default="shared_memory_one_shot", help="one of the op's kernels")
    args = parser.parse_args()
    op = get_op(OP)
    kernels = op.kernels()
    if args.kernel not in kernels:
        parser.error(f"{OP} has no kernel {args.kernel!r}: it has {', '.join(sorted(kernels))}")
    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        parser.error(f"--sizes must be integers separated by commas, not {args.sizes!r}")
    if args.time_budget <= 0:
        parser.error("--time-budget must be above 0")

    print(f"load average before: {_load()}  (cores: {os.cpu_count()})")
    started = time.monotonic()
    result = evaluate(OP, str(kernels[args.kernel]), device="cpu", context_lengths=sizes,
                      time_budget_s=args.time_budget)
    print(f"load average after:  {_load()}  ({time.monotonic() - started:.0f} s)")
    print(f"verdict: {result.verdict}  correct: {result.correct}")
    failed = [f"{g.name}: {g.detail}" for g in result.guards if g.status == "fail"]
    if failed or result.error:
        print("\n".join(failed) or result.error)
        sys.exit(1)

    print("| workload | gloo (ms, 95% CI) | one-shot (ms, 95% CI) | speedup (95% CI) | significant "
          "| gloo GB/s | one-shot GB/s |")
    print("|---|---|---|---|---|---|---|")
    for w in result.workloads:
        message = int(w.name.split(",")[0].removeprefix("bytes="))
        print(f"| {w.name} | {w.baseline_ms:.4f} {_interval(w.baseline_ci_ms, 4)} "
              f"| {w.candidate_ms:.4f} {_interval(w.candidate_ci_ms, 4)} "
              f"| {w.speedup:.2f} {_interval(w.speedup_ci, 2)} | {'yes' if w.significant else 'no'} "
              f"| {message / w.baseline_ms / 1e6:.3f} | {message / w.candidate_ms / 1e6:.3f} |")
    print(f"dispatch: {result.dispatch['summary'] if result.dispatch else 'none (no size won)'}")
    print("end to end: " + next(g.detail for g in result.guards if g.name == "e2e"))


if __name__ == "__main__":
    main()
