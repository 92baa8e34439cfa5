"""The lightning-indexer logits with a per-span partial top-k, then a merge of the spans.

Each row's context is cut into SPLITS spans, one program per (row, span). A program
scores its span tile by tile (the fused logits of fused_logits_triton.py) and keeps
only that span's best `topk` positions, so the [M, N] scores never reach memory: the
program holds a sorted running top-k and a buffer of pending candidates, each topk
long, in a slot of its own (L1/L2-resident). A new score enters the buffer only if it
beats the running k-th best, which after the first few thousand tokens almost nothing
does; when the buffer would overflow it is sorted and merged into the running top-k
(bitonic), which raises the bar again. A second kernel merges each row's sorted lists
into the final top-k.

Scores are compared as one int64 per position: the score's order-preserving integer
key in the high half, the position (inverted, so lower positions win ties) in the
low half. All keys of a row differ, so the top-k is one set whatever the order the
work ran in, ties at the boundary included, and the output is its positions sorted
by score: the same inputs always give the same output.

- BLOCK_N: context tokens per tile (the N side of each head-block matmul).
- BLOCK_H: heads per matmul; the head loop steps by it.
- SPLITS: spans per row (fewer where a span would be shorter than topk). Rows × SPLITS
  programs must fill the GPU: at 8 warps a program needs 128 registers, so an H200 SM
  holds two, and 64 rows × 4 spans is one wave on its 132 SMs. More spans cost more
  merging: every span's first topk scores all enter its list, and the final merge
  reads SPLITS lists per row.
- num_warps, num_stages: warps per program and software-pipelining depth of the
  head loop's loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runners.kernel_lib.topk_triton import (
    INTERPRETED, LOWEST, candidate_keys, candidate_positions, dot_precision, key_tile, merge_block,
    merge_descending, row_scores,
)

PARAMS = {
    "BLOCK_N": 128,
    "BLOCK_H": 32,
    "SPLITS": 4,
    "num_warps": 8,
    "num_stages": 2,
}

SPACE = {
    "BLOCK_N": [128],
    "BLOCK_H": [32],
    "num_stages": [2],
    "SPLITS": [4, 8, 16],
    "num_warps": [4, 8],
}


@triton.jit
def _absorb(best_ptr, pending_ptr, pending, lanes, topk, LOG_KEEP: tl.constexpr):
    """Merge the pending candidates into the running top-k (sorted, largest first);
    returns its new k-th best."""
    # Other threads of the program wrote the candidates and the list: make them
    # visible, and have everyone read before either is written again.
    tl.debug_barrier()
    block = tl.load(pending_ptr + lanes, mask=lanes < pending, other=LOWEST)
    best = tl.load(best_ptr + lanes)
    tl.debug_barrier()
    best = merge_block(best, block, LOG_KEEP)
    tl.store(best_ptr + lanes, best)
    return tl.sum(tl.where(lanes == topk - 1, best, 0), axis=0)


@triton.jit
def _span_topk(
    q_ptr, k_ptr, w_ptr, pending_ptr, partial_ptr, context, topk,
    stride_qm, stride_qh, stride_kn, stride_wm,
    heads: tl.constexpr, dim: tl.constexpr, SPAN_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KEEP: tl.constexpr, LOG_KEEP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    row = tl.program_id(0)
    span = tl.program_id(1)
    slot = (row * tl.num_programs(1) + span).to(tl.int64) * KEEP
    pending_ptr += slot
    # The span's running top-k lives in its output slot, not in registers: carried
    # through the tile loop it takes 200 registers a thread instead of 128 (8 warps),
    # and an SM holds one program instead of two.
    best_ptr = partial_ptr + slot
    dims = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, KEEP)
    tl.store(best_ptr + lanes, tl.full([KEEP], LOWEST, tl.int64))
    # The running k-th best: nothing at or below it can make this span's top-k.
    floor = tl.full([], LOWEST, tl.int64)
    pending = 0
    # Tiles per span is a compile-time bound: Triton 3.6's interpreter cannot loop to
    # a runtime bound under numpy 2.
    for tile in range(SPAN_TILES):
        start = (span * SPAN_TILES + tile) * BLOCK_N
        if start < context:
            tokens = start + tl.arange(0, BLOCK_N)
            valid = tokens < context
            keys = key_tile(k_ptr, tokens, valid, dims, stride_kn, dim, UPCAST)
            scores = row_scores(q_ptr, w_ptr, row, keys, dims, stride_qm, stride_qh,
                                stride_wm, heads, dim, BLOCK_N, BLOCK_H, PRECISION, UPCAST)
            candidates = tl.where(valid, candidate_keys(scores, tokens), LOWEST)
            keep = candidates > floor
            kept = tl.sum(keep.to(tl.int32), axis=0)
            if pending + kept > KEEP:
                floor = _absorb(best_ptr, pending_ptr, pending, lanes, topk, LOG_KEEP)
                pending = tl.zeros_like(pending)
                keep = candidates > floor
                kept = tl.sum(keep.to(tl.int32), axis=0)
            slots = pending + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(pending_ptr + slots, candidates, mask=keep)
            pending += kept
    _absorb(best_ptr, pending_ptr, pending, lanes, topk, LOG_KEEP)


@triton.jit
def _merge_spans(partial_ptr, out_ptr, topk, stride_om, SPANS: tl.constexpr,
                 KEEP: tl.constexpr, LOG_KEEP: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, KEEP)
    first = partial_ptr + row.to(tl.int64) * SPANS * KEEP
    best = tl.load(first + lanes)
    for span in range(1, SPANS):
        # Each span's list is sorted largest first: read it backwards.
        ascending = tl.load(first + span * KEEP + (KEEP - 1 - lanes))
        best = merge_descending(tl.maximum(best, ascending), LOG_KEEP)
    tl.store(out_ptr + row * stride_om + lanes, candidate_positions(best), mask=lanes < topk)


def forward(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    # The kernel indexes the head dimension with unit stride.
    q, k, weights = q.contiguous(), k.contiguous(), weights.contiguous()
    rows, heads, dim = q.shape
    context = k.shape[0]
    block_n = PARAMS["BLOCK_N"]
    # The running top-k is a power of two for the bitonic merges, and at least a tile
    # so that one tile's candidates always fit the pending buffer.
    keep = max(triton.next_power_of_2(topk), block_n)
    tiles = triton.cdiv(context, block_n)
    # A span no longer than the list it keeps would keep every token it scores.
    span_tiles = max(triton.cdiv(tiles, PARAMS["SPLITS"]), keep // block_n)
    spans = triton.cdiv(tiles, span_tiles)
    pending = torch.empty(rows, spans, keep, dtype=torch.int64, device=q.device)
    partial = torch.empty(rows, spans, keep, dtype=torch.int64, device=q.device)
    out = torch.empty(rows, topk, dtype=torch.int64, device=q.device)
    _span_topk[(rows, spans)](
        q, k, weights, pending, partial, context, topk,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0),
        heads=heads, dim=dim, SPAN_TILES=span_tiles, BLOCK_N=block_n,
        BLOCK_H=PARAMS["BLOCK_H"], BLOCK_D=triton.next_power_of_2(dim),
        KEEP=keep, LOG_KEEP=keep.bit_length() - 1,
        PRECISION=dot_precision(q.dtype), UPCAST=INTERPRETED,
        num_warps=PARAMS["num_warps"], num_stages=PARAMS["num_stages"],
    )
    _merge_spans[(rows,)](
        partial, out, topk, out.stride(0), SPANS=spans, KEEP=keep,
        LOG_KEEP=keep.bit_length() - 1, num_warps=PARAMS["num_warps"],
    )
    return out
