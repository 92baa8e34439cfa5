"""The lightning indexer in CuTe DSL for Hopper: warpgroup-MMA scores with the first
radix digit of the top-k fused in, then an exact radix select per query row.

1. Scores (`_score_tiles`, bfloat16 or float16; its pieces are runners/kernel_lib/
   indexer_scores.py's, shared by every CuTe indexer). A CTA owns ROWS query rows and one
   contiguous span of the context. The rows' queries, [ROWS*H, D], arrive once by TMA
   and stay in shared memory; the span's keys stream through a TMA pipeline. Two
   warpgroups issue wgmma with the tokens as the MMA's M (64 per warpgroup), the ROWS*H
   query heads as its N (128 or 256) and D as its K, 16-bit in, float32 accumulated.
   SCHEDULE says how they share the tensor cores: "cooperative", both on one tile of
   128 tokens, then both reducing it while the tensor cores wait; "pingpong", each on
   every other tile of 64 tokens, fed by a warpgroup that loads, one reducing its tile
   while the other's MMA runs (named barriers hand the MMA issue back and forth, as in
   CUTLASS's pingpong kernels); "roundrobin", three such warpgroups in turn, so a
   reduction may take twice an MMA and still be hidden (ROWS=2 at most: the three
   accumulators share the registers). That way round, all heads of one token sit in one
   quad of lanes: ReLU, the per-head weights and the sum over heads happen in registers
   plus shuffles, or on the tensor cores (REDUCE="mma"), and the [M, H, N] logits never
   exist. Each score goes to an
   [M, N] float32 buffer and into the CTA's histogram of its top 11 key bits, the first
   digit of the select; each CTA writes its histogram out. The CTAs tile the grid as
   (row groups) x (context spans), one per SM.
2. Select (`launch_select`, shared by every CuTe indexer: runners/kernel_lib/
   indexer_select.py). One CTA per query row. The summed histograms give the bin that
   holds the top-k-th score; one pass over the row takes every score above that bin and
   copies the bin's own to shared memory, where digits 2 and 3 pin the exact top-k-th
   key, ties to the lowest index; the chosen are written in token order from a bitmap,
   bit for bit the same on every call.

float32 inputs take a plain SIMT scores kernel (`_score_rows_simt`): wgmma would round
them to TF32, too coarse for float32's tolerance. It writes the same scores and
histograms, so the select is shared. No torch op computes anything: forward only
allocates.

- ROWS: query rows per CTA; ROWS x H is the MMA's N (at most 256), and each key tile
  in shared memory serves all of them.
- STAGES: 128-token key tiles in flight (32 KB each at D=128). With ROWS=4 the
  queries take 64 KB and the histograms 32 KB: 3 stages make 194 KB of the 227 KB a
  CTA may have.
- SCHEDULE: "cooperative", "pingpong" or "roundrobin", above. On the H200 the
  cooperative kernel's reduction took about as many issue slots as its MMA took
  cycles (ncu: tensor pipe 61% busy, 5.6 cycles between a warp's instructions, 2 warps
  per scheduler), and pingpong gained little: a reduction took about 1.6x its tile's
  MMA, longer than the MMA it should hide behind; roundrobin gives it two (at 256K
  0.443 ms at ROWS=2, against pingpong's 0.435 at ROWS=4, both with "scatter").
- REDUCE: how a quad of lanes adds up its partial sums. "shuffle": two butterfly
  shuffles per sum, then each lane stores one sum under a divergent branch (measured
  on the H200). "scatter": two accumulators per sum, a reduce-scatter (three shuffles
  for four sums) that leaves each lane its own sums to store, no divergence; written
  after ncu found the reduction latency-bound: 4-19% faster on the H200, on every
  schedule. "mma": the sum over heads on the tensor cores instead, a second wgmma
  (m64n8k16) whose A is the tile's accumulator, ReLU'd and rounded to bfloat16 in
  registers (one cvt per two scores), and whose B holds the weights; the next tile's
  MMA is queued behind it before its results are waited for. It gains the e4m3
  kernel 4-9%; here, where the bf16 MMA already keeps the tensor cores busy, it lost
  (0.108 against 0.075 ms at 32K, 0.446 against 0.433 at 256K on the H200).
- SELECT_THREADS: threads of each row's select CTA; each pass over the row is a
  strided read, so more threads keep more loads in flight (1024 beat 512 at every
  context on the H200, so 512 left the space).

The kernels are compiled once per (dtype, H, D, top-k, parameters) for the GPU in hand,
whatever the batch of query rows and the context length (a serving engine changes both
every step); on a machine without one, CUTE_DSL_ARCH=sm_90a makes them compile for
Hopper, and the launch then fails for want of a GPU.
"""

from __future__ import annotations

import functools
import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute

