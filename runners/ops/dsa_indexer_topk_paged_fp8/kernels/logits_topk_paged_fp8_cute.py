"""The paged FP8 decode indexer in CuTe DSL for Hopper: the paged bf16 kernel
(dsa_indexer_topk_paged's logits_topk_paged_cute) on DeepSeek's FP8 cache, with the dense
FP8 kernel's e4m3 warpgroup-MMA and its scale, ReLU and head-sum handling
(dsa_indexer_topk_fp8's logits_topk_fp8_cute).

q and the cache's keys are float8 e4m3, each key token has one float32 scale in
`kv_scale` [num_blocks, 64] (the slot beside its key in `kv_cache` [num_blocks, 64, D]),
and q's scale is folded into the weights:

    I[r, n] = sum_h weights[r, h] * relu(kv_scale[n] * (q[b, j, h, :] . key_b[n, :]))

1. Scores (`_score_tiles`). As in the bf16 paged kernel: a CTA owns one sequence's
   next_n query rows (ROWS = next_n) and one span of SPAN tokens of it, on a grid
   (spans of the widest sequence the block table can hold, sequences) fixed by shapes
   alone; it reads the sequence's length from `context_lens` on the device, and a span
   past the end exits at once. Queries arrive once by TMA; keys stream by TMA one
   64-token cache block per tile (8 KB at D=128, half the bf16 kernel's), block
   `block_table[b, t]` for the sequence's tile t. Warpgroups take turns issuing e4m3
   wgmma (k = 32 per instruction), tokens as M (64, one block), ROWS*H heads as N, D as
   K ("pingpong": two, "roundrobin": three). A token's scale is positive and shared by
   every head, so relu(s * x) = s * relu(x): ReLU, weights and the head sum are the
   bf16 kernel's (REDUCE, on the CUDA cores or the tensor cores), and each token's sum
   is multiplied by its scale once, `kv_scale[block_table[b, t], slot]` read before the
   MMA whose sums it scales is waited for. Row r = b*next_n + j stores and counts only its causal
   prefix, tokens < context_lens[b] - next_n + 1 + j. Each CTA writes its rows'
   first-digit histograms to hist[span, row].
2. Select (`launch_paged_select`): the bf16 paged kernel's, from runners/kernel_lib/
   indexer_select.py (it reads float32
   scores): the histograms of the spans a row's prefix covers summed, one pass over the
   prefix, digits 2 and 3 in shared memory, ties to the lowest index, the chosen in
   token order; -1 past a prefix shorter than top-k, all -1 for a padding sequence.
   Deterministic: the same inputs give the same output bit for bit.

No torch op computes anything and nothing is read on the host: forward only allocates,
from shapes, and launches on torch's current stream, so it can be captured.

Shared with the other CuTe indexers through runners/kernel_lib: the scores kernel's
pieces (indexer_scores.py: `paged_cta` as in the bf16 paged kernel, given the key
scales, which the stores multiply in as the dense FP8 kernel's do) and the select
(indexer_select.py). Its own: the launch, its shapes and checks.

- STAGES: 128-token key tiles in flight (two 64-token cache blocks each, 16 KB at
  D=128), as in the dense FP8 kernel.
- SCHEDULE, REDUCE: as in the dense FP8 kernel, and each under its compile-time limits
  (roundrobin holds at most 128 accumulator columns: next_n*H <= 128).
- SPAN: tokens per scores CTA, as in the bf16 paged kernel. Not yet measured.
- SELECT_THREADS: threads of each row's select CTA.

Compiled once per (H, D, next_n, top-k, parameters, bitmap or list) for the GPU in hand;
on a machine without one, CUTE_DSL_ARCH=sm_90a makes it compile for Hopper, and the
launch then fails for want of a GPU.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute

from runners.kernel_lib.cute_host import Program, aligned, current_stream
from runners.kernel_lib.indexer_scores import mma_operands, paged_compile_args, paged_cta, paged_turns, score_threads
from runners.kernel_lib.indexer_select import BINS, BITMAP_TOKENS, BLOCK_SIZE, MAX_TOPK, compile_paged_select

# The dense FP8 kernel's kept point (logits_topk_fp8_cute: three warpgroups in turn,
# the head sum on the tensor cores), with SPAN new; none of it measured paged yet.
PARAMS = {
    "STAGES": 6,
    "SCHEDULE": "roundrobin",
    "REDUCE": "mma",
    "SPAN": 8192,
    "SELECT_THREADS": 1024,
}

SPACE = {
    "STAGES": [6],
    "SCHEDULE": ["pingpong", "roundrobin"],
    "REDUCE": ["shuffle", "scatter", "mma"],
    "SPAN": [4096, 8192, 16384],
    "SELECT_THREADS": [1024],
}

_FP8 = torch.float8_e4m3fn


# --- scores: e4m3 on the tensor cores -------------------------------------------------


@cute.kernel
def _score_tiles(
    tma_k: cute.CopyAtom, k_tiles: cute.Tensor, tma_q: cute.CopyAtom, q_tiles: cute.Tensor,
    kv_scale: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor,
    tiled_mma: cute.TiledMma, head_mma: cute.TiledMma, k_layout: cute.ComposedLayout,
    q_layout: cute.ComposedLayout, w_layout: cute.ComposedLayout, block_table: cute.Tensor,
    context_lens: cute.Tensor, tiles_per_cta: cutlass.Constexpr, rows: cutlass.Constexpr,
    stages: cutlass.Constexpr, turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    """CTA (split, seq): span `split` of sequence `seq`, each token's summed score times
    its scale in kv_scale [blocks*64]; a sequence's rows are always inside the weights,
    read unchecked."""
    paged_cta(tma_k, k_tiles, tma_q, q_tiles, kv_scale, weights, scores, hist, tiled_mma, head_mma, k_layout,
              q_layout, w_layout, block_table, context_lens, cutlass.Float8E4M3FN, tiles_per_cta, rows, stages,
              turns, reduce, False)


@cute.jit
def _launch_scores_mma(
    q_rows: cute.Tensor, k: cute.Tensor, kv_scale: cute.Tensor, weights: cute.Tensor,
    scores: cute.Tensor, hist: cute.Tensor, block_table: cute.Tensor, context_lens: cute.Tensor,
    stream: cuda.CUstream, tiles_per_cta: cutlass.Constexpr, rows: cutlass.Constexpr,
    stages: cutlass.Constexpr, turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    # e4m3 keys [blocks*64, D], one cache block a tile, and queries [B*next_n*H, D].
    (tma_k, k_tiles, tma_q, q_tiles), mmas = mma_operands(
        q_rows, k, rows * weights.shape[1], BLOCK_SIZE, stages, turns)
    # (spans of the widest sequence the block table holds, sequences): from shapes only.
    _score_tiles(
        tma_k, k_tiles, tma_q, q_tiles, kv_scale, weights, scores, hist, *mmas, block_table, context_lens,
        tiles_per_cta, rows, stages, turns, reduce,
    ).launch(grid=(hist.shape[0], context_lens.shape[0], 1), block=(score_threads(turns), 1, 1), stream=stream)


# --- host -----------------------------------------------------------------------------


@functools.cache
def compiled_scores_mma(heads: int, dim: int, next_n: int, stages: int, schedule: str, reduce: str, span: int):
    """The e4m3 scores kernel for one (H, D, next_n) and parameters, any batch, table
    width, cache size and lengths; no GPU needed. `stages` counts 128-token key tiles,
    two cache blocks each. Called with q [B*next_n*H, D], the cache [blocks*64, D],
    kv_scale [blocks*64], weights, scores, hist, block_table, context_lens, stream."""
    # e4m3 rows of D bytes: the 128-byte swizzle the keys' and queries' tiles are laid
    # out in, and k-blocks of 32, need D a multiple of 128 (as the dense FP8 kernel).
    turns = paged_turns(heads, dim, next_n, schedule, reduce, span, 128)
    arguments = paged_compile_args(
        cutlass.Float8E4M3FN, heads, dim, next_n, stages, span, turns, reduce, True)
    return Program(cute.compile(_launch_scores_mma, *arguments), arguments)


@functools.cache
def compiled_select(next_n: int, topk: int, span: int, threads: int, by_bitmap: bool = True):
    """The bf16 paged kernel's select for one (next_n, top-k) and parameters, compiled
    (and counted) as this module's own; `compile_paged_select`."""
    return compile_paged_select(next_n, topk, span, threads, by_bitmap)


