"""The lightning-indexer logits, then an exact radix selection of the top-k on the GPU.

torch.topk on [64, 256K] scores took ~40% of the shipped kernel's time on an H200.
Here the selection is a few short kernels with fixed-size outputs, no host
synchronisation and nothing but Triton launches (so it is captured in a CUDA graph):

1. Scores: the fused logits of fused_logits_triton.py write the [M, N] float32 scores,
   and each score also adds one to its row's histogram over the top 12 bits of its
   order-preserving integer key (sign, exponent, 3 mantissa bits; relaxed atomics).
2. Threshold: one program per row walks its histogram from the top to the bin that
   holds the topk-th score, the boundary bin.
3. Counts: per block of BLOCK_C tokens, how many scores fall above the boundary bin
   and how many in it.
4. Compaction: each block writes the positions above the boundary bin straight into
   the output, and those in it into a per-row list, both at offsets given by the
   counts of the blocks before it, so in position order.
5. Refinement: one program per row runs a radix selection over the boundary list only
   (the other 20 bits of the key in digits of 7, 7 and 6 bits, tl.histogram each) to
   the exact key of the topk-th score, then appends the boundary positions above it
   and, of those equal to it, the first ones by position until the row has topk.

Every position is written once and the order is fixed by position, never by which
program ran first: the same inputs always give the same output, ties at the boundary
included. The boundary list is short for real scores (a bin spans 1/8 of an octave);
when every score ties (all-zero q) it holds the whole row, which step 5 still handles,
slowly.

- BLOCK_N: context tokens per scoring program (the N side of each head-block matmul).
- BLOCK_H: heads per matmul; the head loop steps by it.
- BLOCK_C: tokens per counting and compaction program: 64 rows × 256K / 4096 is 4096
  programs of 16 KB of scores each; smaller blocks mean more programs and a longer
  prefix of earlier blocks' counts for each to sum.
- num_warps, num_stages: warps per scoring program and software-pipelining depth of the
  head loop's loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runners.kernel_lib.topk_triton import INTERPRETED, dot_precision, key_tile, row_scores

PARAMS = {
    "BLOCK_N": 128,
    "BLOCK_H": 32,
    "BLOCK_C": 4096,
    "num_warps": 4,
    "num_stages": 2,
}

# The scoring tiles are the shipped fused kernel's best on an H200; the sweep is over
# the selection's block and the warps.
SPACE = {
    "BLOCK_N": [128],
    "BLOCK_H": [32],
    "num_stages": [2],
    "BLOCK_C": [2048, 4096, 8192],
    "num_warps": [4, 8],
}

# The histogram of step 1: the top HIGH_BITS bits of each key, BINS bins per row.
HIGH_BITS = tl.constexpr(12)
BINS = tl.constexpr(4096)
# Boundary positions read per iteration of the refinement.
REFINE_BLOCK = tl.constexpr(1024)


@triton.jit
def _key(scores):
    """An int32 per score that orders like the score."""
    bits = scores.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their magnitude bits.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _bin(key):
    # The arithmetic shift leaves the top bits as a signed number in [-BINS/2, BINS/2).
    return (key >> (32 - HIGH_BITS)) + BINS // 2


@triton.jit
def _scores_and_histogram(
    q_ptr, k_ptr, w_ptr, scores_ptr, hist_ptr, context,
    stride_qm, stride_qh, stride_kn, stride_wm, stride_sm,
    heads: tl.constexpr, dim: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Consecutive programs score the same tokens for different rows: a key tile is
    # read from HBM once, and their histogram updates go to different rows.
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = tokens < context
    dims = tl.arange(0, BLOCK_D)
    keys = key_tile(k_ptr, tokens, valid, dims, stride_kn, dim, UPCAST)
    scores = row_scores(q_ptr, w_ptr, row, keys, dims, stride_qm, stride_qh, stride_wm,
                        heads, dim, BLOCK_N, BLOCK_H, PRECISION, UPCAST)
    tl.store(scores_ptr + row * stride_sm + tokens, scores, mask=valid)
    tl.atomic_add(hist_ptr + row * BINS + _bin(_key(scores)), 1, mask=valid, sem="relaxed")


@triton.jit
def _threshold_bin(hist_ptr, state_ptr, topk):
    """Per row: the boundary bin, the count above it and the count in it."""
    row = tl.program_id(0)
    # Highest bin first, so that a running sum counts the scores at or above each bin.
    bins = BINS - 1 - tl.arange(0, BINS)
    counts = tl.load(hist_ptr + row * BINS + bins)
    through = tl.cumsum(counts, axis=0)
    boundary = tl.max(tl.where(through >= topk, bins, -1), axis=0)
    tl.store(state_ptr + row * 4, boundary)
    tl.store(state_ptr + row * 4 + 1, tl.sum(tl.where(bins > boundary, counts, 0), axis=0))
    tl.store(state_ptr + row * 4 + 2, tl.sum(tl.where(bins == boundary, counts, 0), axis=0))


@triton.jit
def _block_bins(scores_ptr, state_ptr, context, stride_sm, BLOCK_C: tl.constexpr):
    """A block's positions, and which of them fall above and in the boundary bin."""
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    valid = tokens < context
    boundary = tl.load(state_ptr + row * 4)
    bins = _bin(_key(tl.load(scores_ptr + row * stride_sm + tokens, mask=valid, other=0.0)))
    return tokens, valid & (bins > boundary), valid & (bins == boundary)


