"""Pieces of the Triton indexer kernels (fused_logits_triton, partial_topk_triton,
pipelined_topk_triton, radix_topk_triton): a tile of lightning-indexer scores, and the
candidates' keys and the bitonic networks that keep a running top-k of them.

A candidate is one int64 per position: the score's order-preserving integer key in the
high half, the position (inverted, so lower positions win ties) in the low half. All
keys of a row differ, so a top-k of them is one set whatever order the work ran in.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Below every real candidate: the key of a finite score is above the int32 minimum.
LOWEST = tl.constexpr(-(2**63))


@triton.jit
def row_scores(q_ptr, w_ptr, row, keys, dims, stride_qm, stride_qh, stride_wm,
               heads: tl.constexpr, dim: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """sum_h weights[row, h] * relu(q[row, h, :] . keys[n, :]) for a tile of keys."""
    scores = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h0 in range(0, heads, BLOCK_H):
        head = h0 + tl.arange(0, BLOCK_H)
        head_ok = head < heads
        q = tl.load(
            q_ptr + row * stride_qm + head[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & (dims[None, :] < dim), other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        weight = tl.load(w_ptr + row * stride_wm + head, mask=head_ok, other=0.0)
        logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        scores += tl.sum(tl.maximum(logits, 0.0) * weight[:, None], axis=0)
    return scores


@triton.jit
def candidate_keys(scores, tokens):
    """One int64 per position, ordered like (score, -position)."""
    bits = scores.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their magnitude bits.
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - tokens).to(tl.int64)


@triton.jit
def candidate_positions(candidates):
    return (0x7FFFFFFF - candidates.to(tl.int32)).to(tl.int64)


# A bitonic network over 2**LOG_K values. Each step pairs the positions that differ in
# one bit; a [.., 2, ..] view of the values puts each pair on a size-2 axis, and the
# pair's sum (wrapping, so exact for any int64) minus a value is its partner. On an
# H200 this compiles to the same code as tl.sort (no layout conversions); tl.sort finds
# the partner with an xor reduction instead, which Triton's CPU interpreter runs element
# by element in Python, and this sum is numpy's there, reached through tl.reduce with
# tl.sum's own combine function since the interpreter pays milliseconds for each
# nested jit call (tl.sum is one).
_add = tl.standard._sum_combine


@triton.jit
def sort_ascending(x, LOG_K: tl.constexpr):
    K: tl.constexpr = 2**LOG_K
    lanes = tl.arange(0, K)
    for stage in tl.static_range(1, LOG_K + 1):
        # Sorted runs of 2**stage values, alternately ascending and descending so
        # that each pair of runs is bitonic for the next stage; the last ascends.
        descending = (lanes & (1 << stage)) != 0
        for step in tl.static_range(stage):
            # Pairs differ in bit stage-1-step; in an ascending run the upper one of
            # a pair takes the larger value.
            pairs = tl.reshape(x, [K >> (stage - step), 2, 1 << (stage - 1 - step)])
            partner = tl.reshape(tl.reduce(pairs, 1, _add, keep_dims=True) - pairs, [K])
            take_larger = ((lanes & (1 << (stage - 1 - step))) != 0) != descending
            x = tl.where((x > partner) == take_larger, x, partner)
    return x


@triton.jit
def merge_descending(x, LOG_K: tl.constexpr):
    """A bitonic sequence of 2**LOG_K values, sorted largest first."""
    K: tl.constexpr = 2**LOG_K
    lanes = tl.arange(0, K)
    for step in tl.static_range(LOG_K):
        pairs = tl.reshape(x, [1 << step, 2, K >> (step + 1)])
        partner = tl.reshape(tl.reduce(pairs, 1, _add, keep_dims=True) - pairs, [K])
        take_larger = (lanes & (K >> (step + 1))) == 0
        x = tl.where((x > partner) == take_larger, x, partner)
    return x
