"""Would the e4m3 indexer's head sums still pass the op's check with their inputs rounded
to e4m3? A CPU simulation on the op's own inputs and check, no GPU needed.

    python bench/head_sum_precision.py [--ctx 8192,32768] [--seed 11]

For each context, the op's reference scores (float32 of the FP8 values), and two
approximations of them, each then ranked by torch.topk and judged by the op's check:
- "bf16 (kept)": the kept REDUCE="mma" path, the ReLU'd per-head scores and the weights
  rounded to bfloat16, products summed in float32 (as the tensor cores do);
- "e4m3 scores": the ReLU'd per-head scores rounded to e4m3 (after a power-of-two
  scale that keeps the largest possible score in range; it is exact), the weights
  exact. An N=8 e4m3 wgmma takes 32 heads where a bfloat16 one takes 16: half the
  head-sum MMAs, if this passed.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from runners.ops import get_op

# The largest |q . k| of two 128-wide e4m3 rows is 448 * 448 * 128 < 2**25: scaled by
# 2**-16 it stays under e4m3's 448.
E4M3_SCALE = 2.0**-16


def approximations(inputs: dict) -> dict[str, torch.Tensor]:
    q, k, weights = inputs["q"].float(), inputs["k"].float(), inputs["weights"]
    bf16 = torch.zeros(q.shape[0], k.shape[0])
    e4m3 = torch.zeros_like(bf16)
    for head in range(q.shape[1]):
        relu = torch.relu(q[:, head] @ k.T)
        column = weights[:, head:head + 1]
        bf16.addcmul_(relu.to(torch.bfloat16).float(), column.to(torch.bfloat16).float())
        e4m3.addcmul_((relu * E4M3_SCALE).to(torch.float8_e4m3fn).float() / E4M3_SCALE, column)
    scale = inputs["k_scale"]
    return {"bf16 (kept)": bf16 * scale, "e4m3 scores": e4m3 * scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", default="8192,32768")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    op = get_op("dsa_indexer_topk_fp8")
    print("| context | head-sum inputs | the op's check |")
    print("|---|---|---|")
    for context in (int(c) for c in args.ctx.split(",")):
        # The GPU workload (64 query rows), its inputs made on the CPU.
        workload = dataclasses.replace(op.workloads("cuda", [context], [64])[0], device="cpu")
        inputs = op.make_inputs(workload, args.seed, "normal")
        reference = op.reference(inputs)
        for label, scores in approximations(inputs).items():
            chosen = scores.topk(inputs["topk"], dim=1).indices
            ok, message = op.check(chosen, reference, inputs)
            print(f"| {context // 1024}K | {label} | {'pass' if ok else 'FAIL'}: {message} |", flush=True)


if __name__ == "__main__":
    main()
