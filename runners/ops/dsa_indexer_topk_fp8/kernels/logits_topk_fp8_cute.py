"""The FP8 lightning indexer in CuTe DSL for Hopper: e4m3 warpgroup-MMA scores with the
first radix digit of the top-k fused in, then an exact radix select per query row.

dsa_indexer_topk's logits_topk_cute on DeepSeek's FP8 inputs: q and k in float8 e4m3,
one float32 scale per key token (k_scale), q's scale folded into the weights.

1. Scores (`_score_tiles`). A CTA owns ROWS query rows and one contiguous span of the
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

The kernels are compiled once per (shape, parameters) for the GPU in hand; on a machine
without one, CUTE_DSL_ARCH=sm_90a makes them compile for Hopper, and the launch then
fails for want of a GPU.
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
    BINS, BITMAP_TOKENS, MAX_TOPK, launch_select, record, select_bucket, write_hist,
)

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

# Context tokens per key tile: the M of two warpgroups' 64-row wgmma.
_TOKENS = 128
# Hopper: H200 and H100 SXM.
_DEFAULT_SMS = 132

_FP8 = torch.float8_e4m3fn
# How many MMA warpgroups take turns on the tensor cores ("cooperative": two as one).
_SCHEDULES = {"cooperative": 1, "pingpong": 2, "roundrobin": 3}
_WEIGHT_DTYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}


# --- shared device helpers ------------------------------------------------------------


# --- scores: 16-bit on the tensor cores ----------------------------------------------


@cute.jit
def _issue_mma(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrK: cute.Tensor, tCrQ: cute.Tensor,
    stage: cutlass.Int32,
):
    """Start one key tile's wgmma into acc, asynchronously. Returns the tiled MMA, whose
    accumulate flag changed, for the caller to rebind (so a branch carries it out)."""
    warpgroup.fence()
    # D / 32 k-blocks: an e4m3 wgmma takes 32 of D at a time.
    for kb in cutlass.range_constexpr(cute.size(tCrK, mode=[2])):
        # The tile's first k-block overwrites the accumulator: no zero-fill needed.
        tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(tiled_mma, acc, tCrK[(None, None, kb, stage)], tCrQ[(None, None, kb, 0)], acc)
    warpgroup.commit_group()
    return tiled_mma


@cute.jit
def _refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, loads):
    """Load the next key tile into the stage just freed, so the load overlaps the work."""
    if loads and producer.count < tile_count:
        keys.producer_acquire(producer)
        cute.copy(
            tma_k, tKgK[(None, first_tile + producer.count)], tKsK[(None, producer.index)],
            tma_bar_ptr=keys.producer_get_barrier(producer),
        )
        keys.producer_commit(producer)
        producer.advance()
    return producer


@cute.jit
def _lane_scales(
    tCcC: cute.Tensor, k_scale: cute.Tensor, tile_start: cutlass.Int32, context: cutlass.Int32,
    rows: int, quad: cutlass.Int32, reduce: str,
) -> tuple[list, list]:
    """The tokens whose sums this lane stores under REDUCE="scatter" or "mma", and their
    key scales. "scatter": lane q stores sum e = 4j + q for each j, its row half bit 1
    of e when ROWS=2, j when 4 (the accumulator's halves are tokens 8 apart). "mma":
    lane q stores row half q // 2. Loaded before the wait on the tile's MMA, the scales
    arrive while it runs (ncu: loaded after it, the multiply waiting on them was 12% of
    a consumer's time)."""
    bit1 = (quad & 2) == 2
    tokens, scales = [], []
    for j in cutlass.range_constexpr(1 if reduce == "mma" else 2 * rows // 4):
        if cutlass.const_expr(rows == 2 or reduce == "mma"):
            first, second = tCcC[(0, 0, 0), 0, 0][0], tCcC[(0, 1, 0), 0, 0][0]
            token = tile_start + cutlass.Int32(cutlass.select_(bit1, second, first))
        else:
            token = tile_start + tCcC[(0, j, 0), 0, 0][0]
        tokens.append(token)
        scales.append(k_scale[cutlass.min(token, context - 1)])
    return tokens, scales


@cute.jit
def _store_head_sums(
    head_acc: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor, row0: cutlass.Int32,
    rows: cutlass.Constexpr, quad: cutlass.Int32, token: cutlass.Int32, scale: cutlass.Float32,
):
    """Store the head-sum MMA's results, the sums of this lane's `token` times its key
    scale (a token past the context stores nothing). Lane q holds columns 2q and 2q+1
    (query rows (2q) % ROWS and (2q+1) % ROWS) of tokens t and t+8; it stores row half
    q // 2, and of it: both columns when ROWS=4, column q % 2 when ROWS=2, column 0 on
    even lanes when ROWS=1. Each sum is stored once."""
    bit0, bit1 = (quad & 1) == 1, (quad & 2) == 2
    values = []
    for i in cutlass.range_constexpr(2):
        # Value (i, half) of the compact accumulator, flat index i + 2 * half.
        values.append(cutlass.Float32(cutlass.select_(bit1, head_acc[i + 2], head_acc[i])))
    in_context = token < scores.shape[1]
    if cutlass.const_expr(rows == 4):
        for i in cutlass.range_constexpr(2):
            r = 2 * (quad & 1) + i
            if in_context and row0 + r < scores.shape[0]:
                record(scores, hist, row0 + r, token, r, scale * values[i])
    elif cutlass.const_expr(rows == 2):
        r = quad & 1
        if in_context and row0 + r < scores.shape[0]:
            record(scores, hist, row0 + r, token, r,
                    scale * cutlass.Float32(cutlass.select_(bit0, values[1], values[0])))
    else:
        if in_context and (quad & 1) == 0:
            record(scores, hist, row0, token, 0, scale * values[0])


@cute.jit
def _reduce_tile(
    acc: cute.Tensor, tCcC: cute.Tensor, weight: cute.Tensor, k_scale: cute.Tensor,
    scores: cute.Tensor, hist: cute.Tensor, tile_start: cutlass.Int32, row0: cutlass.Int32,
    rows: cutlass.Constexpr, heads: cutlass.Constexpr, quad: cutlass.Int32,
    reduce: cutlass.Constexpr, tokens: list, scales: list,
):
    """k_scale[n] * sum_h w[m, h] * relu(logit) for the tile's tokens: this thread's heads
    of each (row half, query row), then across the quad's four lanes; each score is
    stored and counted in the histogram. REDUCE as in the bf16 kernel ("shuffle": two
    butterfly shuffles per sum and a divergent store; "scatter": two accumulators per
    sum and a reduce-scatter, each lane storing its own sums, `tokens` and `scales`
    from _lane_scales)."""
    bit0, bit1 = (quad & 1) == 1, (quad & 2) == 2
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
        # Lanes swap the half of their sums whose bit 1 of e is not their own (xor 2),
        # then of the rest the half whose bit 0 is not (xor 1).
        for j in cutlass.range_constexpr(2 * rows // 4):
            kept = []
            for b0 in cutlass.range_constexpr(2):
                low, high = partials[4 * j + b0], partials[4 * j + 2 + b0]
                send = cutlass.Float32(cutlass.select_(bit1, low, high))
                keep = cutlass.Float32(cutlass.select_(bit1, high, low))
                kept.append(keep + cute.arch.shuffle_sync_bfly(send, 2))
            send = cutlass.Float32(cutlass.select_(bit0, kept[0], kept[1]))
            keep = cutlass.Float32(cutlass.select_(bit0, kept[1], kept[0]))
            score = scales[j] * (keep + cute.arch.shuffle_sync_bfly(send, 1))
            r = (4 * j + quad) % rows
            if tokens[j] < scores.shape[1] and row0 + r < scores.shape[0]:
                record(scores, hist, row0 + r, tokens[j], r, score)
    else:
        # Every lane of the quad now holds all 2*ROWS sums; lane q stores every fourth.
        for e in cutlass.range_constexpr(2 * rows):
            half, r = divmod(e, rows)
            token = tile_start + tCcC[(0, half, 0), 0, 0][0]
            if quad == e % 4 and token < scores.shape[1] and row0 + r < scores.shape[0]:
                record(scores, hist, row0 + r, token, r, k_scale[token] * partials[e])


def _tile_tokens(turns: int) -> int:
    """Tokens per key tile: both warpgroups' M together, or one's when they take turns."""
    return _TOKENS // 2 if turns > 1 else _TOKENS


def mma_rows(rows: int, heads: int, schedule: str) -> int:
    """Query rows per CTA as compiled: ROWS, as many as the accumulator's columns allow
    (ROWS*H at most 256, or 128 when three warpgroups take turns and share the
    registers; at least one row)."""
    columns = 128 if _SCHEDULES.get(schedule) == 3 else 256
    return min(rows, max(1, columns // heads))


def reduce_as_compiled(reduce: str, rows: int) -> str:
    """REDUCE as compiled: the reduce-scatter hands each lane of a quad whole sums, so it
    needs an even ROWS (ROWS=1, for heads over 128, keeps the shuffles)."""
    return "shuffle" if reduce == "scatter" and rows % 2 else reduce


def _score_threads(turns: int) -> int:
    """The two cooperative MMA warpgroups; or those taking turns and one more that loads
    (a whole warpgroup, so registers can move from it to them: nine warps alone would
    cap every thread at 168 registers, and ROWS=4's accumulators need more)."""
    return MMA_THREADS if turns == 1 else (turns + 1) * MMA_THREADS // 2


@cute.jit
def _consume(
    tiled_mma: cute.TiledMma, head_mma: cute.TiledMma, sK: cute.Tensor, sQ: cute.Tensor,
    sW: cute.Tensor, sHeadW: cute.Tensor, q_barrier, keys, producer, tma_k, tKgK, tKsK,
    k_scale: cute.Tensor, scores: cute.Tensor, sHist: cute.Tensor, first_tile: cutlass.Int32,
    tile_count: cutlass.Int32, row0: cutlass.Int32, rows: cutlass.Constexpr,
    heads: cutlass.Constexpr, stages: cutlass.Constexpr, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr,
):
    """An MMA warpgroup's work: wgmma on its key tiles, each reduced to scores. Cooperative,
    warp 0 also refills the stages freed."""
    tidx, _, _ = cute.arch.thread_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    cols = rows * heads
    tokens = _tile_tokens(turns)
    # Taking turns, each warpgroup is an MMA of its own, on every `turns`-th tile.
    thr_mma = tiled_mma.get_slice(tidx % 128 if turns > 1 else tidx)
    tCrK = tiled_mma.make_fragment_A(thr_mma.partition_A(sK))
    tCrQ = tiled_mma.make_fragment_B(thr_mma.partition_B(sQ))
    # (token, query head) of every accumulator element this thread holds.
    tCcC = thr_mma.partition_C(cute.make_identity_tensor((tokens, cols)))
    # The wgmma accumulator: value (i, half, b) of a thread is token lane/4 + 8*half
    # (+16 per warp) and column 8b + 2*(lane%4) + i, so a query row's heads are the
    # blocks b of its 64 columns, shared out over the lanes of one quad.
    acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
    assert cute.size(acc) == 4 * (cols // 8)
    quad = lane % 4
    weight, tCrW, head_acc, relu = None, None, None, None
    if cutlass.const_expr(reduce == "mma"):
        thr_head = head_mma.get_slice(tidx % 128 if turns > 1 else tidx)
        tCrW = head_mma.make_fragment_B(thr_head.partition_B(sHeadW))
        head_acc = cute.make_rmem_tensor(thr_head.partition_shape_C((tokens, HEAD_SUM_N)), cutlass.Float32)
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
    if cutlass.const_expr(turns > 1):
        # Warpgroup `turn` takes tiles turn, turn+turns, ...: while one reduces its
        # tile, the tensor cores run the others' MMAs. Named barrier 1+w is warpgroup
        # w's turn to issue, given by the warpgroup that issued the tile before, so
        # they never start in step; each arrive is matched by one wait.
        turn = warp // 4
        for _ in cutlass.range(turn, unroll=1):
            read.advance()
        if cutlass.const_expr(reduce == "mma"):
            # Tile t's head sums go to the tensor cores, then at once this warpgroup's
            # next MMA: both are queued while the sums of t are waited for and stored.
            if turn < tile_count:
                tiled_mma = _issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, turn, tile_count, turn, turns)
                warpgroup.wait_group(0)
                keys.consumer_release(read)
            for _ in cutlass.range_constexpr(turns):
                read.advance()
            for t in cutlass.range(turn, tile_count, turns, unroll=1):
                lane_tokens, lane_scales = _lane_scales(
                    tCcC, k_scale, (first_tile + t) * tokens, scores.shape[1], rows, quad, reduce)
                head_mma = head_sums(head_mma, head_acc, acc, relu, tCrW, cols)
                following = t + turns
                if following < tile_count:
                    tiled_mma = _issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, following, tile_count,
                                            turn, turns)
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                _store_head_sums(head_acc, scores, sHist, row0, rows, quad, lane_tokens[0], lane_scales[0])
                # Every iteration ends with no MMA in flight, whichever way it went.
                warpgroup.wait_group(0)
                if following < tile_count:
                    keys.consumer_release(read)
                for _ in cutlass.range_constexpr(turns):
                    read.advance()
        else:
            for t in cutlass.range(turn, tile_count, turns, unroll=1):
                tiled_mma = _issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, t, tile_count, turn, turns)
                tile_start = (first_tile + t) * tokens
                lane_tokens, lane_scales = _lane_scales(tCcC, k_scale, tile_start, scores.shape[1], rows, quad,
                                                        reduce) if reduce != "shuffle" else ([], [])
                warpgroup.wait_group(0)
                keys.consumer_release(read)
                for _ in cutlass.range_constexpr(turns):
                    read.advance()
                _reduce_tile(acc, tCcC, weight, k_scale, scores, sHist, tile_start, row0, rows, heads,
                             quad, reduce, lane_tokens, lane_scales)
    else:
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        if cutlass.const_expr(reduce == "mma"):
            # As when taking turns: tile t's head sums, then tile t+1's MMA, are queued
            # before the sums of t are waited for.
            keys.consumer_wait(read)
            tiled_mma = _issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
            read.advance()
            warpgroup.wait_group(0)
            for t in cutlass.range(tile_count, unroll=1):
                lane_tokens, lane_scales = _lane_scales(
                    tCcC, k_scale, (first_tile + t) * tokens, scores.shape[1], rows, quad, reduce)
                keys.consumer_release(release)
                release.advance()
                producer = _refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, warp == 0)
                head_mma = head_sums(head_mma, head_acc, acc, relu, tCrW, cols)
                if t + 1 < tile_count:
                    keys.consumer_wait(read)
                    tiled_mma = _issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                read.advance()
                _store_head_sums(head_acc, scores, sHist, row0, rows, quad, lane_tokens[0], lane_scales[0])
                # Every iteration ends with no MMA in flight, whichever way it went.
                warpgroup.wait_group(0)
        else:
            for t in cutlass.range(tile_count, unroll=1):
                keys.consumer_wait(read)
                tiled_mma = _issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
                read.advance()
                tile_start = (first_tile + t) * tokens
                lane_tokens, lane_scales = _lane_scales(tCcC, k_scale, tile_start, scores.shape[1], rows, quad,
                                                        reduce) if reduce != "shuffle" else ([], [])
                warpgroup.wait_group(0)
                keys.consumer_release(release)
                release.advance()
                producer = _refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, warp == 0)
                _reduce_tile(acc, tCcC, weight, k_scale, scores, sHist, tile_start, row0, rows, heads,
                             quad, reduce, lane_tokens, lane_scales)


@cute.jit
def _issue_turn(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrK: cute.Tensor, tCrQ: cute.Tensor, keys, read,
    t: cutlass.Int32, tile_count: cutlass.Int32, turn: cutlass.Int32, turns: cutlass.Constexpr,
):
    """Taking turns: wait for this warpgroup's turn (past the first tile) and tile t's keys,
    start its MMA, then hand the turn on if a tile follows. Returns the tiled MMA."""
    if t > 0:
        cute.arch.barrier(barrier_id=1 + turn, number_of_threads=MMA_THREADS)
    keys.consumer_wait(read)
    tiled_mma = _issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
    if t + 1 < tile_count:
        cute.arch.barrier_arrive(barrier_id=1 + (turn + 1) % turns, number_of_threads=MMA_THREADS)
    return tiled_mma


@cute.kernel
def _score_tiles(
    tma_k: cute.CopyAtom, k_tiles: cute.Tensor, tma_q: cute.CopyAtom, q_tiles: cute.Tensor,
    k_scale: cute.Tensor, weights: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor,
    tiled_mma: cute.TiledMma, head_mma: cute.TiledMma, k_layout: cute.ComposedLayout,
    q_layout: cute.ComposedLayout, w_layout: cute.ComposedLayout, dtype: cutlass.Constexpr,
    tiles_per_cta: cutlass.Int32, rows: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    # The select may launch once every CTA has passed here: its CTAs wait on the SMs
    # this grid leaves free and take the others as they empty, no launch gap between.
    cute.arch.griddepcontrol_launch_dependents()
    tidx, _, _ = cute.arch.thread_idx()
    group, split, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    heads = weights.shape[1]
    dim = k_tiles.shape[1]
    cols = rows * heads
    row0 = group * rows
    tokens = _tile_tokens(turns)
    threads = _score_threads(turns)
    # Cooperative: warp 0 loads between its MMAs. Taking turns: the first warp of the
    # last warpgroup, which gives its registers to the others.
    loader = turns * 4 if turns > 1 else 0
    mma_warpgroups = 1 if turns > 1 else 2
    first_tile = split * tiles_per_cta
    tile_count = cutlass.min(tiles_per_cta, cute.ceil_div(scores.shape[1], tokens) - first_tile)

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

    # Key tiles: one TMA producer thread; every warp of the warpgroups that read a
    # stage releases it.
    k_bytes = cute.size_in_bytes(dtype, cute.slice_(k_layout, (None, None, 0)))
    keys = pipeline.PipelineTmaAsync.create(
        barrier_storage=k_barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_warpgroups * 4),
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
    gK = cute.local_tile(k_tiles, (tokens, dim), (None, 0))
    tQsQ, tQgQ = cpasync.tma_partition(
        tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
    )
    tKsK, tKgK = cpasync.tma_partition(
        tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
    )

    producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    if warp == loader:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(
                q_barrier, cute.size_in_bytes(dtype, cute.slice_(q_layout, (None, None, 0)))
            )
        cute.copy(tma_q, tQgQ[(None, group)], tQsQ[(None, 0)], tma_bar_ptr=q_barrier)
    if cutlass.const_expr(turns > 1):
        # Registers move to the MMA warpgroups inside the branches that use them, so
        # the compiler gives each side its own budget.
        if warp >= loader:
            cute.arch.setmaxregister_decrease(LOADER_REGISTERS)
            if warp == loader:
                for _ in cutlass.range(tile_count, unroll=1):
                    producer = _refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, True)
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS[turns])
            _consume(tiled_mma, head_mma, sK, sQ, sW, sHeadW, q_barrier, keys, producer, tma_k, tKgK, tKsK,
                     k_scale, scores, sHist, first_tile, tile_count, row0, rows, heads, stages, turns, reduce)
    else:
        for _ in cutlass.range_constexpr(stages):
            producer = _refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, warp == 0)
        _consume(tiled_mma, head_mma, sK, sQ, sW, sHeadW, q_barrier, keys, producer, tma_k, tKgK, tKsK,
                 k_scale, scores, sHist, first_tile, tile_count, row0, rows, heads, stages, turns, reduce)

    cute.arch.sync_threads()
    write_hist(sHist, hist, split, row0, rows, threads)


