"""How soon the harness rejects a bad candidate, and how long an honest Triton one takes on a CPU.

    .venv/bin/python bench/harness_cascade.py [--repeat 3] [--beside DIR] [--skip-triton]

Each candidate is evaluated as a worker does it (`python -m runners.harness evaluate
rmsnorm FILE --json` in a fresh process), and the wall time of that process is reported
with the verdict, the stage that stopped it and why:

- a candidate its source rejects (tests/candidates/rmsnorm_loosens_tolerance.py: a line
  that loosens a tolerance), stopped by the static checks;
- a candidate wrong at its first call (tests/candidates/rmsnorm_fake_result.py);
- an honest Triton kernel (the op's rows_triton.py), which the CPU runs in Triton's
  interpreter: judged on correctness only.

`--beside DIR` runs the same evaluations with the harness of another checkout too, in
turn with this tree's, so both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "static check fails": ("tests/candidates/rmsnorm_loosens_tolerance.py", "torch"),
    "first correctness call fails": ("tests/candidates/rmsnorm_fake_result.py", "torch"),
    "honest Triton (interpreted)": ("runners/ops/rmsnorm/kernels/rows_triton.py", "triton"),
}


def evaluate(root: Path, candidate: Path, dsl: str, timeout_s: float) -> dict:
    began = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm", str(candidate),
             "--dsl", dsl, "--json"],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True, text=True, check=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"wall_s": time.monotonic() - began, "verdict": f"not done in {timeout_s:g} s"}
    result = json.loads(done.stdout)
    failed = next((g for g in result["guards"] if g["status"] == "fail"), None)
    return {"wall_s": time.monotonic() - began, "verdict": result["verdict"],
            "inside_s": result.get("duration_s"),
            "stopped_at": result.get("stopped_at"),
            "why": failed["name"] if failed else None,
            "timed": any(w.get("baseline_ms") for w in result["workloads"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="evaluations of each rejected candidate")
    parser.add_argument("--beside", type=Path, help="another checkout whose harness runs them too")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--triton-timeout", type=float, default=900.0)
    args = parser.parse_args()
    roots = {"this tree": ROOT, **({"beside": args.beside.resolve()} if args.beside else {})}
    for case, (file, dsl) in CASES.items():
        if dsl == "triton" and args.skip_triton:
            continue
        repeat = 1 if dsl == "triton" else args.repeat
        for label, root in roots.items():
            found = [evaluate(root, ROOT / file, dsl, args.triton_timeout if dsl == "triton" else 600)
                     for _ in range(repeat)]
            walls = [row["wall_s"] for row in found]
            last = found[-1]
            print(f"{case:30s} {label:10s} wall median {statistics.median(walls):6.2f} s "
                  f"(min {min(walls):.2f}, max {max(walls):.2f}, n={len(walls)}; the last {last.get('inside_s')} s "
                  f"inside evaluate()); verdict {last['verdict']}, "
                  f"stopped at {last.get('stopped_at')}, failed guard {last.get('why')}, "
                  f"timed {last.get('timed')}", flush=True)


if __name__ == "__main__":
    main()
