"""The FP8 lightning indexer in CuTe DSL for Hopper: e4m3 warpgroup-MMA scores with the
first radix digit of the top-k fused in, then an exact radix select per query row.

dsa_indexer_topk's logits_topk_cute on DeepSeek's FP8 inputs: q and k in float8 e4m3,
one float32 scale per key token (k_scale), q's scale folded into the weights.

1. Scores (`_score_tiles`, its pieces runners/kernel_lib/indexer_scores.py's, shared
   by every CuTe indexer). A CTA owns ROWS query rows and one contiguous span of the
   context. The rows' queries, [ROWS*H, D] in e4m3, arrive once by TMA and stay in
   shared memory; the span's keys stream through a TMA pipeline (16 KB per 128 tokens
   at D=128, half the bf16 kernel's). Two warpgroups issue e4m3 wgmma (k = 32 per
   instruction, twice the bf16 rate) with the tokens as the MMA's M (64 per
   warpgroup), the ROWS*H query heads as its N (128 or 256) and D as its K, accumulated
   in float32; SCHEDULE is "cooperative" (both on one 128-token tile, then both
   reducing it), "pingpong" (each on every other 64-token tile, fed by a warpgroup
   that loads, one reducing while the other's MMA runs) or "roundrobin" (three in turn,
   ROWS=2 at most), as in the bf16 kernel. All heads of one token sit in one quad of
   lanes: ReLU, the weights and the sum over heads happen in registers plus shuffles,
   or on the tensor cores (REDUCE="mma"). The key's scale is positive and shared by
   every head, so relu(s * x) = s * relu(x) and it multiplies each token's summed
   score once. Each score goes to an [M, N] float32 buffer and into the CTA's histogram
   of its top 11 key bits, the first digit of the select; each CTA writes its
   histogram out. The CTAs tile the grid as (row groups) x
   (context spans), one per SM.
2. Select (`launch_select`): the bf16 kernel's, imported from runners/kernel_lib/
   indexer_select.py (it reads float32 scores). One CTA per query row: the exact top-k,
   ties to the lowest index, written in token order, bit for bit the same on every call.

No torch op computes anything: forward only allocates.

- ROWS: query rows per CTA; ROWS x H is the MMA's N (at most 256), and each key tile
  in shared memory serves all of them.
- STAGES: 128-token key tiles in flight (16 KB each at D=128).
- SCHEDULE: "cooperative", "pingpong" or "roundrobin", above. The e4m3 MMA takes half
  the bf16 one's time while the reduction takes the same: three warpgroups in turn
  hide the most of it (0.322 ms at 256K on the H200, pingpong 0.336).
- REDUCE: how a quad of lanes adds up its partial sums. "shuffle": two butterfly
  shuffles per sum, then each lane stores one sum under a divergent branch (measured
  on the H200). "scatter": two accumulators per sum, a reduce-scatter (three shuffles
  for four sums) that leaves each lane its own sums to store, no divergence; written
  after ncu found the reduction latency-bound: 21-43% faster on the H200, on every
  schedule. "mma": the sum over heads on the tensor cores instead, a second wgmma
  (m64n8k16) whose A is the tile's accumulator, ReLU'd and rounded to bfloat16 in
  registers (one cvt per two scores), and whose B holds the weights; each lane ends
  with whole sums. The next tile's MMA is queued behind it before its results are
  waited for. On the H200 4-9% faster than "scatter" at every context (0.294 ms at
  256K); bfloat16 rounding of the ReLU'd logits stays far inside the op's tolerance.
- SELECT_THREADS: threads of each row's select CTA (1024 beat 512 in the bf16 kernel
  at every context on the H200).

The kernels are compiled once per (H, D, top-k, parameters) for the GPU in hand,
whatever the batch of query rows and the context length; on a machine without one,
CUTE_DSL_ARCH=sm_90a makes them compile for Hopper, and the launch then fails for want
of a GPU.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute

from runners.kernel_lib.cute_host import Program, aligned, current_stream, sm_count
from runners.kernel_lib.indexer_scores import (
    SCHEDULES, dense_compile_args, dense_cta, dense_turns, mma_operands, mma_rows, mma_splits, score_threads,
    tile_tokens,
)
from runners.kernel_lib.indexer_select import BINS, compile_select, select_bucket

# The point kept on the H200 (2026-11-30): 0.290 ms at 256K, 0.67x the bf16 kernel. The
# head sum runs on the tensor cores; three warpgroups take turns (ROWS=4 compiles as 2,
# see mma_rows; docs/benchmarks/h200-dsa-indexer.md).
PARAMS = {
    "ROWS": 4,
    "STAGES": 6,
    "SCHEDULE": "roundrobin",
    "REDUCE": "mma",
    "SELECT_THREADS": 1024,
}

SPACE = {
    "ROWS": [2, 4],
    "STAGES": [6],
    "SCHEDULE": ["cooperative", "pingpong", "roundrobin"],
    "REDUCE": ["shuffle", "scatter", "mma"],
    "SELECT_THREADS": [1024],
}

_FP8 = torch.float8_e4m3fn
_WEIGHT_DTYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}


# --- scores: e4m3 on the tensor cores -------------------------------------------------


@cute.kernel
def _score_tiles(
    tma_k: cute.CopyAtom, k_tiles: cute.Tensor, tma_q: cute.CopyAtom, q_tiles: cute.Tensor,
    k_scale: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor,
    tiled_mma: cute.TiledMma, head_mma: cute.TiledMma, k_layout: cute.ComposedLayout,
    q_layout: cute.ComposedLayout, w_layout: cute.ComposedLayout, dtype: cutlass.Constexpr,
    tiles_per_cta: cutlass.Int32, rows: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    """CTA (group, split): query rows group*ROWS.. against the context's key tiles
    split*tiles_per_cta.., each token's summed score times k_scale[token]."""
    dense_cta(tma_k, k_tiles, tma_q, q_tiles, k_scale, weights, scores, hist, tiled_mma, head_mma, k_layout,
              q_layout, w_layout, dtype, tiles_per_cta, rows, stages, turns, reduce)