@cute.jit
def _launch_scores_mma(
    q_rows: cute.Tensor, k: cute.Tensor, k_scale: cute.Tensor, weights: cute.Tensor,
    scores: cute.Tensor, hist: cute.Tensor, stream: cuda.CUstream, tiles_per_cta: cutlass.Int32,
    rows: cutlass.Constexpr, stages: cutlass.Constexpr, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr,
):
    cols = rows * weights.shape[1]
    dim = k.shape[1]
    tokens = _tile_tokens(turns)
    # Both operands are K-major: keys [N, D] are the A (M = tokens), queries [M*H, D]
    # the B (N = query heads). Cooperative: the two warpgroups split a tile's tokens.
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        k.element_type, q_rows.element_type, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, (1 if turns > 1 else 2, 1, 1), tiler_mn=(64, cols),
    )
    tile = (tokens, cols, dim)
    k_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, k.element_type, stages)
    q_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, q_rows.element_type, 1)
    load = cpasync.CopyBulkTensorTileG2SOp()
    tma_k, k_tiles = cpasync.make_tiled_tma_atom(
        load, k, cute.slice_(k_layout, (None, None, 0)), (tokens, dim)
    )
    tma_q, q_tiles = cpasync.make_tiled_tma_atom(
        load, q_rows, cute.slice_(q_layout, (None, None, 0)), (cols, dim)
    )
    # REDUCE="mma": the ReLU'd scores, bfloat16 in registers, are the A of an N=8 wgmma
    # whose K is the accumulator's columns; its B, the weights, K-major in shared memory.
    head_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, (1 if turns > 1 else 2, 1, 1), tiler_mn=(64, HEAD_SUM_N),
        a_source=warpgroup.OperandSource.RMEM,
    )
    w_layout = sm90_utils.make_smem_layout_b(
        LayoutEnum.ROW_MAJOR, (tokens, HEAD_SUM_N, cols), cutlass.BFloat16, 1
    )
    groups = cute.ceil_div(scores.shape[0], rows)
    _score_tiles(
        tma_k, k_tiles, tma_q, q_tiles, k_scale, weights, scores, hist, tiled_mma, head_mma,
        k_layout, q_layout, w_layout, k.element_type, tiles_per_cta, rows, stages, turns, reduce,
    ).launch(grid=(groups, hist.shape[0], 1), block=(_score_threads(turns), 1, 1), stream=stream)