from runners.kernel_lib.cute_host import Program, aligned, current_stream, fake_tensor, runtime_int, sm_count
from runners.kernel_lib.indexer_scores import (
    SCHEDULES, dense_compile_args, dense_cta, dense_turns, mma_operands, mma_rows, mma_splits, score_threads,
    tile_tokens,
)
from runners.kernel_lib.indexer_select import BINS, compile_select, record, select_bucket, write_hist

# The point kept on the H200 (2026-11-30): 0.431 ms at 256K, 1.10x the floor
# (docs/benchmarks/h200-dsa-indexer.md).
PARAMS = {
    "ROWS": 4,
    "STAGES": 3,
    "SCHEDULE": "pingpong",
    "REDUCE": "scatter",
    "SELECT_THREADS": 1024,
}

SPACE = {
    "ROWS": [2, 4],
    "STAGES": [3],
    "SCHEDULE": ["cooperative", "pingpong", "roundrobin"],
    "REDUCE": ["shuffle", "scatter", "mma"],
    "SELECT_THREADS": [1024],
}

_SIMT_THREADS = 128

_MMA_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_DTYPES = {torch.float32: cutlass.Float32, **_MMA_DTYPES}


# --- scores: 16-bit on the tensor cores ----------------------------------------------


@cute.kernel
def _score_tiles(
    tma_k: cute.CopyAtom, k_tiles: cute.Tensor, tma_q: cute.CopyAtom, q_tiles: cute.Tensor,
    weights: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor, tiled_mma: cute.TiledMma,
    head_mma: cute.TiledMma, k_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout,
    w_layout: cute.ComposedLayout, dtype: cutlass.Constexpr, tiles_per_cta: cutlass.Int32,
    rows: cutlass.Constexpr, stages: cutlass.Constexpr, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr,
):
    """CTA (group, split): query rows group*ROWS.. against the context's key tiles
    split*tiles_per_cta.., no key scales."""
    dense_cta(tma_k, k_tiles, tma_q, q_tiles, None, weights, scores, hist, tiled_mma, head_mma, k_layout,
              q_layout, w_layout, dtype, tiles_per_cta, rows, stages, turns, reduce)


