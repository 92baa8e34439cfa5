"""Writes the PTX of the shipped Triton indexer kernels for sm_90, one file per kernel, so
a change that should not change the generated code (moving shared code into
runners/kernel_lib) can be shown not to: run it before and after, then
`diff -r BEFORE AFTER`. Triton compiles for the target on the CPU; no GPU needed.

    python scripts/triton_ptx.py OUT_FOLDER [--tree ROOT]

`--tree` reads the kernels from another checkout of the project (say, `git archive` of
an earlier commit), importing that tree's runners/kernel_lib too. Each kernel is built at
the model's shapes (64 heads of 128, top-2048) with its shipped tiles.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

INDEXER = "runners.ops.dsa_indexer_topk.kernels"
# Scalars are int32 unless named here: the arguments of a pointer, by their element type.
BF16_INPUTS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32"}
MODEL = {"heads": 64, "dim": 128, "BLOCK_N": 128, "BLOCK_H": 32, "BLOCK_D": 128}
BF16 = {**MODEL, "PRECISION": "tf32", "UPCAST": False}
TOPK = {"KEEP": 2048, "LOG_KEEP": 11}
KERNELS = {
    "fused_logits": (f"{INDEXER}.fused_logits_triton", "_indexer_logits",
                     {**BF16_INPUTS, "out_ptr": "*fp32"}, {**BF16, "ROWS": 1}),
    "fused_logits_fp8": ("runners.ops.dsa_indexer_topk_fp8.kernels.fused_logits_fp8_triton", "_indexer_logits_fp8",
                         {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "w_ptr": "*fp32",
                          "out_ptr": "*fp32"}, {**MODEL, "BLOCK_H": 64, "ROWS": 1}),
    "partial_span_topk": (f"{INDEXER}.partial_topk_triton", "_span_topk",
                          {**BF16_INPUTS, "pending_ptr": "*i64", "partial_ptr": "*i64"},
                          {**BF16, **TOPK, "SPAN_TILES": 16}),
    "pipelined_step": (f"{INDEXER}.pipelined_topk_triton", "_pipeline_step",
                       {**BF16_INPUTS, "out_ptr": "*i64", "best_in": "*i64", "best_out": "*i64", "found_in": "*i32",
                        "found_out": "*i32", "pending_in": "*i64", "pending_out": "*i64"},
                       {**BF16, **TOPK, "CAPACITY": 32768}),
    "radix_scores": (f"{INDEXER}.radix_topk_triton", "_scores_and_histogram",
                     {**BF16_INPUTS, "scores_ptr": "*fp32", "hist_ptr": "*i32"}, BF16),
    "radix_refine": (f"{INDEXER}.radix_topk_triton", "_refine",
                     {"scores_ptr": "*fp32", "state_ptr": "*i32", "boundary_ptr": "*i32", "out_ptr": "*i64"},
                     {"CHUNKS": 64}),
}


def arguments() -> argparse.Namespace:
    """OUT and --tree (this checkout by default), with the tree first on sys.path, so its
    runners package is the one imported, and OUT created."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> int:
    args = arguments()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for label, (module, name, pointers, constants) in KERNELS.items():
        kernel = getattr(importlib.import_module(module), name)
        names = list(inspect.signature(kernel.fn).parameters)
        signature = {arg: "constexpr" if arg in constants else pointers.get(arg, "i32") for arg in names}
        source = ASTSource(kernel, signature, {(names.index(arg),): value for arg, value in constants.items()})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        # Source locations, the debug sections and the labels that mark where an inlined
        # call begins and ends name files, lines and calls, which moving code changes;
        # they are not the code (branch targets, $L__BB…, stay).
        ptx = ptx.split(".section\t.debug")[0]
        ptx = re.sub(r"^(\s*(\.loc|\.file|//).*|\$L__tmp\d+:)\n", "", ptx, flags=re.M)
        (args.out / f"{label}.ptx").write_text(ptx)
        print(f"{label}: {len(ptx.splitlines())} lines", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