def forward(
    q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    if q.dtype != _FP8 or kv_cache.dtype != _FP8 or kv_scale.dtype != torch.float32 \
            or weights.dtype != torch.float32:
        raise TypeError(f"logits_topk_paged_fp8_cute takes q and kv_cache in {_FP8}, kv_scale and weights in "
                        f"torch.float32; got {q.dtype}, {kv_cache.dtype}, {kv_scale.dtype}, {weights.dtype}")
    if block_table.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(f"block_table and context_lens are torch.int32; got {block_table.dtype}, "
                        f"{context_lens.dtype}")
    batch, next_n, heads, dim = q.shape
    if kv_cache.shape[1:] != (BLOCK_SIZE, dim) or kv_scale.shape != kv_cache.shape[:2] \
            or block_table.shape[0] != batch or context_lens.shape != (batch,) \
            or weights.shape != (batch * next_n, heads) or batch == 0:
        raise ValueError(f"logits_topk_paged_fp8_cute needs q [B>0, next_n, H, D], kv_cache [blocks, {BLOCK_SIZE}, D], "
                         f"kv_scale [blocks, {BLOCK_SIZE}], block_table [B, max_blocks], context_lens [B], "
                         f"weights [B*next_n, H]; got {tuple(q.shape)}, {tuple(kv_cache.shape)}, "
                         f"{tuple(kv_scale.shape)}, {tuple(block_table.shape)}, {tuple(context_lens.shape)}, "
                         f"{tuple(weights.shape)}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"logits_topk_paged_fp8_cute selects 1 to {MAX_TOPK} per row; got top-{topk}")
    # Both kernels are compiled (or found compiled) before anything is allocated, so a
    # point or shape they cannot run fails with nothing half done.
    width = block_table.shape[1] * BLOCK_SIZE
    span = PARAMS["SPAN"]
    kernel = compiled_scores_mma(heads, dim, next_n, PARAMS["STAGES"], PARAMS["SCHEDULE"], PARAMS["REDUCE"], span)
    select = compiled_select(next_n, topk, span, PARAMS["SELECT_THREADS"], width <= BITMAP_TOKENS)
    # Everything below follows from shapes: no length is read here.
    q, kv_cache, kv_scale, block_table, context_lens, weights = (
        aligned(t) for t in (q, kv_cache, kv_scale, block_table, context_lens, weights))
    rows = batch * next_n
    scores = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    hist = torch.empty(-(-width // span), rows, BINS, dtype=torch.int32, device=q.device)
    out = torch.empty(rows, topk, dtype=torch.int64, device=q.device)
    stream = current_stream(q)
    kernel(q.view(rows * heads, dim), kv_cache.view(-1, dim), kv_scale.view(-1), weights, scores, hist, block_table,
           context_lens, stream)
    select(scores, hist, out, context_lens, stream)
    return out
