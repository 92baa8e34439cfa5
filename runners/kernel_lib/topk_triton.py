"""Pieces of the Triton indexer kernels (fused_logits_triton, fused_logits_fp8_triton,
partial_topk_triton, pipelined_topk_triton, radix_topk_triton): a tile of keys and its
lightning-indexer scores, and the candidates' keys and the bitonic networks that keep a
running top-k of them.

A candidate is one int64 per position: the score's order-preserving integer key in the
high half, the position (inverted, so lower positions win ties) in the low half. All
keys of a row differ, so a top-k of them is one set whatever order the work ran in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Below every real candidate: the key of a finite score is above the int32 minimum.
LOWEST = tl.constexpr(-(2**63))


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' PRECISION for inputs of `dtype`: float32 inputs must not be rounded to
    TF32, their tolerance is 1e-5."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def key_tile(k_ptr, tokens, valid, dims, stride_kn, dim: tl.constexpr, UPCAST: tl.constexpr):
    """The keys of `tokens`, [BLOCK_N, BLOCK_D]: zero for a token not `valid` and past `dim`
    (BLOCK_D is the next power of two); float32 with UPCAST."""
    keys = tl.load(
        k_ptr + tokens[:, None].to(tl.int64) * stride_kn + dims[None, :],
        mask=valid[:, None] & (dims[None, :] < dim), other=0.0,
    )
    if UPCAST:
        keys = keys.to(tl.float32)
    return keys


@triton.jit
def row_scores(q_ptr, w_ptr, row, keys, dims, stride_qm, stride_qh, stride_wm,
               heads: tl.constexpr, dim: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               key_scale=None):
    """sum_h weights[row, h] * relu(q[row, h, :] . keys[n, :] * key_scale[n]) for a tile of
    keys; without `key_scale` (the FP8 keys' per-token scales), unscaled."""
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
        if key_scale is not None:
            logits = logits * key_scale[None, :]
        scores += tl.sum(tl.maximum(logits, 0.0) * weight[:, None], axis=0)
    return scores


# Triton's CPU interpreter multiplies the raw bits of bfloat16 dot operands
# (triton-lang/triton#11584; it supports no bfloat16 arithmetic), so there the kernels
# widen the operands to float32 first (UPCAST=INTERPRETED). Products of bfloat16 values
# are exact in float32, as on the tensor cores, so both paths compute the same scores up
# to summation order.
INTERPRETED = not isinstance(row_scores, triton.runtime.JITFunction)


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


@triton.jit
def merge_block(best, block, LOG_K: tl.constexpr):
    """The running top 2**LOG_K `best` (sorted, largest first) with a block of as many
    candidates in any order merged in: the top 2**LOG_K of both, largest first."""
    # Largest-first against smallest-first: the larger of each pair are the top half of
    # both, as one bitonic sequence.
    return merge_descending(tl.maximum(best, sort_ascending(block, LOG_K)), LOG_K)