@cute.jit
def _launch_scores_mma(
    q_rows: cute.Tensor, k: cute.Tensor, k_scale: cute.Tensor, weights: cute.Tensor,
    scores: cute.Tensor, hist: cute.Tensor, stream: cuda.CUstream, tiles_per_cta: cutlass.Int32,
    rows: cutlass.Constexpr, stages: cutlass.Constexpr, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr,
):
    # e4m3 keys and queries: the wgmma takes 32 of D at a time.
    (tma_k, k_tiles, tma_q, q_tiles), mmas = mma_operands(
        q_rows, k, rows * weights.shape[1], tile_tokens(turns), stages, turns)
    groups = cute.ceil_div(scores.shape[0], rows)
    _score_tiles(
        tma_k, k_tiles, tma_q, q_tiles, k_scale, weights, scores, hist, *mmas, k.element_type, tiles_per_cta,
        rows, stages, turns, reduce,
    ).launch(grid=(groups, hist.shape[0], 1), block=(score_threads(turns), 1, 1), stream=stream)


# --- host -----------------------------------------------------------------------------


@functools.cache
def compiled_scores_mma(
    heads: int, dim: int, rows: int, stages: int,
    weight_dtype: torch.dtype = torch.float32, schedule: str = "cooperative",
    reduce: str = "shuffle",
):
    """The e4m3 tensor-core scores kernel for one (H, D) and parameters, any number of
    query rows and any context length (they and the CTAs' spans are runtime values); no
    GPU needed.

    `stages` counts 128-token key tiles; pingpong cuts each in two, one per warpgroup.
    Called with the tensors, the stream and the key tiles per CTA (`mma_splits`)."""
    # e4m3 rows of D bytes: the 128-byte swizzle and k-blocks of 32 need D % 128 == 0.
    turns = dense_turns(rows, heads, dim, schedule, reduce, 128)
    arguments = dense_compile_args(
        cutlass.Float8E4M3FN, heads, dim, _WEIGHT_DTYPES[weight_dtype], rows, stages, turns, reduce, True)
    return Program(cute.compile(_launch_scores_mma, *arguments), arguments)


@functools.cache
def compiled_select(topk: int, threads: int, vec: int = 4, by_bitmap: bool = True):
    """The bf16 kernel's select for one top-k and one `select_bucket` of context
    lengths, compiled (and counted) as this module's own."""
    return compile_select(topk, threads, vec, by_bitmap)


def forward(
    q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    if q.dtype != _FP8 or k.dtype != _FP8 or k_scale.dtype != torch.float32 \
            or weights.dtype not in _WEIGHT_DTYPES:
        raise TypeError(
            f"logits_topk_fp8_cute takes q and k in {_FP8}, k_scale in torch.float32 and weights "
            f"in {sorted(map(str, _WEIGHT_DTYPES))}; got {q.dtype}, {k.dtype}, {k_scale.dtype}, "
            f"{weights.dtype}"
        )
    rows_m, heads, dim = q.shape
    context = k.shape[0]
    if context < topk:
        raise ValueError(f"{context} context tokens leave no top-{topk}")
    q, k, k_scale, weights = aligned(q), aligned(k), aligned(k_scale), aligned(weights)
    sms = sm_count()
    rows = mma_rows(PARAMS["ROWS"], heads, PARAMS["SCHEDULE"])
    splits, per_cta = mma_splits(rows_m, context, rows, sms)
    scores = torch.empty(rows_m, context, dtype=torch.float32, device=q.device)
    hist = torch.empty(splits, rows_m, BINS, dtype=torch.int32, device=q.device)
    out = torch.empty(rows_m, topk, dtype=torch.int64, device=q.device)
    stream = current_stream(q)
    kernel = compiled_scores_mma(heads, dim, rows, PARAMS["STAGES"], weights.dtype,
                                 PARAMS["SCHEDULE"], PARAMS["REDUCE"])
    halves = 2 if SCHEDULES[PARAMS["SCHEDULE"]] > 1 else 1
    kernel(q.view(rows_m * heads, dim), k, k_scale, weights, scores, hist, stream, per_cta * halves)
    compiled_select(topk, PARAMS["SELECT_THREADS"], *select_bucket(context))(scores, hist, out, stream)
    return out
