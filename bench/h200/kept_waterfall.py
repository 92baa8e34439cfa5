"""The "kernels compound" waterfall of the H200 class, measured on the H200 by the same
command a worker of runner.sm90 runs after each keep (reviews.compounding):

    python3 bench/h200/kept_waterfall.py [--out DIR] [--time-budget 10] [--loops LOOP,...]

The stages are the keeps bench/h200/indexer_loop.py makes on the H200 class, in the
order a team would make them: rmsnorm's Triton rows kernel, then per indexer op the
fused Triton kernel and then the CuTe DSL one (the kept kernels of
docs/benchmarks/h200-dsa-indexer.md); the paged loops, which nothing was kept for yet,
step with rmsnorm alone. Each loop is one
`python -m runners.harness compound` run on CUDA: every stage in a jailed child of its
own, timed in interleaved rounds, the first stage twice for the noise floor.

Needs the harness's dependencies and, for the CuTe stages, CuTe DSL on PYTHONPATH.
Writes each loop's stages file and report under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "runners" / "ops"


def _baseline(op: str) -> Path:
    return OPS / op / "baseline.py"


def _kernel(op: str, name: str) -> Path:
    return OPS / op / "kernels" / f"{name}.py"


def _stack(loop: str, steps: list[tuple[str, str, Path]]) -> dict:
    """The stages: the shipped baselines, then each (label, op, kernel) stacked on them."""
    kernels = {"rmsnorm": _baseline("rmsnorm"), loop: _baseline(loop)}
    stages = [{"label": "shipped baselines", "kernels": dict(kernels)}]
    for label, op, path in steps:
        kernels[op] = path
        stages.append({"label": label, "kernels": dict(kernels)})
    return {"loop": loop, "stages": [{"label": s["label"], "kernels": {op: str(p) for op, p in s["kernels"].items()}}
                                     for s in stages]}


ROWS = ("keep rmsnorm rows_triton", "rmsnorm", _kernel("rmsnorm", "rows_triton"))
LOOPS = {
    "dsa_indexer_topk": [ROWS,
                         ("keep dsa_indexer_topk fused_logits_triton", "dsa_indexer_topk",
                          _kernel("dsa_indexer_topk", "fused_logits_triton")),
                         ("keep dsa_indexer_topk logits_topk_cute", "dsa_indexer_topk",
                          _kernel("dsa_indexer_topk", "logits_topk_cute"))],
    "dsa_indexer_topk_fp8": [ROWS,
                             ("keep dsa_indexer_topk_fp8 fused_logits_fp8_triton", "dsa_indexer_topk_fp8",
                              _kernel("dsa_indexer_topk_fp8", "fused_logits_fp8_triton")),
                             ("keep dsa_indexer_topk_fp8 logits_topk_fp8_cute", "dsa_indexer_topk_fp8",
                              _kernel("dsa_indexer_topk_fp8", "logits_topk_fp8_cute"))],
    # Nothing is kept for the paged ops on the H200 yet: their loops step with rmsnorm
    # alone. (The shipped per_sequence_fp8 kernel cannot be a stage: it copies host
    # tensors inside the captured loop, which CUDA-graph capture refuses, 2026-12-05.)
    "dsa_indexer_topk_paged_fp8": [ROWS],
    "dsa_indexer_topk_paged": [ROWS],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/kept-waterfall"))
    parser.add_argument("--time-budget", type=float, default=10.0)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table = []
    for loop in args.loops.split(","):
        stages = args.out / f"{loop}.stages.json"
        stages.write_text(json.dumps(_stack(loop, LOOPS[loop]), indent=1))
        done = subprocess.run([sys.executable, "-m", "runners.harness", "compound", str(stages),
                               "--device", args.device, "--json", "--time-budget", str(args.time_budget)],
                              cwd=ROOT, capture_output=True, text=True, check=False)
        (args.out / f"{loop}.log").write_text(done.stderr)
        if done.returncode != 0:
            table.append(f"{loop}: failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
            continue
        (args.out / f"{loop}.json").write_text(done.stdout)
        report = json.loads(done.stdout)
        table.append(f"{loop} at ctx={report['context_length']}, batch {report['batch']}, "
                     f"{report['decode_steps']} steps a call; A/A floor {report['noise_floor_pct']:.2g}%; "
                     f"roofline {report['roofline_tokens_per_s'] or 0:,.0f} tokens/s; {report['duration_s']:.0f} s")
        for stage in report["stages"]:
            change = (f"{stage['speedup']:.3f}x [{stage['speedup_ci'][0]:.3f}, {stage['speedup_ci'][1]:.3f}]"
                      + (" significant" if stage["significant"] else "")) if "speedup" in stage else ""
            table.append(f"  {stage['tokens_per_s']:>10,.0f} tokens/s  {stage['ms']:.3f} ms  "
                         f"{stage['label']:<52} {change}")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
