"""The scores kernel of the CuTe DSL lightning indexers (logits_topk_cute,
logits_topk_fp8_cute and their paged forms), in pieces each kernel puts together.

A CTA owns ROWS query rows and a span of key tiles. The rows' queries arrive once by TMA
and stay in shared memory; the keys stream through a TMA pipeline. Warpgroups issue
wgmma with the tokens as the MMA's M (64 per warpgroup), the ROWS*H query heads as its
N and D as its K, accumulated in float32, so all heads of one token sit in one quad of
lanes: ReLU, the per-head weights and the sum over heads happen in registers plus
shuffles (REDUCE="shuffle" or "scatter") or on the tensor cores (REDUCE="mma"). Each
score goes to a float32 buffer and into the CTA's histogram of its first radix digit
(indexer_select.py), which the CTA writes out for the select.

What tells the four kernels apart is a handful of arguments here:

- the keys' dtype: 16-bit or e4m3 (the wgmma takes 16 or 32 of D per instruction);
- `k_scale`: None, or the e4m3 keys' scale per token, which multiplies each token's
  summed score once (it is positive and shared by every head, so relu(s * x) =
  s * relu(x)); read ahead of the MMA whose sums it scales, so the load arrives while
  the MMA runs;
- dense or paged: a dense CTA's rows and tokens are bounded by the scores' shape
  (`seq_end` None) and its key tiles follow each other; a paged CTA serves one
  sequence, its tile t is cache block `blocks[t]` of BLOCK_SIZE tokens (a paged
  kernel's key scales are read from that block too), and row r stores only its causal
  prefix, tokens < seq_end + r.

SCHEDULE says how the MMA warpgroups share the tensor cores: "cooperative" (dense
only), two on one tile of 128 tokens, then both reducing it while the tensor cores
wait; "pingpong", each on every other tile of 64 tokens, fed by a warpgroup that loads,
one reducing its tile while the other's MMA runs (named barriers hand the MMA issue
back and forth, as in CUTLASS's pingpong kernels); "roundrobin", three in turn, so a
reduction may take twice an MMA and still be hidden (their accumulators share the
registers: ROWS*H <= 128).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from runners.kernel_lib.cute_host import fake_tensor, runtime_int
from runners.kernel_lib.indexer_select import BINS, BLOCK_SIZE, record, write_hist

MMA_THREADS = 256
REDUCTIONS = ("shuffle", "scatter", "mma")
# How many MMA warpgroups take turns on the tensor cores ("cooperative": two as one).
SCHEDULES = {"cooperative": 1, "pingpong": 2, "roundrobin": 3}
# The paged kernels' schedules: "cooperative"'s 128-token tiles would straddle two cache
# blocks.
PAGED_SCHEDULES = {"pingpong": 2, "roundrobin": 3}
# Context tokens per key tile: the M of two warpgroups' 64-row wgmma (one warpgroup's
# when they take turns: `tile_tokens`).
TILE_TOKENS = 128
# REDUCE="mma": the head-weighted sum is a second wgmma, m64n8k16 with the ReLU'd scores
# as its A (bfloat16, in registers) and the weights as its B; column n of B holds query
# row n % ROWS's weights, so every lane of a quad ends with whole sums.
HEAD_SUM_N = 8
# Registers per thread once the loading warpgroup gives its own up: 40 for it, and for
# each MMA warpgroup as many as fill the SM's 64K (multiples of 8): 232 when two take
# turns, 152 when three do (their accumulators then hold at most 128 columns).
LOADER_REGISTERS = 40
MMA_REGISTERS = {2: 232, 3: 152}


# --- the MMA ----------------------------------------------------------------------------


@cute.jit
def issue_mma(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrK: cute.Tensor, tCrQ: cute.Tensor,
    stage: cutlass.Int32,
):
    """Start one key tile's wgmma into acc, asynchronously: one per k-block of D (16 of it
    for 16-bit keys, 32 for e4m3). Returns the tiled MMA, whose accumulate flag changed,
    for the caller to rebind (so a branch carries it out)."""
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(tCrK, mode=[2])):
        # The tile's first k-block overwrites the accumulator: no zero-fill needed.
        tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(tiled_mma, acc, tCrK[(None, None, kb, stage)], tCrQ[(None, None, kb, 0)], acc)
    warpgroup.commit_group()
    return tiled_mma


@cute.jit
def issue_turn(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrK: cute.Tensor, tCrQ: cute.Tensor, keys, read,
    t: cutlass.Int32, tile_count: cutlass.Int32, turn: cutlass.Int32, turns: cutlass.Constexpr,
):
    """Taking turns: wait for this warpgroup's turn (past the first tile) and tile t's keys,
    start its MMA, then hand the turn on if a tile follows. Returns the tiled MMA."""
    if t > 0:
        cute.arch.barrier(barrier_id=1 + turn, number_of_threads=MMA_THREADS)
    keys.consumer_wait(read)
    tiled_mma = issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
    if t + 1 < tile_count:
        cute.arch.barrier_arrive(barrier_id=1 + (turn + 1) % turns, number_of_threads=MMA_THREADS)
    return tiled_mma


@cute.jit
def refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, loads, blocks=None):
    """Load the next key tile into the stage just freed, so the load overlaps the work
    (`loads`: whether this thread's warp is the one that loads). The CTA's tile t is
    tile first_tile + t of the keys, or with a block table `blocks` (paged) cache block
    blocks[first_tile + t]."""
    if loads and producer.count < tile_count:
        keys.producer_acquire(producer)
        tile = first_tile + producer.count
        if cutlass.const_expr(blocks is not None):
            tile = blocks[tile]
        cute.copy(
            tma_k, tKgK[(None, tile)], tKsK[(None, producer.index)],
            tma_bar_ptr=keys.producer_get_barrier(producer),
        )
        keys.producer_commit(producer)
        producer.advance()
    return producer


@dsl_user_op
def relu_bf16x2(low, high, *, loc=None, ip=None) -> cutlass.Int32:
    """relu(low) and relu(high) rounded to bfloat16, packed low first: one cvt."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(),
        [cutlass.Float32(low).ir_value(loc=loc, ip=ip), cutlass.Float32(high).ir_value(loc=loc, ip=ip)],
        "cvt.rn.relu.bf16x2.f32 $0, $2, $1;",
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def as_operand_a(cols: int) -> cute.Layout:
    """An accumulator's ((2, 2, cols/8), 1, 1) registers, compact, seen as a 16-bit wgmma
    A fragment ((2, 2, 2), 1, cols/16): a thread's values of accumulator columns
    16kk..16kk+15 sit where the A operand of k-block kk wants them (the register reuse
    FlashAttention-3 makes of P)."""
    return cute.make_layout(((2, 2, 2), 1, cols // 16), stride=((1, 2, 4), 0, 8))


@cute.jit
def head_sums(
    head_mma: cute.TiledMma, head_acc: cute.Tensor, acc: cute.Tensor, relu: cute.Tensor,
    tCrW: cute.Tensor, cols: cutlass.Constexpr,
):
    """head_acc = relu(acc) @ W on the tensor cores: one cvt per two scores, then
    cols/16 wgmma of m64n8k16. The caller waits for them."""
    packed = cute.recast_tensor(relu, cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = relu_bf16x2(acc[2 * i], acc[2 * i + 1])
    operand = cute.make_tensor(relu.iterator, as_operand_a(cols))
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cols // 16):
        head_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(head_mma, head_acc, operand[(None, None, kb)], tCrW[(None, None, kb, 0)], head_acc)
    warpgroup.commit_group()
    return head_mma


# --- where a lane's sums go -------------------------------------------------------------


@cute.jit
def lane_token(
    tCcC: cute.Tensor, tile_start: cutlass.Int32, rows: cutlass.Constexpr, quad: cutlass.Int32,
    j: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    """(token, its slot in the tile) whose sums this lane stores: under REDUCE="scatter"
    lane q stores sum e = 4j + q, of row half bit 1 of e when ROWS=2, j when 4 (the
    accumulator's halves are tokens 8 apart); under "mma" row half q // 2."""
    if cutlass.const_expr(rows == 2 or reduce == "mma"):
        first, second = tCcC[(0, 0, 0), 0, 0][0], tCcC[(0, 1, 0), 0, 0][0]
        slot = cutlass.Int32(cutlass.select_((quad & 2) == 2, second, first))
    else:
        slot = tCcC[(0, j, 0), 0, 0][0]
    return tile_start + slot, slot


@cute.jit
def key_scale(k_scale, token, slot, block, context):
    """The key scale of `token`, slot `slot` of its tile: k_scale[token] (dense; with
    `context`, clamped inside it, for a read ahead of the check that the token is
    there), or kv_scale[block * BLOCK_SIZE + slot] of the tile's cache block `block`
    (paged: a block holds a scale in every slot, the tail of a sequence's last block
    too). None where the kernel has no key scales."""
    scale = None
    if cutlass.const_expr(k_scale is not None and block is not None):
        scale = k_scale[block * BLOCK_SIZE + slot]
    elif cutlass.const_expr(k_scale is not None and context is not None):
        scale = k_scale[cutlass.min(token, context - 1)]
    elif cutlass.const_expr(k_scale is not None):
        scale = k_scale[token]
    return scale


@cute.jit
def lane_stores(
    tCcC: cute.Tensor, tile_start: cutlass.Int32, rows: cutlass.Constexpr, quad: cutlass.Int32,
    reduce: cutlass.Constexpr, k_scale, block, context,
) -> tuple[list, list]:
    """The tokens whose sums this lane stores under REDUCE="scatter" or "mma"
    (`lane_token`), and their key scales (`key_scale`), read before the wait on the MMA
    whose sums they scale: they arrive while it runs (ncu: loaded after it, the multiply
    waiting on them was 12% of a consumer's time in the dense e4m3 kernel)."""
    tokens, scales = [], []
    for j in cutlass.range_constexpr(1 if reduce == "mma" else 2 * rows // 4):
        token, slot = lane_token(tCcC, tile_start, rows, quad, j, reduce)
        tokens.append(token)
        scales.append(key_scale(k_scale, token, slot, block, context))
    return tokens, scales


def _scaled(scale, value):
    """A token's summed score times its key scale, where the kernel has them."""
    return value if scale is None else scale * value


@cute.jit
def _in_context(scores: cute.Tensor, token: cutlass.Int32, seq_end):
    """Whether `token` is one a row's score is stored for: inside the scores' N (dense,
    seq_end None), or below the sequence's first row's prefix end (paged)."""
    bound = scores.shape[1] if cutlass.const_expr(seq_end is None) else seq_end
    return token < bound


@cute.jit
def _stored(scores: cute.Tensor, row0: cutlass.Int32, r, token: cutlass.Int32, seq_end, lane_owns=None):
    """Whether the CTA's row r stores its score of `token`: row and token inside the
    scores [M, N] (dense), or the token in row r's causal prefix, tokens < seq_end + r
    (paged; the CTA's rows are one sequence's, always there). `lane_owns`: whether
    this lane is the one that stores it, where that is a question, tested first (the
    conditions are and-ed in the order the generated code has always had)."""
    if cutlass.const_expr(seq_end is None):
        if cutlass.const_expr(lane_owns is None):
            stored = _in_context(scores, token, seq_end)
        else:
            stored = lane_owns and _in_context(scores, token, seq_end)
        stored = stored and row0 + r < scores.shape[0]
    elif cutlass.const_expr(lane_owns is None):
        stored = token < seq_end + r
    else:
        stored = lane_owns and token < seq_end + r
    return stored


@cute.jit
def store_head_sums(
    head_acc: cute.Tensor, scores: cute.Tensor, hist: cute.Tensor, row0: cutlass.Int32,
    rows: cutlass.Constexpr, quad: cutlass.Int32, token: cutlass.Int32, scale, seq_end,
):
    """Store the head-sum MMA's results, the sums of this lane's `token` (times its key
    `scale`, if any), where `_stored`. Lane q holds columns 2q and 2q+1 (query rows
    (2q) % ROWS and (2q+1) % ROWS) of tokens t and t+8; it stores row half q // 2, and
    of it: both columns when ROWS=4, column q % 2 when ROWS=2, column 0 on even lanes
    when ROWS=1. Each sum is stored once."""
    bit0, bit1 = (quad & 1) == 1, (quad & 2) == 2
    values = []
    for i in cutlass.range_constexpr(2):
        # Value (i, half) of the compact accumulator, flat index i + 2 * half.
        values.append(cutlass.Float32(cutlass.select_(bit1, head_acc[i + 2], head_acc[i])))
    if cutlass.const_expr(rows == 4):
        for i in cutlass.range_constexpr(2):
            r = 2 * (quad & 1) + i
            if _stored(scores, row0, r, token, seq_end):
                record(scores, hist, row0 + r, token, r, _scaled(scale, values[i]))
    elif cutlass.const_expr(rows == 2):
        r = quad & 1
        if _stored(scores, row0, r, token, seq_end):
            record(scores, hist, row0 + r, token, r,
                   _scaled(scale, cutlass.Float32(cutlass.select_(bit0, values[1], values[0]))))
    else:
        if _in_context(scores, token, seq_end) and (quad & 1) == 0:
            record(scores, hist, row0, token, 0, _scaled(scale, values[0]))


@cute.jit
def reduce_tile(
    acc: cute.Tensor, tCcC: cute.Tensor, weight: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, first_tile: cutlass.Int32, t: cutlass.Int32, row0: cutlass.Int32,
    rows: cutlass.Constexpr, heads: cutlass.Constexpr, quad: cutlass.Int32, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr, seq_end, k_scale, ahead,
):
    """sum_h w[m, h] * relu(logit) for the tile's tokens (times each token's key scale,
    if any): this thread's heads of each (row half, query row), then across the quad's
    four lanes; each sum is stored where `_stored` and counted in the histogram.
    REDUCE="shuffle": two butterfly shuffles per sum, every lane ends with all of them
    and stores one under a divergent branch (its key scale read there). REDUCE="scatter":
    two accumulators per sum (half the dependent latency), then a reduce-scatter that
    leaves lane q with the sums numbered q and q+4, three shuffles for every four sums,
    and each lane stores its own with no divergence. `ahead`: what `_read_ahead` read
    of CTA tile t before its MMA was waited for, or None (no key scales: the tile's
    start and each lane's tokens are worked out here)."""
    if cutlass.const_expr(ahead is None):
        tile_start, block, tokens, scales = (first_tile + t) * tile_tokens(turns), None, None, None
    else:
        tile_start, block, tokens, scales = ahead
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
            score = _scaled(None if scales is None else scales[j], keep + cute.arch.shuffle_sync_bfly(send, 1))
            r = (4 * j + quad) % rows
            if cutlass.const_expr(tokens is None):
                token, _ = lane_token(tCcC, tile_start, rows, quad, j, reduce)
            else:
                token = tokens[j]
            if _stored(scores, row0, r, token, seq_end):
                record(scores, hist, row0 + r, token, r, score)
    else:
        # Every lane of the quad now holds all 2*ROWS sums; lane q stores every fourth.
        for e in cutlass.range_constexpr(2 * rows):
            half, r = divmod(e, rows)
            slot = tCcC[(0, half, 0), 0, 0][0]
            token = tile_start + slot
            if _stored(scores, row0, r, token, seq_end, quad == e % 4):
                record(scores, hist, row0 + r, token, r, _scaled(key_scale(k_scale, token, slot, block, None), partials[e]))


# --- an MMA warpgroup's work ------------------------------------------------------------


@cute.jit
def consume(
    tiled_mma: cute.TiledMma, head_mma: cute.TiledMma, sK: cute.Tensor, sQ: cute.Tensor,
    sW: cute.Tensor, sHeadW: cute.Tensor, q_barrier, keys, producer, tma_k, tKgK, tKsK,
    scores: cute.Tensor, sHist: cute.Tensor, first_tile: cutlass.Int32, tile_count: cutlass.Int32,
    row0: cutlass.Int32, rows: cutlass.Constexpr, heads: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr, seq_end, k_scale, blocks,
):
    """An MMA warpgroup's work: wgmma on its key tiles, each reduced to scores. Taking
    turns, every `turns`-th tile from its own turn, the loading warpgroup filling the
    stages; cooperative, every tile, warp 0 also refilling the stages freed. `blocks`:
    a paged kernel's block table, where its key scales are read from."""
    tidx, _, _ = cute.arch.thread_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    cols = rows * heads
    tokens = tile_tokens(turns)
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
    # Dense key scales past the context are read clamped inside it.
    context = scores.shape[1] if cutlass.const_expr(blocks is None) else None

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
                tiled_mma = issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, turn, tile_count, turn, turns)
                warpgroup.wait_group(0)
                keys.consumer_release(read)
            for _ in cutlass.range_constexpr(turns):
                read.advance()
            for t in cutlass.range(turn, tile_count, turns, unroll=1):
                tile = first_tile + t
                block = _tile_block(blocks, tile)
                lane_tokens, lane_scales = lane_stores(tCcC, tile * tokens, rows, quad, reduce, k_scale, block, context)
                head_mma = head_sums(head_mma, head_acc, acc, relu, tCrW, cols)
                following = t + turns
                if following < tile_count:
                    tiled_mma = issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, following, tile_count,
                                           turn, turns)
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                store_head_sums(head_acc, scores, sHist, row0, rows, quad, lane_tokens[0], lane_scales[0], seq_end)
                # Every iteration ends with no MMA in flight, whichever way it went.
                warpgroup.wait_group(0)
                if following < tile_count:
                    keys.consumer_release(read)
                for _ in cutlass.range_constexpr(turns):
                    read.advance()
        else:
            for t in cutlass.range(turn, tile_count, turns, unroll=1):
                tiled_mma = issue_turn(tiled_mma, acc, tCrK, tCrQ, keys, read, t, tile_count, turn, turns)
                ahead = _read_ahead(tCcC, first_tile, t, rows, quad, turns, reduce, k_scale, blocks, context)
                warpgroup.wait_group(0)
                keys.consumer_release(read)
                for _ in cutlass.range_constexpr(turns):
                    read.advance()
                reduce_tile(acc, tCcC, weight, scores, sHist, first_tile, t, row0, rows, heads, quad, turns,
                            reduce, seq_end, k_scale, ahead)
    else:
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        if cutlass.const_expr(reduce == "mma"):
            # As when taking turns: tile t's head sums, then tile t+1's MMA, are queued
            # before the sums of t are waited for.
            keys.consumer_wait(read)
            tiled_mma = issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
            read.advance()
            warpgroup.wait_group(0)
            for t in cutlass.range(tile_count, unroll=1):
                lane_tokens, lane_scales = lane_stores(
                    tCcC, (first_tile + t) * tokens, rows, quad, reduce, k_scale, None, context)
                keys.consumer_release(release)
                release.advance()
                producer = refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, warp == 0)
                head_mma = head_sums(head_mma, head_acc, acc, relu, tCrW, cols)
                if t + 1 < tile_count:
                    keys.consumer_wait(read)
                    tiled_mma = issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                read.advance()
                store_head_sums(head_acc, scores, sHist, row0, rows, quad, lane_tokens[0], lane_scales[0], seq_end)
                # Every iteration ends with no MMA in flight, whichever way it went.
                warpgroup.wait_group(0)
        else:
            for t in cutlass.range(tile_count, unroll=1):
                keys.consumer_wait(read)
                tiled_mma = issue_mma(tiled_mma, acc, tCrK, tCrQ, read.index)
                read.advance()
                ahead = _read_ahead(tCcC, first_tile, t, rows, quad, turns, reduce, k_scale, None, context)
                warpgroup.wait_group(0)
                keys.consumer_release(release)
                release.advance()
                producer = refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, warp == 0)
                reduce_tile(acc, tCcC, weight, scores, sHist, first_tile, t, row0, rows, heads, quad, turns,
                            reduce, seq_end, k_scale, ahead)


@cute.jit
def _tile_block(blocks, tile: cutlass.Int32):
    """The cache block of the CTA's tile, where a paged kernel reads its key scales."""
    block = None
    if cutlass.const_expr(blocks is not None):
        block = blocks[tile]
    return block


@cute.jit
def _read_ahead(tCcC, first_tile, t, rows, quad, turns, reduce, k_scale, blocks, context):
    """Where there are key scales, what is read of CTA tile t before its MMA is waited
    for: (its first token, its cache block (paged), and where a lane stores its own
    sums the tokens and scales of `lane_stores`; under REDUCE="shuffle" each lane reads
    its scale where it stores). None where there are none: the reduction then works
    the tile's start out where it is used."""
    ahead = None
    if cutlass.const_expr(k_scale is not None):
        tile_start = (first_tile + t) * tile_tokens(turns)
        block = _tile_block(blocks, first_tile + t)
        tokens, scales = None, None
        if cutlass.const_expr(reduce != "shuffle"):
            tokens, scales = lane_stores(tCcC, tile_start, rows, quad, reduce, k_scale, block, context)
        ahead = (tile_start, block, tokens, scales)
    return ahead


# --- one CTA ----------------------------------------------------------------------------


@cute.jit
def _fill_weights(
    weights: cute.Tensor, sW, sHeadW, tidx: cutlass.Int32, row0: cutlass.Int32,
    rows: cutlass.Constexpr, heads: cutlass.Constexpr, threads: cutlass.Constexpr,
    reduce: cutlass.Constexpr, check_rows: cutlass.Constexpr,
):
    """The CTA's rows' weights into shared memory: [ROWS*H] float32 for the CUDA-core
    reductions, or the head-sum MMA's B, [8, ROWS*H] bfloat16, whose column n holds row
    n % ROWS's weights under that row's heads and zeros elsewhere. With `check_rows`,
    the weights of rows past M are zero, so those rows score 0 and are never stored."""
    cols = rows * heads
    if cutlass.const_expr(reduce != "mma"):
        for i in cutlass.range(tidx, cols, threads, unroll=1):
            if cutlass.const_expr(check_rows):
                weight = cutlass.Float32(0.0)
                if row0 + i // heads < weights.shape[0]:
                    weight = weights[row0 + i // heads, i % heads].to(cutlass.Float32)
                sW[i] = weight
            else:
                sW[i] = weights[row0 + i // heads, i % heads]
    else:
        for i in cutlass.range(tidx, HEAD_SUM_N * cols, threads, unroll=1):
            n, c = i // cols, i % cols
            weight = cutlass.Float32(0.0)
            if c // heads == n % rows and (not check_rows or row0 + c // heads < weights.shape[0]):
                weight = weights[row0 + c // heads, c % heads].to(cutlass.Float32)
            sHeadW[n, c, 0] = weight.to(cutlass.BFloat16)
        # Written by threads, read by wgmma: the async proxy must see the stores.
        cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def _run_cta(
    tma_k, k_tiles, tma_q, q_tiles, k_scale, weights, scores, hist, tiled_mma, head_mma, k_layout,
    q_layout, w_layout, dtype: cutlass.Constexpr, tidx, warp, queries, split, row0, first_tile,
    tile_count, rows: cutlass.Constexpr, stages: cutlass.Constexpr, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr, seq_end, blocks, check_rows: cutlass.Constexpr,
):
    """A CTA's scores and histograms, `queries` the index of its queries' tile."""
    heads = weights.shape[1]
    dim = k_tiles.shape[1]
    cols = rows * heads
    tokens = tile_tokens(turns)
    threads = score_threads(turns)
    # Cooperative: warp 0 loads between its MMAs. Taking turns: the first warp of the
    # last warpgroup, which gives its registers to the others.
    loader = turns * 4 if turns > 1 else 0
    mma_warpgroups = 1 if turns > 1 else 2

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
    _fill_weights(weights, sW, sHeadW, tidx, row0, rows, heads, threads, reduce, check_rows)
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
        cute.copy(tma_q, tQgQ[(None, queries)], tQsQ[(None, 0)], tma_bar_ptr=q_barrier)
    if cutlass.const_expr(turns > 1):
        # Registers move to the MMA warpgroups inside the branches that use them, so
        # the compiler gives each side its own budget.
        if warp >= loader:
            cute.arch.setmaxregister_decrease(LOADER_REGISTERS)
            if warp == loader:
                for _ in cutlass.range(tile_count, unroll=1):
                    producer = refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, True, blocks)
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS[turns])
            consume(tiled_mma, head_mma, sK, sQ, sW, sHeadW, q_barrier, keys, producer, tma_k, tKgK, tKsK,
                    scores, sHist, first_tile, tile_count, row0, rows, heads, stages, turns, reduce,
                    seq_end, k_scale, None if k_scale is None else blocks)
    else:
        for _ in cutlass.range_constexpr(stages):
            producer = refill(keys, producer, tma_k, tKgK, tKsK, first_tile, tile_count, warp == 0)
        consume(tiled_mma, head_mma, sK, sQ, sW, sHeadW, q_barrier, keys, producer, tma_k, tKgK, tKsK,
                scores, sHist, first_tile, tile_count, row0, rows, heads, stages, turns, reduce,
                seq_end, k_scale, None)

    cute.arch.sync_threads()
    write_hist(sHist, hist, split, row0, rows, threads)


@cute.jit
def dense_cta(
    tma_k, k_tiles, tma_q, q_tiles, k_scale, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, tiled_mma, head_mma, k_layout, q_layout, w_layout, dtype: cutlass.Constexpr,
    tiles_per_cta: cutlass.Int32, rows: cutlass.Constexpr, stages: cutlass.Constexpr,
    turns: cutlass.Constexpr, reduce: cutlass.Constexpr,
):
    """A dense indexer's scores CTA (the body of its `@cute.kernel`): CTA (group, split)
    scores query rows group*ROWS.. against key tiles split*tiles_per_cta.., the grid
    (row groups) x (context spans). `k_scale`: the e4m3 keys' scales, or None."""
    # The select may launch once every CTA has passed here: its CTAs wait on the SMs
    # this grid leaves free and take the others as they empty, no launch gap between.
    cute.arch.griddepcontrol_launch_dependents()
    tidx, _, _ = cute.arch.thread_idx()
    group, split, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    row0 = group * rows
    first_tile = split * tiles_per_cta
    tile_count = cutlass.min(tiles_per_cta, cute.ceil_div(scores.shape[1], tile_tokens(turns)) - first_tile)
    _run_cta(tma_k, k_tiles, tma_q, q_tiles, k_scale, weights, scores, hist, tiled_mma, head_mma, k_layout,
             q_layout, w_layout, dtype, tidx, warp, group, split, row0, first_tile, tile_count, rows, stages,
             turns, reduce, None, None, True)


@cute.jit
def paged_cta(
    tma_k, k_tiles, tma_q, q_tiles, k_scale, weights: cute.Tensor, scores: cute.Tensor,
    hist: cute.Tensor, tiled_mma, head_mma, k_layout, q_layout, w_layout, block_table: cute.Tensor,
    context_lens: cute.Tensor, dtype: cutlass.Constexpr, tiles_per_cta: cutlass.Constexpr,
    rows: cutlass.Constexpr, stages: cutlass.Constexpr, turns: cutlass.Constexpr,
    reduce: cutlass.Constexpr, check_rows: cutlass.Constexpr,
):
    """A paged indexer's scores CTA (the body of its `@cute.kernel`): CTA (split, seq)
    scores sequence seq's ROWS = next_n query rows, which share its keys, against
    tiles_per_cta cache blocks from split * tiles_per_cta. `k_scale`: the e4m3 keys'
    scales [blocks * BLOCK_SIZE], or None. `check_rows`: check the weights' rows against
    M as the dense kernels must (a paged CTA's rows are always there)."""
    # The select may launch once every CTA has passed here: its CTAs wait on the SMs
    # this grid leaves free and take the others as they empty, no launch gap between.
    cute.arch.griddepcontrol_launch_dependents()
    tidx, _, _ = cute.arch.thread_idx()
    split, seq, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    row0 = seq * rows
    # Read on the device at run time: nothing here depends on a length at compile time,
    # and a CUDA graph replays with whatever lengths the buffer holds then.
    seq_len = context_lens[seq]
    # Row r of the sequence sees its first seq_end + r tokens.
    seq_end = seq_len - rows + 1
    first_tile = split * tiles_per_cta
    tile_count = cutlass.min(tiles_per_cta, cute.ceil_div(seq_len, BLOCK_SIZE) - first_tile)
    blocks = block_table[seq, None]
    # A span past the sequence's end (or an empty, padding sequence) has nothing to do
    # and writes nothing: the select sums only the spans of each row's own prefix.
    if tile_count > 0:
        _run_cta(tma_k, k_tiles, tma_q, q_tiles, k_scale, weights, scores, hist, tiled_mma, head_mma,
                 k_layout, q_layout, w_layout, dtype, tidx, warp, seq, split, row0, first_tile, tile_count,
                 rows, stages, turns, reduce, seq_end, blocks, check_rows)


# --- host -------------------------------------------------------------------------------


def tile_tokens(turns: int) -> int:
    """Tokens per key tile: both warpgroups' M together, or one's when they take turns."""
    return TILE_TOKENS // 2 if turns > 1 else TILE_TOKENS


def score_threads(turns: int) -> int:
    """The two cooperative MMA warpgroups; or those taking turns and one more that loads
    (a whole warpgroup, so registers can move from it to them: nine warps alone would
    cap every thread at 168 registers, and ROWS=4's accumulators need more)."""
    return MMA_THREADS if turns == 1 else (turns + 1) * MMA_THREADS // 2


def mma_rows(rows: int, heads: int, schedule: str) -> int:
    """Query rows per CTA as compiled: ROWS, as many as the accumulator's columns allow
    (ROWS*H at most 256, or 128 when three warpgroups take turns and share the
    registers; at least one row)."""
    columns = 128 if SCHEDULES.get(schedule) == 3 else 256
    return min(rows, max(1, columns // heads))


def reduce_as_compiled(reduce: str, rows: int) -> str:
    """REDUCE as compiled: the reduce-scatter hands each lane of a quad whole sums, so it
    needs an even ROWS (ROWS=1, for heads over 128 or next_n = 1, keeps the shuffles)."""
    return "shuffle" if reduce == "scatter" and rows % 2 else reduce


def dense_turns(rows: int, heads: int, dim: int, schedule: str, reduce: str, dim_multiple: int) -> int:
    """The MMA warpgroups taking turns for a dense kernel's point; ValueError for a shape
    or point it cannot run. `dim_multiple`: what D must be a multiple of (64 for 16-bit
    keys, 128 for e4m3, whose 128-byte swizzle and k-blocks of 32 need it)."""
    if rows * heads > 256 or heads % 8 or dim % dim_multiple:
        raise ValueError(f"the wgmma path needs ROWS*H <= 256, H % 8 == 0, D % {dim_multiple} == 0; "
                         f"got ROWS={rows}, H={heads}, D={dim}")
    if schedule not in SCHEDULES:
        raise ValueError(f"SCHEDULE is one of {tuple(SCHEDULES)}; got {schedule!r}")
    turns = SCHEDULES[schedule]
    if turns == 3 and rows * heads > 128:
        raise ValueError(f"SCHEDULE='roundrobin' keeps {MMA_REGISTERS[3]} registers a thread, room for "
                         f"ROWS*H <= 128 accumulator columns; got ROWS={rows}, H={heads}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"REDUCE is one of {REDUCTIONS}; got {reduce!r}")
    return turns


def paged_turns(heads: int, dim: int, next_n: int, schedule: str, reduce: str, span: int,
                dim_multiple: int) -> int:
    """The MMA warpgroups taking turns for a paged kernel's point; ValueError for a shape
    or point it cannot run (`dim_multiple` as in `dense_turns`)."""
    if schedule not in PAGED_SCHEDULES:
        raise ValueError(f"SCHEDULE is one of {tuple(PAGED_SCHEDULES)}; got {schedule!r}")
    turns = PAGED_SCHEDULES[schedule]
    columns = 128 if turns == 3 else 256
    if next_n * heads > columns or heads % 8 or dim % dim_multiple:
        raise ValueError(f"SCHEDULE={schedule!r} needs next_n*H <= {columns}, H % 8 == 0, "
                         f"D % {dim_multiple} == 0; got next_n={next_n}, H={heads}, D={dim}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"REDUCE is one of {REDUCTIONS}; got {reduce!r}")
    if span % BLOCK_SIZE:
        raise ValueError(f"SPAN is whole {BLOCK_SIZE}-token blocks; got {span}")
    return turns


def dense_compile_args(
    element, heads: int, dim: int, weight_element, rows: int, stages: int, turns: int,
    reduce: str, key_scales: bool,
) -> tuple:
    """What a dense kernel's launch function is compiled with (`cute.compile(launch,
    *args)`): q [M*H, D] and k [N, D] of `element`, with `key_scales` k_scale [N] float32,
    weights [M, H], scores [M, N], hist [splits, M, BINS], the stream, the key tiles per
    CTA (a runtime value), ROWS, `stages` 128-token tiles counted in the schedule's own
    (64 tokens when warpgroups take turns), the turns and REDUCE as compiled. M, N and
    the splits are runtime values: a new context length or batch of query rows compiles
    nothing (a serving engine's indexer sees both change every step; the CTAs check their
    rows against M)."""
    scales = (fake_tensor(cutlass.Float32, (runtime_int(),)),) if key_scales else ()
    return (
        fake_tensor(element, (runtime_int(), dim)), fake_tensor(element, (runtime_int(), dim)), *scales,
        fake_tensor(weight_element, (runtime_int(), heads)), fake_tensor(cutlass.Float32, (runtime_int(), runtime_int())),
        fake_tensor(cutlass.Int32, (runtime_int(), runtime_int(), BINS)), cuda.CUstream(0), 1, rows,
        stages * (2 if turns > 1 else 1), turns, reduce_as_compiled(reduce, rows),
    )


def paged_compile_args(
    element, heads: int, dim: int, next_n: int, stages: int, span: int, turns: int, reduce: str,
    key_scales: bool,
) -> tuple:
    """What a paged kernel's launch function is compiled with: q [B*next_n*H, D] and the
    cache [blocks*64, D] of `element`, with `key_scales` kv_scale [blocks*64] float32,
    weights [B*next_n, H] float32, scores [B*next_n, W], hist [spans, B*next_n, BINS],
    block_table [B, max_blocks], context_lens [B], the stream, the cache blocks per CTA,
    ROWS = next_n, `stages` 128-token tiles counted in 64-token ones, the turns and
    REDUCE as compiled. Every size but H and D is a runtime value; the cache's and the
    scores' rows are promised whole blocks (forward checks the cache's shape)."""
    scales = (fake_tensor(cutlass.Float32, (runtime_int(BLOCK_SIZE),)),) if key_scales else ()
    return (
        fake_tensor(element, (runtime_int(), dim)), fake_tensor(element, (runtime_int(BLOCK_SIZE), dim)), *scales,
        fake_tensor(cutlass.Float32, (runtime_int(), heads)),
        fake_tensor(cutlass.Float32, (runtime_int(), runtime_int(BLOCK_SIZE))),
        fake_tensor(cutlass.Int32, (runtime_int(), runtime_int(), BINS)),
        fake_tensor(cutlass.Int32, (runtime_int(), runtime_int())), fake_tensor(cutlass.Int32, (runtime_int(),)),
        cuda.CUstream(0), span // BLOCK_SIZE, next_n, stages * 2, turns, reduce_as_compiled(reduce, next_n),
    )


def mma_operands(q_rows: cute.Tensor, k: cute.Tensor, cols: int, tokens: int, stages: int, turns: int):
    """What a scores kernel is launched with, from the host: ((tma_k, k_tiles, tma_q,
    q_tiles), (tiled_mma, head_mma, k_layout, q_layout, w_layout)). Both operands are
    K-major: keys [N, D] are the A (M = tokens), queries [M*H, D] the B (N = query
    heads); cooperative, the two warpgroups split a tile's tokens. Under REDUCE="mma"
    the ReLU'd scores, bfloat16 in registers, are the A of an N=8 wgmma whose K is the
    accumulator's columns; its B, the weights, K-major in shared memory."""
    atoms = (1 if turns > 1 else 2, 1, 1)
    dim = k.shape[1]
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        k.element_type, q_rows.element_type, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, atoms, tiler_mn=(64, cols),
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
    head_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, atoms, tiler_mn=(64, HEAD_SUM_N),
        a_source=warpgroup.OperandSource.RMEM,
    )
    w_layout = sm90_utils.make_smem_layout_b(
        LayoutEnum.ROW_MAJOR, (tokens, HEAD_SUM_N, cols), cutlass.BFloat16, 1
    )
    return (tma_k, k_tiles, tma_q, q_tiles), (tiled_mma, head_mma, k_layout, q_layout, w_layout)


def mma_splits(rows_m: int, context: int, rows: int, sms: int) -> tuple[int, int]:
    """A dense kernel's (CTAs along the context, 128-token key tiles each): one CTA per
    SM, none left empty."""
    tiles = math.ceil(context / TILE_TOKENS)
    wanted = max(1, sms // math.ceil(rows_m / rows))
    per_cta = math.ceil(tiles / wanted)
    return math.ceil(tiles / per_cta), per_cta