# --- host -----------------------------------------------------------------------------


def _length():
    """A context length or a split count: a runtime value, so a new one compiles nothing."""
    return cute.sym_int32()


@functools.cache
def _sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return _DEFAULT_SMS


def _mma_splits(rows_m: int, context: int, rows: int, sms: int) -> tuple[int, int]:
    """(CTAs along the context, key tiles each): one CTA per SM, none left empty."""
    tiles = math.ceil(context / _TOKENS)
    wanted = max(1, sms // math.ceil(rows_m / rows))
    per_cta = math.ceil(tiles / wanted)
    return math.ceil(tiles / per_cta), per_cta


@functools.cache
def compiled_scores_mma(
    rows_m: int, heads: int, dim: int, rows: int, stages: int,
    weight_dtype: torch.dtype = torch.float32, schedule: str = "cooperative",
    reduce: str = "shuffle",
):
    """The e4m3 tensor-core scores kernel for one shape and parameters, any context
    length (the context and the CTAs' spans are runtime values); no GPU needed.

    `stages` counts 128-token key tiles; pingpong cuts each in two, one per warpgroup.
    Called with the tensors, the stream and the key tiles per CTA (`_mma_splits`)."""
    if rows * heads > 256 or heads % 8 or dim % 128:
        raise ValueError(f"the wgmma path needs ROWS*H <= 256, H % 8 == 0, D % 128 == 0; "
                         f"got ROWS={rows}, H={heads}, D={dim}")
    if schedule not in _SCHEDULES:
        raise ValueError(f"SCHEDULE is one of {tuple(_SCHEDULES)}; got {schedule!r}")
    turns = _SCHEDULES[schedule]
    if turns == 3 and rows * heads > 128:
        raise ValueError(f"SCHEDULE='roundrobin' keeps {MMA_REGISTERS[3]} registers a thread, room for "
                         f"ROWS*H <= 128 accumulator columns; got ROWS={rows}, H={heads}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"REDUCE is one of {REDUCTIONS}; got {reduce!r}")
    halves = 2 if turns > 1 else 1
    fp8 = cutlass.Float8E4M3FN
    arguments = (
        fake_tensor(fp8, (rows_m * heads, dim)), fake_tensor(fp8, (_length(), dim)),
        fake_tensor(cutlass.Float32, (_length(),)), fake_tensor(_WEIGHT_DTYPES[weight_dtype], (rows_m, heads)),
        fake_tensor(cutlass.Float32, (rows_m, _length())), fake_tensor(cutlass.Int32, (_length(), rows_m, BINS)),
        cuda.CUstream(0), 1, rows, stages * halves, turns,
        reduce_as_compiled(reduce, rows),
    )
    return Program(cute.compile(_launch_scores_mma, *arguments), arguments)


@functools.cache
def compiled_select(rows_m: int, topk: int, threads: int, vec: int = 4, by_bitmap: bool = True):
    """The select kernel for one shape and one `select_bucket` of context lengths, any
    length and split count within it; no GPU needed."""
    if topk > MAX_TOPK:
        raise ValueError(f"logits_topk_fp8_cute selects at most {MAX_TOPK} per row; got top-{topk}")
    # A 16-byte vector of a row starts 16-byte aligned only if the row length is a
    # multiple of four: promised to the compiler, which then emits the wide loads.
    context = cute.sym_int32(divisibility=vec)
    arguments = (
        fake_tensor(cutlass.Float32, (rows_m, context)), fake_tensor(cutlass.Int32, (_length(), rows_m, BINS)),
        fake_tensor(cutlass.Int64, (rows_m, topk)), cuda.CUstream(0), threads,
        1 << (topk - 1).bit_length(), by_bitmap, vec,
    )
    return Program(cute.compile(launch_select, *arguments), arguments)


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
    sms = _sms()
    rows = mma_rows(PARAMS["ROWS"], heads, PARAMS["SCHEDULE"])
    splits, per_cta = _mma_splits(rows_m, context, rows, sms)
    scores = torch.empty(rows_m, context, dtype=torch.float32, device=q.device)
    hist = torch.empty(splits, rows_m, BINS, dtype=torch.int32, device=q.device)
    out = torch.empty(rows_m, topk, dtype=torch.int64, device=q.device)
    stream = current_stream(q)
    kernel = compiled_scores_mma(rows_m, heads, dim, rows, PARAMS["STAGES"], weights.dtype,
                                 PARAMS["SCHEDULE"], PARAMS["REDUCE"])
    halves = 2 if _SCHEDULES[PARAMS["SCHEDULE"]] > 1 else 1
    kernel(q.view(rows_m * heads, dim), k, k_scale, weights, scores, hist, stream, per_cta * halves)
    compiled_select(rows_m, topk, PARAMS["SELECT_THREADS"], *select_bucket(context))(scores, hist, out, stream)
    return out
