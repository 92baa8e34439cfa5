"""Run one indexer kernel point's forward a few times at one context, for a profiler.

    python3 bench/h200/profile_indexer.py [--ops dsa_indexer_topk,dsa_indexer_topk_fp8]
        [--ctx 262144] [--calls 3] [--points '{"logits_topk_cute": {"ROWS": 2, ...}}'] [--seed 7]

Meant to run under Nsight Compute, e.g. the scores launch of each kernel, profiled
once after two warm calls:

    ncu --clock-control none -k regex:score --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats python3 bench/h200/profile_indexer.py --ops dsa_indexer_topk

The kernels are the CuTe indexers at the points kept on the H200 unless --points says
otherwise; inputs are the op's own (normal distribution, M=64, H=64, D=128, top-2048).
Needs torch and CuTe DSL (on PYTHONPATH) on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from indexer_targets import BF16_KEPT, FP8_KEPT, forward_of  # noqa: E402

from runners.ops import get_op  # noqa: E402

KERNELS = {"dsa_indexer_topk": "logits_topk_cute", "dsa_indexer_topk_fp8": "logits_topk_fp8_cute"}
KEPT = {"logits_topk_cute": BF16_KEPT, "logits_topk_fp8_cute": FP8_KEPT}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(KERNELS))
    parser.add_argument("--ctx", type=int, default=262144)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--points", type=json.loads, default={})
    parser.add_argument("--seed", type=int, default=7, help="the inputs' seed (indexer_targets uses 11)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="profile-indexer-"))
    for op_name in args.ops.split(","):
        op, kernel = get_op(op_name), KERNELS[op_name]
        point = args.points.get(kernel, KEPT[kernel])
        forward = forward_of(op, kernel, point, scratch, kernel)
        workload = op.workloads("cuda", [args.ctx], op.default_batch_sizes("cuda"))[0]
        inputs = op.make_inputs(workload, args.seed, "normal")
        for _ in range(args.calls):
            forward(*inputs.values())
        torch.cuda.synchronize()
        print(f"{op_name} {kernel} {point} ctx={args.ctx}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