@cute.jit
def _launch_scores_mma(
    q_rows: cute.Tensor, k: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, stream: cuda.CUstream, tiles_per_cta: cutlass.Int32, rows: cutlass.Constexpr,
    stages: cutlass.Constexpr, turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    loads, mmas = mma_operands(q_rows, k, rows * weights.shape[1], tile_tokens(turns), stages, turns)
    _score_tiles(
        *loads, weights, scores, hist, *mmas, k.element_type, tiles_per_cta, rows, stages, turns, reduce,
    ).launch(grid=(cute.ceil_div(scores.shape[0], rows), hist.shape[0], 1), block=(score_threads(turns), 1, 1),
             stream=stream)


# --- scores: float32 on the CUDA cores ------------------------------------------------


@cute.kernel
def _score_rows_simt(
    q: cute.Tensor, k: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, tokens_per_cta: cutlass.Int32,
):
    """One query row and one span of the context per CTA, one token per thread: the
    row's queries sit in shared memory, where all threads read the same value at once."""
    tidx, _, _ = cute.arch.thread_idx()
    split, row, _ = cute.arch.block_idx()
    heads, dim = q.shape[1], q.shape[2]
    context = k.shape[0]

    smem = cutlass.memory.SmemAllocator()
    sQ = smem.allocate_tensor(cutlass.Float32, cute.make_layout((heads, dim), stride=(dim, 1)), 16)
    sW = smem.allocate_tensor(cutlass.Float32, cute.make_layout(heads), 16)
    sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BINS), 16)
    for i in cutlass.range(tidx, heads * dim, _SIMT_THREADS, unroll=1):
        sQ[i // dim, i % dim] = q[row, i // dim, i % dim]
    for i in cutlass.range(tidx, heads, _SIMT_THREADS, unroll=1):
        sW[i] = weights[row, i].to(cutlass.Float32)
    for i in cutlass.range(tidx, BINS, _SIMT_THREADS, unroll=1):
        sHist[i] = 0
    cute.arch.sync_threads()

    start = split * tokens_per_cta
    end = cutlass.min(start + tokens_per_cta, context)
    for token in cutlass.range(start + tidx, end, _SIMT_THREADS, unroll=1):
        key = cute.make_rmem_tensor((dim,), cutlass.Float32)
        cute.autovec_copy(k[token, None], key)
        score = cutlass.Float32(0.0)
        for h in cutlass.range(heads, unroll=1):
            logit = cutlass.Float32(0.0)
            for d in cutlass.range_constexpr(dim):
                logit += sQ[h, d] * key[d]
            score += sW[h] * cute.arch.fmax(logit, cutlass.Float32(0.0))
        record(scores, sHist, row, token, 0, score)

    cute.arch.sync_threads()
    write_hist(sHist, hist, split, row, 1, _SIMT_THREADS)


@cute.jit
def _launch_scores_simt(
    q: cute.Tensor, k: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, stream: cuda.CUstream, tokens_per_cta: cutlass.Int32,
):
    _score_rows_simt(q, k, weights, scores, hist, tokens_per_cta).launch(
        grid=(hist.shape[0], scores.shape[0], 1), block=(_SIMT_THREADS, 1, 1), stream=stream
    )


# --- host -----------------------------------------------------------------------------


def _simt_splits(rows_m: int, context: int, sms: int) -> tuple[int, int]:
    """(CTAs along the context, tokens each): a few CTAs per SM."""
    wanted = max(1, 4 * sms // rows_m)
    per_cta = math.ceil(math.ceil(context / wanted) / _SIMT_THREADS) * _SIMT_THREADS
    return math.ceil(context / per_cta), per_cta


@functools.cache
def compiled_scores_mma(
    dtype: torch.dtype, heads: int, dim: int,
    rows: int, stages: int, weight_dtype: torch.dtype = torch.float32,
    schedule: str = "cooperative", reduce: str = "shuffle",
):
    """The tensor-core scores kernel for one (H, D) and parameters, any number of query
    rows and any context length (they and the CTAs' spans are runtime values); no GPU
    needed.

    `stages` counts 128-token key tiles; pingpong cuts each in two, one per warpgroup,
    so both schedules keep the same bytes in flight and give a CTA the same span.
    Called with the tensors, the stream and the key tiles per CTA (`mma_splits`)."""
    turns = dense_turns(rows, heads, dim, schedule, reduce, 64)
    arguments = dense_compile_args(
        _MMA_DTYPES[dtype], heads, dim, _DTYPES[weight_dtype], rows, stages, turns, reduce, False)
    return Program(cute.compile(_launch_scores_mma, *arguments), arguments)


@functools.cache
def compiled_scores_simt(
    heads: int, dim: int, weight_dtype: torch.dtype = torch.float32,
):
    """The float32 scores kernel for one (H, D), any number of query rows and any
    context length; no GPU needed. Called with the tensors, the stream and the tokens
    per CTA (`_simt_splits`)."""
    arguments = (
        fake_tensor(cutlass.Float32, (runtime_int(), heads, dim)), fake_tensor(cutlass.Float32, (runtime_int(), dim)),
        fake_tensor(_DTYPES[weight_dtype], (runtime_int(), heads)),
        fake_tensor(cutlass.Float32, (runtime_int(), runtime_int())),
        fake_tensor(cutlass.Int32, (runtime_int(), runtime_int(), BINS)), cuda.CUstream(0), 1,
    )
    return Program(cute.compile(_launch_scores_simt, *arguments), arguments)


@functools.cache
def compiled_select(topk: int, threads: int, vec: int = 4, by_bitmap: bool = True):
    """The select kernel for one top-k and one `select_bucket` of context lengths (a
    compile of this module's own, counted as such)."""
    return compile_select(topk, threads, vec, by_bitmap)


def forward(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    if q.dtype not in _DTYPES or k.dtype != q.dtype or weights.dtype not in _DTYPES:
        raise TypeError(
            f"logits_topk_cute supports q, k and weights in {sorted(map(str, _DTYPES))}; "
            f"got {q.dtype}, {k.dtype}, {weights.dtype}"
        )
    rows_m, heads, dim = q.shape
    context = k.shape[0]
    if context < topk:
        raise ValueError(f"{context} context tokens leave no top-{topk}")
    q, k, weights = aligned(q), aligned(k), aligned(weights)
    sms = sm_count()
    scores = torch.empty(rows_m, context, dtype=torch.float32, device=q.device)
    if q.dtype == torch.float32:
        splits, span = _simt_splits(rows_m, context, sms)
        kernel = compiled_scores_simt(heads, dim, weights.dtype)
        score_args = (q, k)
    else:
        rows = mma_rows(PARAMS["ROWS"], heads, PARAMS["SCHEDULE"])
        splits, per_cta = mma_splits(rows_m, context, rows, sms)
        kernel = compiled_scores_mma(
            q.dtype, heads, dim, rows, PARAMS["STAGES"], weights.dtype,
            PARAMS["SCHEDULE"], PARAMS["REDUCE"],
        )
        score_args = (q.view(rows_m * heads, dim), k)
        # Taking turns, a tile is one warpgroup's 64 tokens: twice the 128-token count.
        span = per_cta * (2 if SCHEDULES[PARAMS["SCHEDULE"]] > 1 else 1)
    hist = torch.empty(splits, rows_m, BINS, dtype=torch.int32, device=q.device)
    out = torch.empty(rows_m, topk, dtype=torch.int64, device=q.device)
    stream = current_stream(q)
    kernel(*score_args, weights, scores, hist, stream, span)
    compiled_select(topk, PARAMS["SELECT_THREADS"], *select_bucket(context))(scores, hist, out, stream)
    return out