@triton.jit
def _count_blocks(scores_ptr, state_ptr, counts_ptr, context, stride_sm,
                  BLOCK_C: tl.constexpr):
    _, above, inside = _block_bins(scores_ptr, state_ptr, context, stride_sm, BLOCK_C)
    slot = counts_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 2
    tl.store(slot, tl.sum(above.to(tl.int32), axis=0))
    tl.store(slot + 1, tl.sum(inside.to(tl.int32), axis=0))


@triton.jit
def _compact(scores_ptr, state_ptr, counts_ptr, out_ptr, boundary_ptr, context,
             stride_sm, stride_om, stride_bm, BLOCK_C: tl.constexpr, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    tokens, above, inside = _block_bins(scores_ptr, state_ptr, context, stride_sm, BLOCK_C)
    # This block's offsets: the counts of the blocks before it in the row.
    earlier = tl.arange(0, BLOCKS)
    before = earlier < block
    counts = counts_ptr + row * tl.num_programs(1) * 2 + earlier * 2
    above_before = tl.sum(tl.load(counts, mask=before, other=0), axis=0)
    inside_before = tl.sum(tl.load(counts + 1, mask=before, other=0), axis=0)
    slots = above_before + tl.cumsum(above.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_om + slots, tokens.to(tl.int64), mask=above)
    slots = inside_before + tl.cumsum(inside.to(tl.int32), axis=0) - 1
    tl.store(boundary_ptr + row * stride_bm + slots, tokens, mask=inside)


@triton.jit
def _boundary_chunk(scores_row, boundary_row, start, lanes, inside):
    """The boundary list's positions from `start`: which lanes hold one, the positions,
    and their scores' keys."""
    ok = start + lanes < inside
    tokens = tl.load(boundary_row + start + lanes, mask=ok, other=0)
    return ok, tokens, _key(tl.load(scores_row + tokens, mask=ok, other=0.0))


@triton.jit
def _refine_digit(scores_row, boundary_row, inside, prefix, need,
                  SHIFT: tl.constexpr, BITS: tl.constexpr, CHUNKS: tl.constexpr):
    """Among the boundary scores whose key's bits above SHIFT + BITS equal `prefix`,
    the BITS bits below of the need-th largest: returns the longer prefix and how
    many with it are still needed."""
    lanes = tl.arange(0, REFINE_BLOCK)
    digits = tl.arange(0, 1 << BITS)
    counts = tl.zeros([1 << BITS], dtype=tl.int32)
    # A compile-time bound (the context) with a runtime test: Triton 3.6's
    # interpreter cannot loop to a runtime bound under numpy 2.
    for chunk in range(CHUNKS):
        start = chunk * REFINE_BLOCK
        if start < inside:
            ok, _, keys = _boundary_chunk(scores_row, boundary_row, start, lanes, inside)
            match = ok & ((keys >> (SHIFT + BITS)) == prefix)
            digit = tl.where(match, (keys >> SHIFT) & ((1 << BITS) - 1), 0)
            # tl.histogram counts every lane: the others land in bin 0, taken back out.
            misses = REFINE_BLOCK - tl.sum(match.to(tl.int32), axis=0)
            counts += tl.histogram(digit, 1 << BITS) - tl.where(digits == 0, misses, 0)
    at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
    chosen = tl.max(tl.where(at_or_above >= need, digits, -1), axis=0)
    above = tl.sum(tl.where(digits > chosen, counts, 0), axis=0)
    return (prefix << BITS) | chosen, need - above


@triton.jit
def _refine(scores_ptr, state_ptr, boundary_ptr, out_ptr, topk,
            stride_sm, stride_bm, stride_om, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    scores_row = scores_ptr + row * stride_sm
    boundary_row = boundary_ptr + row * stride_bm
    high = tl.load(state_ptr + row * 4) - BINS // 2
    above = tl.load(state_ptr + row * 4 + 1)
    inside = tl.load(state_ptr + row * 4 + 2)
    # The 20 key bits below the bin's 12, in histograms of at least 32 bins (one per
    # lane of a warp, as Triton's histogram lowering assumes) and at most 128 (its cost
    # per score grows with the bins).
    prefix, need = _refine_digit(scores_row, boundary_row, inside, high, topk - above,
                                 13, 7, CHUNKS)
    prefix, need = _refine_digit(scores_row, boundary_row, inside, prefix, need, 6, 7, CHUNKS)
    threshold, need = _refine_digit(scores_row, boundary_row, inside, prefix, need, 0, 6,
                                    CHUNKS)
    # Boundary positions above the topk-th key, and the first `need` equal to it.
    lanes = tl.arange(0, REFINE_BLOCK)
    taken = above
    ties = 0
    for chunk in range(CHUNKS):
        start = chunk * REFINE_BLOCK
        if start < inside:
            ok, tokens, keys = _boundary_chunk(scores_row, boundary_row, start, lanes, inside)
            tie = ok & (keys == threshold)
            take = (ok & (keys > threshold)) | (
                tie & (ties + tl.cumsum(tie.to(tl.int32), axis=0) <= need))
            slots = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(out_ptr + row * stride_om + slots, tokens.to(tl.int64), mask=take)
            taken += tl.sum(take.to(tl.int32), axis=0)
            ties += tl.sum(tie.to(tl.int32), axis=0)


def forward(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    # The kernel indexes the head dimension with unit stride.
    q, k, weights = q.contiguous(), k.contiguous(), weights.contiguous()
    rows, heads, dim = q.shape
    context = k.shape[0]
    device = q.device
    block_n, block_c = PARAMS["BLOCK_N"], PARAMS["BLOCK_C"]
    blocks = triton.cdiv(context, block_c)
    scores = torch.empty(rows, context, dtype=torch.float32, device=device)
    hist = torch.zeros(rows, BINS.value, dtype=torch.int32, device=device)
    state = torch.empty(rows, 4, dtype=torch.int32, device=device)
    counts = torch.empty(rows, blocks, 2, dtype=torch.int32, device=device)
    boundary = torch.empty(rows, context, dtype=torch.int32, device=device)
    out = torch.empty(rows, topk, dtype=torch.int64, device=device)
    _scores_and_histogram[(rows, triton.cdiv(context, block_n))](
        q, k, weights, scores, hist, context,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), scores.stride(0),
        heads=heads, dim=dim, BLOCK_N=block_n, BLOCK_H=PARAMS["BLOCK_H"],
        BLOCK_D=triton.next_power_of_2(dim), PRECISION=dot_precision(q.dtype), UPCAST=INTERPRETED,
        num_warps=PARAMS["num_warps"], num_stages=PARAMS["num_stages"],
    )
    _threshold_bin[(rows,)](hist, state, topk, num_warps=4)
    _count_blocks[(rows, blocks)](scores, state, counts, context, scores.stride(0),
                                  BLOCK_C=block_c, num_warps=4)
    _compact[(rows, blocks)](
        scores, state, counts, out, boundary, context,
        scores.stride(0), out.stride(0), boundary.stride(0),
        BLOCK_C=block_c, BLOCKS=triton.next_power_of_2(blocks), num_warps=4,
    )
    _refine[(rows,)](
        scores, state, boundary, out, topk, scores.stride(0), boundary.stride(0),
        out.stride(0), CHUNKS=triton.cdiv(context, REFINE_BLOCK.value), num_warps=4,
    )
    return out
