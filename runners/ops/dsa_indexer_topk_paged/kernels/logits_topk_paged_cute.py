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

Shared with the dense kernel through runners/kernel_lib: the keys, histograms and the
select. Its own: `_refill` takes the block table, and the stores a row's prefix end.

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
import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from runners.kernel_lib.indexer_scores import (
    HEAD_SUM_N, LOADER_REGISTERS, MMA_REGISTERS, MMA_THREADS, REDUCTIONS, aligned, current_stream,
    Program, fake_tensor, head_sums,
)
from runners.kernel_lib.indexer_select import (
    BINS, BITMAP_TOKENS, MAX_TOPK, launch_paged_select, radix_key, record, write_hist,
)

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

# Context tokens per key tile: one warpgroup's 64-row wgmma, and one cache block.
_TOKENS = 64
BLOCK_SIZE = 64

# How many MMA warpgroups take turns on the tensor cores. (The dense kernel's
# "cooperative", two warpgroups on one 128-token tile, would need two cache blocks per
# tile: left out.)
_SCHEDULES = {"pingpong": 2, "roundrobin": 3}

_MMA_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


# --- shared device helpers ------------------------------------------------------------


# --- scores: 16-bit on the tensor cores ----------------------------------------------


@cute.jit
def _issue_mma(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrK: cute.Tensor, tCrQ: cute.Tensor,
    stage: cutlass.Int32, dim: cutlass.Constexpr,
):
    """Start one key tile's wgmma into acc, asynchronously. Returns the tiled MMA, whose
    accumulate flag changed, for the caller to rebind (so a branch carries it out)."""
    warpgroup.fence()
    for kb in cutlass.range_constexpr(dim // 16):
        # The tile's first k-block overwrites the accumulator: no zero-fill needed.
        tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(tiled_mma, acc, tCrK[(None, None, kb, stage)], tCrQ[(None, None, kb, 0)], acc)
    warpgroup.commit_group()
    return tiled_mma


@cute.jit
def _refill(keys, producer, tma_k, tKgK, tKsK, blocks, first_tile, tile_count):
    """Load the next key tile into the stage freed next. A tile is one cache block: tile
    t of the sequence is block blocks[t] of the cache."""
    if producer.count < tile_count:
        keys.producer_acquire(producer)
        cute.copy(
            tma_k, tKgK[(None, blocks[first_tile + producer.count])], tKsK[(None, producer.index)],
            tma_bar_ptr=keys.producer_get_barrier(producer),
        )
        keys.producer_commit(producer)
        producer.advance()
    return producer


@cute.jit
def _lane_token(tCcC: cute.Tensor, tile_start: cutlass.Int32, quad: cutlass.Int32) -> cutlass.Int32:
    """The token of lane q's row half q // 2 (the accumulator's halves are tokens 8
    apart): whose sums it stores under REDUCE="mma", and under "scatter" at ROWS=2."""
    first, second = tCcC[(0, 0, 0), 0, 0][0], tCcC[(0, 1, 0), 0, 0][0]
    return tile_start + cutlass.Int32(cutlass.select_((quad & 2) == 2, second, first))


@cute.jit
def _store_head_sums(
    head_acc: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor, row0: cutlass.Int32,
    rows: cutlass.Constexpr, quad: cutlass.Int32, token: cutlass.Int32, seq_end: cutlass.Int32,
):
    """Store the head-sum MMA's results, the sums of this lane's `token` (one past the
    context stores nothing). Lane q holds columns 2q and 2q+1 (query rows
    (2q) % ROWS and (2q+1) % ROWS) of tokens t and t+8; it stores row half q // 2, and
    of it: both columns when ROWS=4, column q % 2 when ROWS=2, column 0 on even lanes
    when ROWS=1. Each sum is stored once."""
    bit0, bit1 = (quad & 1) == 1, (quad & 2) == 2
    values = []
    for i in cutlass.range_constexpr(2):
        # Value (i, half) of the compact accumulator, flat index i + 2 * half.
        values.append(cutlass.Float32(cutlass.select_(bit1, head_acc[i + 2], head_acc[i])))
    # Row r of the sequence (query token r of ROWS = next_n) sees tokens < seq_end + r.
    in_context = token < seq_end
    if cutlass.const_expr(rows == 4):
        for i in cutlass.range_constexpr(2):
            r = 2 * (quad & 1) + i
            if token < seq_end + r:
                record(scores, hist, row0 + r, token, r, values[i])
    elif cutlass.const_expr(rows == 2):
        r = quad & 1
        if token < seq_end + r:
            record(scores, hist, row0 + r, token, r, cutlass.Float32(cutlass.select_(bit0, values[1], values[0])))
    else:
        if in_context and (quad & 1) == 0:
            record(scores, hist, row0, token, 0, values[0])


@cute.jit
def _reduce_tile(
    acc: cute.Tensor, tCcC: cute.Tensor, weight: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, tile_start: cutlass.Int32, row0: cutlass.Int32, rows: cutlass.Constexpr,
    heads: cutlass.Constexpr, quad: cutlass.Int32, reduce: cutlass.Constexpr, seq_end: cutlass.Int32,
):
    """sum_h w[m, h] * relu(logit) for the tile's tokens: this thread's heads of each (row
    half, query row), then across the quad's four lanes; each sum is stored and counted
    in the histogram. REDUCE="shuffle": two butterfly shuffles per sum, every lane ends
    with all of them and stores one under a divergent branch. REDUCE="scatter": two
    accumulators per sum (half the dependent latency), then a reduce-scatter that leaves
    lane q with the sums numbered q and q+4, three shuffles for every four sums, and
    each lane stores its own with no divergence."""
    scatter = reduce == "scatter"
    partials = []
    for half in cutlass.range_constexpr(2):
        for r in cutlass.range_constexpr(rows):
            if cutlass.const_expr(scatter):
                even, odd = cutlass.Float32(0.0), cutlass.Float32(0.0)
                for b in cutlass.range_constexpr(r * heads // 8, (r + 1) * heads // 8):
                    even += weight[0, b] * cute.arch.fmax(acc[(0, half, b), 0, 0], cutlass.Float32(0.0))
                    odd += weight[1, b] * cute.arch.fmax(acc[(1, half, b), 0, 0], cutlass.Float32(0.0))
                partials.append(even + odd)
            else:
                part = cutlass.Float32(0.0)
                for b in cutlass.range_constexpr(r * heads // 8, (r + 1) * heads // 8):
                    for i in cutlass.range_constexpr(2):
                        part += weight[i, b] * cute.arch.fmax(acc[(i, half, b), 0, 0], cutlass.Float32(0.0))
                part += cute.arch.shuffle_sync_bfly(part, 1)
                part += cute.arch.shuffle_sync_bfly(part, 2)
                partials.append(part)
    if cutlass.const_expr(scatter):
        # Sum e = half * ROWS + r. Lanes swap the half of their sums whose bit 1 of e is
        # not their own (xor 2), then of the rest the half whose bit 0 is not (xor 1):
        # lane q ends with the sum of e = 4j + q for each j.
        bit0, bit1 = (quad & 1) == 1, (quad & 2) == 2
        for j in cutlass.range_constexpr(2 * rows // 4):
            kept = []
            for b0 in cutlass.range_constexpr(2):
                low, high = partials[4 * j + b0], partials[4 * j + 2 + b0]
                send = cutlass.Float32(cutlass.select_(bit1, low, high))
                keep = cutlass.Float32(cutlass.select_(bit1, high, low))
                kept.append(keep + cute.arch.shuffle_sync_bfly(send, 2))
            send = cutlass.Float32(cutlass.select_(bit0, kept[0], kept[1]))
            keep = cutlass.Float32(cutlass.select_(bit0, kept[1], kept[0]))
            total = keep + cute.arch.shuffle_sync_bfly(send, 1)
            e = 4 * j + quad
            r = e % rows
            # The sum's row half of the accumulator: bit 1 of e when ROWS=2, j when 4.
            if cutlass.const_expr(rows == 2):
                token = _lane_token(tCcC, tile_start, quad)
            else:
                token = tile_start + tCcC[(0, j, 0), 0, 0][0]
            if token < seq_end + r:
                record(scores, hist, row0 + r, token, r, total)
    else:
        # Every lane of the quad now holds all 2*ROWS sums; lane q stores every fourth.
        for e in cutlass.range_constexpr(2 * rows):
            half, r = divmod(e, rows)
            token = tile_start + tCcC[(0, half, 0), 0, 0][0]
            if quad == e % 4 and token < seq_end + r:
                record(scores, hist, row0 + r, token, r, partials[e])


def reduce_as_compiled(reduce: str, rows: int) -> str:
    """REDUCE as compiled: the reduce-scatter hands each lane of a quad whole sums, so it
    needs an even ROWS (ROWS=1, for heads over 128, keeps the shuffles)."""
    return "shuffle" if reduce == "scatter" and rows % 2 else reduce


def _score_threads(turns: int) -> int:
    """The MMA warpgroups taking turns and one more that loads (a whole warpgroup, so
    registers can move from it to them)."""
    return (turns + 1) * MMA_THREADS // 2


@cute.jit
def _consume(
    tiled_mma: cute.TiledMma, head_mma: cute.TiledMma, sK: cute.Tensor, sQ: cute.Tensor,
    sW: cute.Tensor, sHeadW: cute.Tensor, q_barrier, keys, scores: cute.Tensor, sHist: cute.Tensor,
    first_tile: cutlass.Int32, tile_count: cutlass.Int32, row0: cutlass.Int32, seq_end: cutlass.Int32,
    rows: cutlass.Constexpr, heads: cutlass.Constexpr, dim: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    """An MMA warpgroup's work: wgmma on its key tiles (every `turns`-th, from its own
    turn), each reduced to scores. The loading warpgroup fills the stages; this one only
    waits on and releases them."""
    tidx, _, _ = cute.arch.thread_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    cols = rows * heads
    # Taking turns, each warpgroup is an MMA of its own.
    thr_mma = tiled_mma.get_slice(tidx % 128)
    tCrK = tiled_mma.make_fragment_A(thr_mma.partition_A(sK))
    tCrQ = tiled_mma.make_fragment_B(thr_mma.partition_B(sQ))
    # (token, query head) of every accumulator element this thread holds.
    tCcC = thr_mma.partition_C(cute.make_identity_tensor((_TOKENS, cols)))
    # The wgmma accumulator: value (i, half, b) of a thread is token lane/4 + 8*half
    # (+16 per warp) and column 8b + 2*(lane%4) + i, so a query row's heads are the
    # blocks b of its 64 columns, shared out over the lanes of one quad.
    acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
    assert cute.size(acc) == 4 * (cols // 8)
    quad = lane % 4
    weight, tCrW, head_acc, relu = None, None, None, None
    if cutlass.const_expr(reduce == "mma"):
        thr_head = head_mma.get_slice(tidx % 128)
        tCrW = head_mma.make_fragment_B(thr_head.partition_B(sHeadW))
        head_acc = cute.make_rmem_tensor(thr_head.partition_shape_C((_TOKENS, HEAD_SUM_N)), cutlass.Float32)
        assert cute.size(head_acc) == 4
        # The ReLU'd scores in bfloat16, the head-sum MMA's A.
        relu = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)
    else:
        # The weights of this thread's columns, read from shared memory once.
        weight = cute.make_rmem_tensor((2, cols // 8), cutlass.Float32)
        for b in cutlass.range_constexpr(cols // 8):
            for i in cutlass.range_constexpr(2):
                weight[i, b] = sW[tCcC[(i, 0, b), 0, 0][1]]

    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    cute.arch.mbarrier_wait(q_barrier, 0)
    # Warpgroup `turn` takes tiles turn, turn+turns, ...: while one reduces its tile,
    # the tensor cores run the others' MMAs. Named barrier 1+w is warpgroup w's turn to
    # issue, given by the warpgroup that issued the tile before, so they never start in
    # step; each arrive is matched by one wait.
    turn = warp // 4
    for _ in cutlass.range(turn, unroll=1):
        read.advance()
    if cutlass.const_expr(reduce == "mma"):
        # Tile t's head sums go to the tensor cores, then at once this warpgroup's
        # next MMA: both are queued while the sums of t are waited for and stored.
        if turn < tile_count:
            tiled_mma = _issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, turn, tile_count, turn, turns, dim)
            warpgroup.wait_group(0)
            keys.consumer_release(read)
        for _ in cutlass.range_constexpr(turns):
            read.advance()
        for t in cutlass.range(turn, tile_count, turns, unroll=1):
            token = _lane_token(tCcC, (first_tile + t) * _TOKENS, quad)
            head_mma = head_sums(head_mma, head_acc, acc, relu, tCrW, cols)
            following = t + turns
            if following < tile_count:
                tiled_mma = _issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, following, tile_count,
                                        turn, turns, dim)
                warpgroup.wait_group(1)
            else:
                warpgroup.wait_group(0)
            _store_head_sums(head_acc, scores, sHist, row0, rows, quad, token, seq_end)
            # Every iteration ends with no MMA in flight, whichever way it went.
            warpgroup.wait_group(0)
            if following < tile_count:
                keys.consumer_release(read)
            for _ in cutlass.range_constexpr(turns):
                read.advance()
    else:
        for t in cutlass.range(turn, tile_count, turns, unroll=1):
            tiled_mma = _issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, t, tile_count, turn, turns, dim)
            warpgroup.wait_group(0)
            keys.consumer_release(read)
            for _ in cutlass.range_constexpr(turns):
                read.advance()
            _reduce_tile(acc, tCcC, weight, scores, sHist, (first_tile + t) * _TOKENS, row0, rows, heads,
                         quad, reduce, seq_end)


@cute.jit
def _issue_turn(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrK: cute.Tensor, tCrQ: cute.Tensor, keys, read,
    t: cutlass.Int32, tile_count: cutlass.Int32, turn: cutlass.Int32, turns: cutlass.Constexpr,
    dim: cutlass.Constexpr,
):
    """Taking turns: wait for this warpgroup's turn (past the first tile) and tile t's keys,
    start its MMA, then hand the turn on if a tile follows. Returns the tiled MMA."""
    if t > 0:
        cute.arch.barrier(barrier_id=1 + turn, number_of_threads=MMA_THREADS)
    keys.consumer_wait(read)
    tiled_mma = _issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index, dim)
    if t + 1 < tile_count:
        cute.arch.barrier_arrive(barrier_id=1 + (turn + 1) % turns, number_of_threads=MMA_THREADS)
    return tiled_mma


@cute.kernel
def _score_tiles(
    tma_k: cute.CopyAtom, k_tiles: cute.Tensor, tma_q: cute.CopyAtom, q_tiles: cute.Tensor,
    weights: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor, tiled_mma: cute.TiledMma,
    head_mma: cute.TiledMma, k_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout,
    w_layout: cute.ComposedLayout, block_table: cute.Tensor, context_lens: cute.Tensor,
    dtype: cutlass.Constexpr, tiles_per_cta: cutlass.Constexpr, rows: cutlass.Constexpr,
    stages: cutlass.Constexpr, turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    # The select may launch once every CTA has passed here: its CTAs wait on the SMs
    # this grid leaves free and take the others as they empty, no launch gap between.
    cute.arch.griddepcontrol_launch_dependents()
    tidx, _, _ = cute.arch.thread_idx()
    # CTA (split, seq): span `split` of sequence `seq`, tiles_per_cta blocks from
    # split * tiles_per_cta; its ROWS = next_n query rows share the keys.
    split, seq, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    heads = weights.shape[1]
    dim = k_tiles.shape[1]
    cols = rows * heads
    row0 = seq * rows
    threads = _score_threads(turns)
    # The first warp of the last warpgroup loads, and gives its registers to the others.
    loader = turns * 4
    # Read on the device at run time: nothing here depends on a length at compile time,
    # and a CUDA graph replays with whatever lengths the buffer holds then.
    seq_len = context_lens[seq]
    # Row r of the sequence sees its first seq_end + r tokens.
    seq_end = seq_len - rows + 1
    first_tile = split * tiles_per_cta
    tile_count = cutlass.min(tiles_per_cta, cute.ceil_div(seq_len, _TOKENS) - first_tile)
    blocks = block_table[seq, None]
    # A span past the sequence's end (or an empty, padding sequence) has nothing to do
    # and writes nothing: the select sums only the spans of each row's own prefix.
    if tile_count > 0:
        if warp == loader:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_q)

        smem = cutlass.memory.SmemAllocator()
        k_barriers = smem.allocate_array(cutlass.Int64, stages * 2)
        q_barrier = smem.allocate_array(cutlass.Int64, 1)
        sK = smem.allocate_tensor(dtype, k_layout.outer, 1024, k_layout.inner)
        sQ = smem.allocate_tensor(dtype, q_layout.outer, 1024, q_layout.inner)
        # The weights the CUDA-core reductions read; the head-sum MMA reads its own B.
        sW = None
        if cutlass.const_expr(reduce != "mma"):
            sW = smem.allocate_tensor(cutlass.Float32, cute.make_layout(cols), 16)
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(rows * BINS), 16)
        sHeadW = None
        if cutlass.const_expr(reduce == "mma"):
            sHeadW = smem.allocate_tensor(cutlass.BFloat16, w_layout.outer, 1024, w_layout.inner)

        # Key tiles: one TMA producer thread; every warp of the warpgroup that reads a
        # stage releases it.
        k_bytes = cute.size_in_bytes(dtype, cute.slice_(k_layout, (None, None, 0)))
        keys = pipeline.PipelineTmaAsync.create(
            barrier_storage=k_barriers,
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=k_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        if warp == loader:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(q_barrier, 1)
        cute.arch.mbarrier_init_fence()
        # Weights of rows past M are zero, so those rows score 0 and are never stored.
        if cutlass.const_expr(reduce != "mma"):
            for i in cutlass.range(tidx, cols, threads, unroll=1):
                weight = cutlass.Float32(0.0)
                if row0 + i // heads < weights.shape[0]:
                    weight = weights[row0 + i // heads, i % heads].to(cutlass.Float32)
                sW[i] = weight
        else:
            # The head-sum MMA's B, [8, ROWS*H]: column n holds row n % ROWS's weights
            # under that row's heads and zeros elsewhere.
            for i in cutlass.range(tidx, HEAD_SUM_N * cols, threads, unroll=1):
                n, c = i // cols, i % cols
                weight = cutlass.Float32(0.0)
                if c // heads == n % rows and row0 + c // heads < weights.shape[0]:
                    weight = weights[row0 + c // heads, c % heads].to(cutlass.Float32)
                sHeadW[n, c, 0] = weight.to(cutlass.BFloat16)
            # Written by threads, read by wgmma: the async proxy must see the stores.
            cute.arch.fence_proxy("async.shared", space="cta")
        for i in cutlass.range(tidx, rows * BINS, threads, unroll=1):
            sHist[i] = 0
        cute.arch.sync_threads()

        # (tile, D, tile index) views of the TMA tensors; rows and tokens past the end
        # are filled with zeros by the TMA unit.
        gQ = cute.local_tile(q_tiles, (cols, dim), (None, 0))
        gK = cute.local_tile(k_tiles, (_TOKENS, dim), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )

        if warp == loader:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    q_barrier, cute.size_in_bytes(dtype, cute.slice_(q_layout, (None, None, 0)))
                )
            cute.copy(tma_q, tQgQ[(None, seq)], tQsQ[(None, 0)], tma_bar_ptr=q_barrier)
        # Registers move to the MMA warpgroups inside the branches that use them, so the
        # compiler gives each side its own budget.
        if warp >= loader:
            cute.arch.setmaxregister_decrease(LOADER_REGISTERS)
            if warp == loader:
                producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for _ in cutlass.range(tile_count, unroll=1):
                    producer = _refill(keys, producer, tma_k, tKgK, tKsK, blocks, first_tile, tile_count)
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS[turns])
            _consume(tiled_mma, head_mma, sK, sQ, sW, sHeadW, q_barrier, keys, scores, sHist, first_tile,
                     tile_count, row0, seq_end, rows, heads, dim, stages, turns, reduce)

        cute.arch.sync_threads()
        write_hist(sHist, hist, split, row0, rows, threads)


@cute.jit
def _launch_scores_mma(
    q_rows: cute.Tensor, k: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, block_table: cute.Tensor, context_lens: cute.Tensor, stream: cuda.CUstream,
    tiles_per_cta: cutlass.Constexpr, rows: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    cols = rows * weights.shape[1]
    dim = k.shape[1]
    # Both operands are K-major: keys [blocks*64, D] are the A (M = tokens), queries
    # [B*next_n*H, D] the B (N = one sequence's query heads).
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        k.element_type, q_rows.element_type, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, (1, 1, 1), tiler_mn=(64, cols),
    )
    tile = (_TOKENS, cols, dim)
    k_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, k.element_type, stages)
    q_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, q_rows.element_type, 1)
    load = cpasync.CopyBulkTensorTileG2SOp()
    tma_k, k_tiles = cpasync.make_tiled_tma_atom(
        load, k, cute.slice_(k_layout, (None, None, 0)), (_TOKENS, dim)
    )
    tma_q, q_tiles = cpasync.make_tiled_tma_atom(
        load, q_rows, cute.slice_(q_layout, (None, None, 0)), (cols, dim)
    )
    # REDUCE="mma": the ReLU'd scores, bfloat16 in registers, are the A of an N=8 wgmma
    # whose K is the accumulator's columns; its B, the weights, K-major in shared memory.
    head_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, (1, 1, 1), tiler_mn=(64, HEAD_SUM_N),
        a_source=warpgroup.OperandSource.RMEM,
    )
    w_layout = sm90_utils.make_smem_layout_b(
        LayoutEnum.ROW_MAJOR, (_TOKENS, HEAD_SUM_N, cols), cutlass.BFloat16, 1
    )
    # (spans of the widest sequence the block table holds, sequences): from shapes only.
    _score_tiles(
        tma_k, k_tiles, tma_q, q_tiles, weights, scores, hist, tiled_mma, head_mma, k_layout,
        q_layout, w_layout, block_table, context_lens, k.element_type, tiles_per_cta, rows, stages,
        turns, reduce,
    ).launch(grid=(hist.shape[0], context_lens.shape[0], 1), block=(_score_threads(turns), 1, 1), stream=stream)


# --- host -----------------------------------------------------------------------------


def _runtime(divisibility: int = 1):
    """A batch size, table width or span count: bound at each call, compiling nothing."""
    return cute.sym_int32(divisibility=divisibility)


def _check_params(heads: int, dim: int, next_n: int, schedule: str, reduce: str, span: int) -> int:
    """The MMA warpgroups taking turns; ValueError for a shape or point this cannot run."""
    if schedule not in _SCHEDULES:
        raise ValueError(f"SCHEDULE is one of {tuple(_SCHEDULES)}; got {schedule!r}")
    turns = _SCHEDULES[schedule]
    columns = 128 if turns == 3 else 256
    if next_n * heads > columns or heads % 8 or dim % 64:
        raise ValueError(f"SCHEDULE={schedule!r} needs next_n*H <= {columns}, H % 8 == 0, D % 64 == 0; "
                         f"got next_n={next_n}, H={heads}, D={dim}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"REDUCE is one of {REDUCTIONS}; got {reduce!r}")
    if span % BLOCK_SIZE:
        raise ValueError(f"SPAN is whole {BLOCK_SIZE}-token blocks; got {span}")
    return turns


@functools.cache
def compiled_scores_mma(
    dtype: torch.dtype, heads: int, dim: int, next_n: int, stages: int, schedule: str,
    reduce: str, span: int, weight_dtype: torch.dtype = torch.float32,
):
    """The scores kernel for one (dtype, H, D, next_n) and parameters, any batch, table
    width, cache size and lengths; no GPU needed. Called with q [B*next_n*H, D], the
    cache [blocks*64, D], weights, scores, hist, block_table, context_lens, stream."""
    turns = _check_params(heads, dim, next_n, schedule, reduce, span)
    element = _MMA_DTYPES[dtype]
    arguments = (
        fake_tensor(element, (_runtime(), dim)), fake_tensor(element, (_runtime(), dim)),
        fake_tensor(cutlass.Float32, (_runtime(), heads)), fake_tensor(cutlass.Float32, (_runtime(), _runtime(BLOCK_SIZE))),
        fake_tensor(cutlass.Int32, (_runtime(), _runtime(), BINS)), fake_tensor(cutlass.Int32, (_runtime(), _runtime())),
        fake_tensor(cutlass.Int32, (_runtime(),)), cuda.CUstream(0), span // _TOKENS, next_n, stages * 2, turns,
        reduce_as_compiled(reduce, next_n),
    )
    return Program(cute.compile(_launch_scores_mma, *arguments), arguments)


@functools.cache
def compiled_select(next_n: int, topk: int, span: int, threads: int, by_bitmap: bool = True):
    """The select for one (next_n, top-k) and parameters, any batch and lengths, table
    widths up to BITMAP_TOKENS (by_bitmap) or past it; no GPU needed. Called with
    scores, hist, out, context_lens, stream."""
    if topk > MAX_TOPK:
        raise ValueError(f"logits_topk_paged_cute selects at most {MAX_TOPK} per row; got top-{topk}")
    arguments = (
        fake_tensor(cutlass.Float32, (_runtime(), _runtime(BLOCK_SIZE))), fake_tensor(cutlass.Int32, (_runtime(), _runtime(), BINS)),
        fake_tensor(cutlass.Int64, (_runtime(), topk)), fake_tensor(cutlass.Int32, (_runtime(),)), cuda.CUstream(0),
        next_n, span, threads, 1 << (topk - 1).bit_length(), by_bitmap,
    )
    return Program(cute.compile(launch_paged_select, *arguments), arguments)


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
