"""The paged decode indexer in CuTe DSL for Hopper: the dense kernel's warpgroup-MMA
scores and radix select (dsa_indexer_topk's logits_topk_cute), reading keys through a
block table and lengths from device memory, so one compile serves every length and
batch of a bucket and a CUDA graph replays with new lengths.

1. Scores (`_score_tiles`). A CTA owns one sequence's next_n query rows (ROWS = next_n:
   only rows of one sequence share its keys) and one span of SPAN tokens of it; the grid
   is (spans of the widest sequence the block table can hold, sequences), fixed by
   shapes alone. Each CTA reads its sequence's length from `context_lens` on the device;
   spans past the end exit at once, so a 256K sequence beside 1K ones is split into
   many CTAs that keep every SM busy while the short ones take one each. The rows'
   queries arrive once by TMA; keys stream by TMA one 64-token cache block per tile,
   block `block_table[b, t]` for the sequence's tile t, so a tile is exactly one
   warpgroup's M of 64 (the dense kernel's "pingpong" and "roundrobin" schedules; its
   "cooperative" 128-token tiles would straddle two blocks and are left out). ReLU,
   weights and the sum over heads as in the dense kernel (REDUCE). Row r = b*next_n + j
   stores and counts only its causal prefix, tokens < context_lens[b] - next_n + 1 + j:
   the rest of the last block, and blocks past the end, are never read into a score.
   Each CTA writes its rows' first-digit histograms to hist[span, row].
2. Select (`launch_paged_select`, runners/kernel_lib/indexer_select.py), one CTA per
   row, the dense select over the row's prefix:
   the histograms of the spans that prefix covers are summed (span s holds the row's
   tokens [s*SPAN, (s+1)*SPAN), counted only below its length), then one pass over the
   prefix in 16-byte loads (elements past it skipped) and digits 2 and 3 in shared
   memory, ties to the lowest index, the chosen written in token order from a bitmap
   (past BITMAP_TOKENS of table width: listed and sorted). A row no longer than top-k
   takes its whole prefix in order and -1 after it; a padding sequence's rows (length
   0) are all -1. Deterministic: the same inputs give the same output bit for bit.

No torch op computes anything and nothing is read on the host: forward only allocates,
from shapes, and launches on torch's current stream, so it can be captured.

Shared with the other CuTe indexers through runners/kernel_lib: the scores kernel's
pieces (indexer_scores.py: `paged_cta` reads the block table and stores a row's prefix)
and the select (indexer_select.py). Its own: the launch, its shapes and checks.

- STAGES: 128-token key tiles in flight, as in the dense kernel (two 64-token blocks each).
- SCHEDULE, REDUCE: as in the dense kernel, and each under its compile-time limits.
- SPAN: tokens per scores CTA; smaller spans balance mixed lengths better, larger ones
  sum fewer histograms in the select and exit fewer empty CTAs. Not yet measured.
- SELECT_THREADS: threads of each row's select CTA.

Compiled once per (dtype, H, D, next_n, top-k, parameters, bitmap or list) for the GPU
in hand; on a machine without one, CUTE_DSL_ARCH=sm_90a makes it compile for Hopper,
and the launch then fails for want of a GPU.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute

from runners.kernel_lib.cute_host import Program, aligned, current_stream
from runners.kernel_lib.indexer_scores import mma_operands, paged_compile_args, paged_cta, paged_turns, score_threads
from runners.kernel_lib.indexer_select import BINS, BITMAP_TOKENS, BLOCK_SIZE, compile_paged_select

# The dense kernel's kept point (logits_topk_cute), with SPAN new and not yet measured.
PARAMS = {
    "STAGES": 3,
    "SCHEDULE": "pingpong",
    "REDUCE": "scatter",
    "SPAN": 8192,
    "SELECT_THREADS": 1024,
}

SPACE = {
    "STAGES": [3],
    "SCHEDULE": ["pingpong", "roundrobin"],
    "REDUCE": ["shuffle", "scatter", "mma"],
    "SPAN": [4096, 8192, 16384],
    "SELECT_THREADS": [1024],
}

_MMA_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


# --- scores: 16-bit on the tensor cores ----------------------------------------------


@cute.kernel
def _score_tiles(
    tma_k: cute.CopyAtom, k_tiles: cute.Tensor, tma_q: cute.CopyAtom, q_tiles: cute.Tensor,
    weights: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor, tiled_mma: cute.TiledMma,
    head_mma: cute.TiledMma, k_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout,
    w_layout: cute.ComposedLayout, block_table: cute.Tensor, context_lens: cute.Tensor,
    dtype: cutlass.Constexpr, tiles_per_cta: cutlass.Constexpr, rows: cutlass.Constexpr,
    stages: cutlass.Constexpr, turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    """CTA (split, seq): span `split` of sequence `seq`, no key scales; the weights'
    rows checked against M before they are read (a sequence's rows always lie inside)."""
    paged_cta(tma_k, k_tiles, tma_q, q_tiles, None, weights, scores, hist, tiled_mma, head_mma, k_layout,
              q_layout, w_layout, block_table, context_lens, dtype, tiles_per_cta, rows, stages, turns, reduce,
              True)


@cute.jit
def _launch_scores_mma(
    q_rows: cute.Tensor, k: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, block_table: cute.Tensor, context_lens: cute.Tensor, stream: cuda.CUstream,
    tiles_per_cta: cutlass.Constexpr, rows: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    # Keys [blocks*64, D], one cache block a tile; queries [B*next_n*H, D], N = one
    # sequence's query heads.
    loads, mmas = mma_operands(q_rows, k, rows * weights.shape[1], BLOCK_SIZE, stages, turns)
    # (spans of the widest sequence the block table holds, sequences): from shapes only.
    _score_tiles(
        *loads, weights, scores, hist, *mmas, block_table, context_lens, k.element_type, tiles_per_cta, rows,
        stages, turns, reduce,
    ).launch(grid=(hist.shape[0], context_lens.shape[0], 1), block=(score_threads(turns), 1, 1), stream=stream)


# --- host -----------------------------------------------------------------------------


@functools.cache
def compiled_scores_mma(
    dtype: torch.dtype, heads: int, dim: int, next_n: int, stages: int, schedule: str,
    reduce: str, span: int, weight_dtype: torch.dtype = torch.float32,
):
    """The scores kernel for one (dtype, H, D, next_n) and parameters, any batch, table
    width, cache size and lengths; no GPU needed. Called with q [B*next_n*H, D], the
    cache [blocks*64, D], weights, scores, hist, block_table, context_lens, stream."""
    turns = paged_turns(heads, dim, next_n, schedule, reduce, span, 64)
    arguments = paged_compile_args(
        _MMA_DTYPES[dtype], heads, dim, next_n, stages, span, turns, reduce, False)
    return Program(cute.compile(_launch_scores_mma, *arguments), arguments)


@functools.cache
def compiled_select(next_n: int, topk: int, span: int, threads: int, by_bitmap: bool = True):
    """The paged select for one (next_n, top-k) and parameters, compiled (and counted)
    as this module's own; `compile_paged_select`."""
    return compile_paged_select(next_n, topk, span, threads, by_bitmap)


def forward(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    if q.dtype not in _MMA_DTYPES or kv_cache.dtype != q.dtype or weights.dtype != torch.float32:
        raise TypeError(f"logits_topk_paged_cute takes q and kv_cache in {sorted(map(str, _MMA_DTYPES))} "
                        f"and weights in torch.float32; got {q.dtype}, {kv_cache.dtype}, {weights.dtype}")
    if block_table.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(f"block_table and context_lens are torch.int32; got {block_table.dtype}, "
                        f"{context_lens.dtype}")
    batch, next_n, heads, dim = q.shape
    if kv_cache.shape[1:] != (BLOCK_SIZE, dim) or block_table.shape[0] != batch \
            or context_lens.shape != (batch,) or weights.shape != (batch * next_n, heads) or batch == 0:
        raise ValueError(f"logits_topk_paged_cute needs q [B>0, next_n, H, D], kv_cache [blocks, {BLOCK_SIZE}, D], "
                         f"block_table [B, max_blocks], context_lens [B], weights [B*next_n, H]; got "
                         f"{tuple(q.shape)}, {tuple(kv_cache.shape)}, {tuple(block_table.shape)}, "
                         f"{tuple(context_lens.shape)}, {tuple(weights.shape)}")
    # Everything below follows from shapes: no length is read here.
    q, kv_cache, block_table, context_lens, weights = (
        aligned(t) for t in (q, kv_cache, block_table, context_lens, weights))
    rows = batch * next_n
    width = block_table.shape[1] * BLOCK_SIZE
    span = PARAMS["SPAN"]
    scores = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    hist = torch.empty(-(-width // span), rows, BINS, dtype=torch.int32, device=q.device)
    out = torch.empty(rows, topk, dtype=torch.int64, device=q.device)
    stream = current_stream(q)
    kernel = compiled_scores_mma(q.dtype, heads, dim, next_n, PARAMS["STAGES"], PARAMS["SCHEDULE"],
                                 PARAMS["REDUCE"], span)
    kernel(q.view(rows * heads, dim), kv_cache.view(-1, dim), weights, scores, hist, block_table, context_lens, stream)
    compiled_select(next_n, topk, span, PARAMS["SELECT_THREADS"], width <= BITMAP_TOKENS)(
        scores, hist, out, context_lens, stream)
    return out
