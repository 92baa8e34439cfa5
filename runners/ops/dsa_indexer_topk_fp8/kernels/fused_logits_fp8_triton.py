"""The FP8 lightning-indexer logits in one Triton kernel, then torch's top-k.

dsa_indexer_topk's fused-logits kernel on FP8 operands: each program scores BLOCK_N
context tokens for ROWS query rows, loading the e4m3 key tile and its per-token scales
once and reusing them for every row and head. tl.dot multiplies the e4m3 tiles directly
(FP8 tensor cores on Hopper) into float32 logits; k's scale multiplies them before the
ReLU, then the weights (which carry q's scale) and the sum over heads stay in registers.
Only the [M, N] float32 scores reach memory. (Top-k stays in torch for now. The scale is
positive and shared by every head, so it could equally multiply each token's summed
score once, as DeepSeek's own FP8 indexer does.)

- BLOCK_N: context tokens per program (the N side of each head-block matmul).
- BLOCK_H: heads per matmul; the head loop steps by it.
- ROWS: query rows per program, each reusing the loaded key tile.
- num_warps, num_stages: warps per program and software-pipelining depth of the
  head loop's loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runners.kernel_lib.topk_triton import key_tile, row_scores

# The bf16 kernel's fastest point on an H200; not yet timed with FP8 operands.
PARAMS = {
    "BLOCK_N": 128,
    "BLOCK_H": 32,
    "ROWS": 1,
    "num_warps": 4,
    "num_stages": 2,
}

# BLOCK_H 64 is one 64-row FP8 wgmma per head block at DeepSeek's 64 heads.
SPACE = {
    "BLOCK_N": [64, 128],
    "BLOCK_H": [32, 64],
    "ROWS": [1, 2],
    "num_warps": [4],
    "num_stages": [2],
}


# Heads and head size are compile-time constants (the model fixes them), so the head
# loop has a static bound. Triton's CPU interpreter decodes e4m3 dot operands exactly
# (through float16), so unlike the bf16 kernel this one needs no widening there: the
# interpreter runs the same tl.dot on the same FP8 tiles.
@triton.jit
def _indexer_logits_fp8(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, out_ptr, rows, context,
    stride_qm, stride_qh, stride_kn, stride_wm, stride_om,
    heads: tl.constexpr, dim: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    tokens = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    token_ok = tokens < context
    keys = key_tile(k_ptr, tokens, token_ok, dims, stride_kn, dim, False)
    key_scale = tl.load(k_scale_ptr + tokens, mask=token_ok, other=0.0)
    for r in tl.static_range(ROWS):
        row = tl.program_id(0) * ROWS + r
        if row < rows:
            # The precision names how float32 operands are rounded: e4m3 ones, as here,
            # are multiplied as they are.
            scores = row_scores(q_ptr, w_ptr, row, keys, dims, stride_qm, stride_qh, stride_wm,
                                heads, dim, BLOCK_N, BLOCK_H, "tf32", False, key_scale)
            tl.store(out_ptr + row * stride_om + tokens, scores, mask=token_ok)


def forward(
    q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    # The kernel indexes the head dimension and the scales with unit stride.
    q, k, k_scale, weights = q.contiguous(), k.contiguous(), k_scale.contiguous(), weights.contiguous()
    rows, heads, dim = q.shape
    context = k.shape[0]
    scores = torch.empty(rows, context, dtype=torch.float32, device=q.device)
    block_n, rows_per_program = PARAMS["BLOCK_N"], PARAMS["ROWS"]
    grid = (triton.cdiv(rows, rows_per_program), triton.cdiv(context, block_n))
    _indexer_logits_fp8[grid](
        q, k, k_scale, weights, scores, rows, context,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), scores.stride(0),
        heads=heads, dim=dim, BLOCK_N=block_n, BLOCK_H=PARAMS["BLOCK_H"],
        BLOCK_D=triton.next_power_of_2(dim), ROWS=rows_per_program,
        num_warps=PARAMS["num_warps"], num_stages=PARAMS["num_stages"],
    )
    return scores.topk(topk, dim=1).indices
