"""The exact radix top-k select of the CuTe DSL lightning indexers (logits_topk_cute,
logits_topk_fp8_cute and their paged forms), and the key and histogram helpers their
scores kernels share with it.

A score's radix key (`radix_key`) orders like the float. The scores kernels count each
score's first digit (the key's top 11 bits) in a histogram per CTA (`record`,
`write_hist`). The select then runs one CTA per query row: the summed histograms give
the bin that holds the top-k-th score; one pass over the row, in 16-byte loads with
several in flight per thread, takes every score above that bin and copies the bin's own
scores (key and index) to shared memory; digits 2 and 3 (the next 11 and 10 bits) are
counted there, which pins the exact top-k-th key, and the lowest-indexed ties fill the
last places. Each chosen token sets its bit in a bitmap of the row in shared memory,
and a block prefix sum over the bitmap's words writes them out in token order: the same
inputs give the same output bit for bit although atomics marked them in no fixed order.
(Past BITMAP_TOKENS the bitmap would not fit: the chosen are listed and sorted there.)
A bin too full for shared memory (over CANDIDATES scores: many equal or nearly equal
values) takes passes over the row for digits 2 and 3 instead, then a count pass and a
write pass whose slots are handed out in token order by ballots.

`launch_select` selects from dense rows (every score counts), `launch_paged_select`
from paged ones (a row counts its sequence's prefix, its length read on the device).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from runners.kernel_lib.cute_host import Program, fake_tensor, runtime_int

WARP = 32
# A score's radix key is split into digits of 11, 11 and 10 bits, most significant
# first; a histogram of the first is what the scores kernels count.
BINS = 2048
LOW_BINS = 1024
# The select keeps the top-k-th score's first-digit bin in shared memory when it holds
# at most this many scores (a key and an index each: 128 KB); fuller bins, from many
# equal or nearly equal scores, take passes over the row instead.
CANDIDATES = 16384
# 16-byte loads each select thread has in flight in its pass over the row.
_LOADS_IN_FLIGHT = 4
# The chosen indices are listed and sorted in shared memory (past the bitmap's reach), up
# to this many.
MAX_TOPK = 8192
# Tokens per block of the paged indexers' cache: a paged row is whole blocks wide, so a
# 16-byte load of it never leaves it.
BLOCK_SIZE = 64
# Up to this many context tokens (64 KB of bits) the chosen are marked in a bitmap in
# shared memory and written out in token order by a prefix sum: no bitonic sort, whose
# 66 steps for 2048 indices each ended in a sync (on the H200 the kept bf16 kernel went
# from 0.075 to 0.067 ms at 32K).
BITMAP_TOKENS = 1 << 19


# --- keys and histograms, shared with the scores kernels ---------------------------------


@cute.jit
def radix_key(score: cutlass.Float32) -> cutlass.Uint32:
    """An unsigned key that orders like the float: negatives have all bits flipped,
    non-negatives only the sign bit."""
    bits = score.bitcast(cutlass.Uint32)
    flip = (cutlass.Uint32(0) - (bits >> cutlass.Uint32(31))) | cutlass.Uint32(0x80000000)
    return bits ^ flip


@cute.jit
def record(
    scores: cute.Tensor, hist: cute.Tensor, row: cutlass.Int32, token: cutlass.Int32,
    hist_row: cutlass.Int32, score: cutlass.Float32,
):
    """Store one score and count its first digit in the CTA's shared histogram."""
    scores[row, token] = score
    digit = cutlass.Int32(radix_key(score) >> cutlass.Uint32(21))
    cute.arch.atomic_add(hist.iterator + hist_row * BINS + digit, cutlass.Int32(1))


@cute.jit
def write_hist(
    hist_smem: cute.Tensor, hist: cute.Tensor, split: cutlass.Int32, row0: cutlass.Int32,
    rows: cutlass.Constexpr, threads: cutlass.Constexpr,
):
    """The CTA's histograms, one per query row it owns, to hist[split, row, :]."""
    tidx, _, _ = cute.arch.thread_idx()
    for i in cutlass.range(tidx, rows * BINS, threads, unroll=1):
        row = row0 + i // BINS
        if row < hist.shape[1]:
            hist[split, row, i % BINS] = hist_smem[i]


# --- select ---------------------------------------------------------------------------


@cute.jit
def _exclusive_prefix(owned: cutlass.Int32, warp_totals: cute.Tensor) -> cutlass.Int32:
    """The sum of `owned` over the block's threads before this one: a scan within the
    warp, then the totals of the warps before, summed across the lanes (a warp at most
    per lane: five shuffles, not a load per earlier warp in turn). warp_totals must not
    be read by anyone else until the next block sync."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    running = owned
    for offset in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(running, 1 << offset)
        if lane >= (1 << offset):
            running += other
    if lane == WARP - 1:
        warp_totals[warp] = running
    cute.arch.sync_threads()
    earlier = cutlass.Int32(0)
    if lane < warp:
        earlier = warp_totals[lane]
    for offset in cutlass.range_constexpr(5):
        earlier += cute.arch.shuffle_sync_bfly(earlier, 1 << offset)
    return running - owned + earlier


@cute.jit
def _threshold_bin(
    hist: cute.Tensor, bins: cutlass.Constexpr, need: cutlass.Int32,
    warp_totals: cute.Tensor, found: cute.Tensor, threads: cutlass.Constexpr,
):
    """found = (bin, count above it, count in it): the bin, from the top, where the
    running count first reaches `need`. Thread t owns bins/threads bins counted down from
    the top; a block-wide prefix sum over threads finds the one thread whose bins cross
    `need`."""
    tidx, _, _ = cute.arch.thread_idx()
    per_thread = bins // threads
    first = bins - 1 - tidx * per_thread

    owned = cutlass.Int32(0)
    for i in cutlass.range_constexpr(per_thread):
        owned += hist[first - i]
    above = _exclusive_prefix(owned, warp_totals)

    if above < need and need <= above + owned:
        for i in cutlass.range_constexpr(per_thread):
            count = hist[first - i]
            if above < need and need <= above + count:
                found[0] = first - i
                found[1] = above
                found[2] = count
            above += count
    cute.arch.sync_threads()


@cute.jit
def _kth_key(
    keys: cute.Tensor, row, count, top: cutlass.Uint32, need: cutlass.Int32, all_in_bin: cutlass.Constexpr,
    sHist: cute.Tensor, sWarp: cute.Tensor, sFound: cute.Tensor, threads: cutlass.Constexpr,
):
    """(the exact top-k-th key, how many keys equal to it are taken): digits 2 and 3
    counted (`_count_digit`) among the keys whose first digit is `top`, `need` of them
    still to take; `all_in_bin`: every key's first digit is `top` (the candidates').
    sFound is left holding digit 3's (bin, count above it, count in it)."""
    # Digit 2 (bits 20..10) among the keys whose digit 1 is `top`.
    _count_digit(keys, row, count, top, 10, BINS, not all_in_bin, need, sHist, sWarp, sFound, threads)
    top = (top << cutlass.Uint32(11)) | cutlass.Uint32(sFound[0])
    need -= sFound[1]
    # Digit 3 (bits 9..0) among the keys whose top 22 bits are `top`.
    _count_digit(keys, row, count, top, 0, LOW_BINS, True, need, sHist, sWarp, sFound, threads)
    kth = (top << cutlass.Uint32(10)) | cutlass.Uint32(sFound[0])
    return kth, need - sFound[1]


@cute.jit
def _count_digit(
    keys: cute.Tensor, row, count, top: cutlass.Uint32, low_bit: cutlass.Constexpr,
    bins: cutlass.Constexpr, filtered: cutlass.Constexpr, need: cutlass.Int32, sHist: cute.Tensor,
    sWarp: cute.Tensor, sFound: cute.Tensor, threads: cutlass.Constexpr,
):
    """One digit more of the top-k-th key: sFound = `_threshold_bin` of the histogram of
    the digit of `bins` bins from bit `low_bit` up, among the first `count` keys whose
    bits above it are `top` (`filtered`; else every key's are). The keys are the
    radix keys of scores[row, :] (a pass over the row), or with `row` None the
    candidates' keys in shared memory."""
    tidx, _, _ = cute.arch.thread_idx()
    # The bits above the digit. (Worked out here: a method called on a value inside a
    # dynamic loop makes it one of the loop's carried values, no longer a constant.)
    high_bit = low_bit + bins.bit_length() - 1
    for b in cutlass.range(tidx, bins, threads, unroll=1):
        sHist[b] = 0
    cute.arch.sync_threads()
    for n in cutlass.range(tidx, count, threads, unroll=1):
        if cutlass.const_expr(row is None):
            key = keys[n]
        else:
            key = radix_key(keys[row, n])
        if cutlass.const_expr(filtered):
            if key >> cutlass.Uint32(high_bit) == top:
                _count_key(sHist, key, low_bit, bins)
        else:
            _count_key(sHist, key, low_bit, bins)
    cute.arch.sync_threads()
    _threshold_bin(sHist, bins, need, sWarp, sFound, threads)


@cute.jit
def _count_key(sHist: cute.Tensor, key: cutlass.Uint32, low_bit: cutlass.Constexpr, bins: cutlass.Constexpr):
    """Count the key's digit of `bins` bins from bit `low_bit` up."""
    if cutlass.const_expr(low_bit > 0):
        key = key >> cutlass.Uint32(low_bit)
    digit = cutlass.Int32(key & cutlass.Uint32(bins - 1))
    cute.arch.atomic_add(sHist.iterator + digit, cutlass.Int32(1))


@cute.jit
def _choose(chosen: cute.Tensor, counts: cute.Tensor, index: cutlass.Int32, by_bitmap: cutlass.Constexpr):
    """Mark token `index` chosen: its bit in the row's bitmap, or the next free slot of
    the list the sort then orders."""
    if cutlass.const_expr(by_bitmap):
        bit = cutlass.Uint32(1) << cutlass.Uint32(index & (WARP - 1))
        cute.arch.atomic_or(chosen.iterator + (index >> 5), bit)
    else:
        chosen[cute.arch.atomic_add(counts.iterator, cutlass.Int32(1))] = index


@cute.jit
def _write_bitmap(
    bitmap: cute.Tensor, words: cutlass.Int32, out: cute.Tensor, row: cutlass.Int32,
    warp_totals: cute.Tensor, threads: cutlass.Constexpr,
):
    """Write the tokens whose bits are set among the bitmap's first `words`, in token
    order: thread t owns a run of words, a block prefix sum of their bit counts gives it
    its first slot."""
    tidx, _, _ = cute.arch.thread_idx()
    per_thread = (words + threads - 1) // threads
    first = tidx * per_thread
    owned = cutlass.Int32(0)
    for i in cutlass.range(per_thread, unroll=1):
        if first + i < words:
            owned += cutlass.Int32(cute.arch.popc(bitmap[first + i]))
    slot = _exclusive_prefix(owned, warp_totals)
    for i in cutlass.range(per_thread, unroll=1):
        word = first + i
        if word < words:
            bits = bitmap[word]
            while bits != cutlass.Uint32(0):
                lowest = bits & (~bits + cutlass.Uint32(1))
                out[row, slot] = cutlass.Int64(word * WARP + cutlass.Int32(cute.arch.popc(lowest - cutlass.Uint32(1))))
                slot += 1
                bits ^= lowest


@cute.jit
def _bitonic_sort(values: cute.Tensor, size: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Sort values[:size] ascending in shared memory; size is a power of two.

    Thread t compares pairs p = t, t + threads, ...; while the stride is at most a warp,
    pair p's two elements lie in the 64 that pairs 32*(p//32) .. +31 cover, one warp's
    own in every such step: between two of those steps the warp syncs alone (two thirds
    of the 66 steps of a 2048-element sort), between any others the whole block."""
    tidx, _, _ = cute.arch.thread_idx()
    steps = [(2 << level, (2 << level) >> (step + 1))
             for level in range(size.bit_length() - 1) for step in range(level + 1)]
    for n in cutlass.range_constexpr(len(steps)):
        span, stride = steps[n]
        for p in cutlass.range(tidx, size // 2, threads, unroll=1):
            i = 2 * stride * (p // stride) + p % stride
            j = i + stride
            low, high = values[i], values[j]
            ascending = (i & span) == 0
            if (low > high) == ascending:
                values[i] = high
                values[j] = low
        if cutlass.const_expr(n + 1 < len(steps) and stride <= WARP and steps[n + 1][1] <= WARP):
            cute.arch.sync_warp()
        else:
            cute.arch.sync_threads()


@cute.jit
def _take(
    score: cutlass.Float32, j: cutlass.Int32, e: cutlass.Constexpr, vec: cutlass.Constexpr,
    top: cutlass.Uint32, keys: cute.Tensor, indices: cute.Tensor, chosen: cute.Tensor,
    counts: cute.Tensor, by_bitmap: cutlass.Constexpr,
):
    """Score e of the row's j-th vector: chosen if its first digit is above `top`, a
    candidate if it is `top`. (Its index, j * vec + e, is computed where it is stored.)"""
    key = radix_key(score)
    digit = key >> cutlass.Uint32(21)
    if digit > top:
        _choose(chosen, counts, j * vec + e, by_bitmap)
    elif digit == top:
        slot = cute.arch.atomic_add(counts.iterator + 1, cutlass.Int32(1))
        # The histogram said the bin fits; never write past it regardless.
        if slot < CANDIDATES:
            keys[slot] = key
            indices[slot] = j * vec + e


@cute.jit
def _candidates(
    scores: cute.Tensor, row: cutlass.Int32, top: cutlass.Uint32, keys: cute.Tensor,
    indices: cute.Tensor, chosen: cute.Tensor, counts: cute.Tensor, prefix,
    threads: cutlass.Constexpr, by_bitmap: cutlass.Constexpr, vec: cutlass.Constexpr,
):
    """One pass over the row in 16-byte loads, several in flight per thread: every score
    whose first digit is above `top` is chosen outright; those whose first digit is
    `top` go to (keys, indices), the candidates for the remaining places. Only the row's
    first `prefix` scores count (all, for None). A prefix need not be a multiple of `vec`:
    the rest of a paged row's last vector is never written by the scores kernel, and its
    rows are W wide, a multiple of 64, so the load stays in the row."""
    tidx, _, _ = cute.arch.thread_idx()
    context = _row_length(scores, prefix)
    # (vec, W // vec): column j is the row's j-th vector.
    row_vectors = cute.zipped_divide(scores[row, None], (vec,))
    if cutlass.const_expr(prefix is None):
        vectors = context // vec
    else:
        vectors = cute.ceil_div(context, vec)
    step = threads * _LOADS_IN_FLIGHT
    for base in cutlass.range(tidx, vectors, step, unroll=1):
        chunks = [cute.make_rmem_tensor((vec,), cutlass.Float32) for _ in range(_LOADS_IN_FLIGHT)]
        # Issue every load before the first use, so they travel together.
        for u in cutlass.range_constexpr(_LOADS_IN_FLIGHT):
            j = base + u * threads
            if j < vectors:
                cute.autovec_copy(row_vectors[None, j], chunks[u])
        for u in cutlass.range_constexpr(_LOADS_IN_FLIGHT):
            j = base + u * threads
            if j < vectors:
                for e in cutlass.range_constexpr(vec):
                    if cutlass.const_expr(prefix is None):
                        _take(chunks[u][e], j, e, vec, top, keys, indices, chosen, counts, by_bitmap)
                    else:
                        if j * vec + e < context:
                            _take(chunks[u][e], j, e, vec, top, keys, indices, chosen, counts, by_bitmap)


@cute.jit
def _select_by_passes(
    scores: cute.Tensor, out: cute.Tensor, row: cutlass.Int32, top: cutlass.Uint32,
    need: cutlass.Int32, prefix, sHist: cute.Tensor, sWarp: cute.Tensor, sFound: cute.Tensor,
    threads: cutlass.Constexpr,
):
    """The bin is too full for shared memory (many equal or nearly equal scores): two
    passes over the row refine digits 2 and 3, then a count pass and a write pass emit
    the chosen indices in token order, slots handed out by ballots."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    context = _row_length(scores, prefix)
    topk = out.shape[1]
    warps = threads // WARP

    kth, ties = _kth_key(scores, row, context, top, need, False, sHist, sWarp, sFound, threads)
    # Exactly `topk - ties` keys exceed the top-k-th; `ties` of those equal to it fill
    # the rest.
    above_all = topk - ties

    # Each warp owns one contiguous span of the row, so slots follow token order: count
    # each warp's hits, then every warp writes its own from the counts before it.
    span = cute.ceil_div(cute.ceil_div(context, warps), WARP) * WARP
    start = warp * span
    end = cutlass.min(start + span, context)
    above_count = cutlass.Int32(0)
    tie_count = cutlass.Int32(0)
    for base in cutlass.range(start, end, WARP, unroll=1):
        n = base + lane
        key = cutlass.Uint32(0)
        if n < end:
            key = radix_key(scores[row, n])
        above_count += cute.arch.popc(cute.arch.vote_ballot_sync((n < end) & (key > kth)))
        tie_count += cute.arch.popc(cute.arch.vote_ballot_sync((n < end) & (key == kth)))
    if lane == 0:
        sWarp[warp] = above_count
        sWarp[warps + warp] = tie_count
    cute.arch.sync_threads()
    above_slot = cutlass.Int32(0)
    tie_rank = cutlass.Int32(0)
    for w in cutlass.range(warp, unroll=1):
        above_slot += sWarp[w]
        tie_rank += sWarp[warps + w]

    earlier = cute.arch.lanemask_lt()
    for base in cutlass.range(start, end, WARP, unroll=1):
        n = base + lane
        key = cutlass.Uint32(0)
        if n < end:
            key = radix_key(scores[row, n])
        is_above = (n < end) & (key > kth)
        is_tie = (n < end) & (key == kth)
        above_mask = cutlass.Uint32(cute.arch.vote_ballot_sync(is_above))
        tie_mask = cutlass.Uint32(cute.arch.vote_ballot_sync(is_tie))
        if is_above:
            slot = above_slot + cutlass.Int32(cute.arch.popc(above_mask & earlier))
            out[row, slot] = cutlass.Int64(n)
        if is_tie:
            rank = tie_rank + cutlass.Int32(cute.arch.popc(tie_mask & earlier))
            if rank < ties:
                out[row, above_all + rank] = cutlass.Int64(n)
        above_slot += cutlass.Int32(cute.arch.popc(above_mask))
        tie_rank += cutlass.Int32(cute.arch.popc(tie_mask))


def _row_length(scores: cute.Tensor, prefix):
    """How many of the row's scores count: a paged row's prefix, a dense row's width
    (prefix None), read where it is used, as each dense kernel did before they shared this."""
    return scores.shape[1] if prefix is None else prefix


def _split_count(hist: cute.Tensor, splits):
    """How many histograms count the row: a paged row's spans, or every split (None)."""
    return hist.shape[0] if splits is None else splits


@cute.jit
def _shared_memory(
    context: cutlass.Int32, threads: cutlass.Constexpr, sorted_slots: cutlass.Constexpr,
    by_bitmap: cutlass.Constexpr,
):
    """The select CTA's shared memory: the histogram, the block scan's and the threshold's
    scratch, the slots handed out (chosen indices, candidates, gathered ties), the
    candidates' keys and indices, and the chosen: one bit per token where the row's
    bitmap fits, else a list of indices. The context is a runtime value: the bitmap is
    sized for the longest row it serves and only its first `words` are used."""
    smem = cutlass.memory.SmemAllocator()
    sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BINS), 16)
    sWarp = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2 * (threads // WARP)), 16)
    sFound = smem.allocate_tensor(cutlass.Int32, cute.make_layout(3), 16)
    sCounts = smem.allocate_tensor(cutlass.Int32, cute.make_layout(3), 16)
    sKeys = smem.allocate_tensor(cutlass.Uint32, cute.make_layout(CANDIDATES), 16)
    sIndices = smem.allocate_tensor(cutlass.Int32, cute.make_layout(CANDIDATES), 16)
    words = cute.ceil_div(context, WARP)
    if cutlass.const_expr(by_bitmap):
        sChosen = smem.allocate_tensor(cutlass.Uint32, cute.make_layout(BITMAP_TOKENS // WARP), 16)
    else:
        sChosen = smem.allocate_tensor(cutlass.Int32, cute.make_layout(sorted_slots), 16)
    return sHist, sWarp, sFound, sCounts, sKeys, sIndices, sChosen, words


@cute.jit
def _select_row(
    scores: cute.Tensor, hist: cute.Tensor, out: cute.Tensor, tidx: cutlass.Int32,
    row: cutlass.Int32, topk: cutlass.Int32, prefix, splits, memory: tuple,
    threads: cutlass.Constexpr, sorted_slots: cutlass.Constexpr, by_bitmap: cutlass.Constexpr,
    vec: cutlass.Constexpr,
):
    """The top `topk` of the row's first `prefix` scores into out[row, :], in token
    order; `splits`: the histograms hist[:splits, row] that count them (None and None: a
    dense row, all of whose scores count, in every split's histogram). The kernel reads
    its thread and row before it allocates `memory` (`_shared_memory`, which also counts
    the bitmap's words in use), as the kernels did when each held its own copy of the
    select: the generated code is theirs, instruction for instruction."""
    sHist, sWarp, sFound, sCounts, sKeys, sIndices, sChosen, words = memory
    # Digit 1 (key bits 31..21): the scores kernels' histograms, summed over the splits.
    for b in cutlass.range(tidx, BINS, threads, unroll=1):
        total = cutlass.Int32(0)
        # Unrolled, the splits' loads are in flight together, not one L2 trip each.
        for s in cutlass.range(_split_count(hist, splits), unroll=8):
            total += hist[s, row, b]
        sHist[b] = total
    if tidx < 3:
        sCounts[tidx] = 0
    if cutlass.const_expr(by_bitmap):
        for i in cutlass.range(tidx, words, threads, unroll=1):
            sChosen[i] = cutlass.Uint32(0)
    else:
        # Slots the top-k leaves empty sort last and are never written out.
        for i in cutlass.range(topk + tidx, sorted_slots, threads, unroll=1):
            sChosen[i] = cutlass.Int32(0x7FFFFFFF)
    cute.arch.sync_threads()
    _threshold_bin(sHist, BINS, cutlass.Int32(topk), sWarp, sFound, threads)
    top = cutlass.Uint32(sFound[0])
    need = topk - sFound[1]
    in_bin = sFound[2]

    if in_bin <= CANDIDATES:
        # The usual case: the top-k-th score's first-digit bin fits in shared memory, so
        # the row is read once and digits 2 and 3 are counted among the candidates.
        _candidates(scores, row, top, sKeys, sIndices, sChosen, sCounts, prefix, threads, by_bitmap, vec)
        kth, ties = _kth_key(sKeys, None, in_bin, top, need, True, sHist, sWarp, sFound, threads)
        tied = sFound[2]

        # Candidates above the top-k-th key join the chosen, and so do those equal to it
        # if all fit. If not, the `ties` lowest-indexed of them: gathered in the
        # histogram's place (free now) and ranked among themselves alone, or where more
        # are tied than it holds, each ranked against every candidate.
        gather = tied <= BINS
        for c in cutlass.range(tidx, in_bin, threads, unroll=1):
            key = sKeys[c]
            index = sIndices[c]
            take = key > kth
            if key == kth:
                if tied <= ties:
                    take = True
                elif gather:
                    sHist[cute.arch.atomic_add(sCounts.iterator + 2, cutlass.Int32(1))] = index
                else:
                    rank = cutlass.Int32(0)
                    for other in cutlass.range(in_bin, unroll=1):
                        if sKeys[other] == kth and sIndices[other] < index:
                            rank += 1
                    take = rank < ties
            if take:
                _choose(sChosen, sCounts, index, by_bitmap)
        if tied > ties and gather:
            cute.arch.sync_threads()
            for j in cutlass.range(tidx, tied, threads, unroll=1):
                index = sHist[j]
                rank = cutlass.Int32(0)
                for other in cutlass.range(tied, unroll=1):
                    if sHist[other] < index:
                        rank += 1
                if rank < ties:
                    _choose(sChosen, sCounts, index, by_bitmap)
        cute.arch.sync_threads()
        # Atomics marked the chosen in no fixed order: written in token order, the output
        # is the same bit for bit on every call.
        if cutlass.const_expr(by_bitmap):
            _write_bitmap(sChosen, words, out, row, sWarp, threads)
        else:
            _bitonic_sort(sChosen, sorted_slots, threads)
            for i in cutlass.range(tidx, topk, threads, unroll=1):
                out[row, i] = cutlass.Int64(sChosen[i])
    else:
        _select_by_passes(scores, out, row, top, need, prefix, sHist, sWarp, sFound, threads)


def select_bucket(context: int) -> tuple[int, bool]:
    """What the select compiles for a context (at most four kernels per shape and
    parameters, not one per length): its 16-byte loads need rows 16-byte aligned
    (vec 4) or take one score at a time (vec 1); past BITMAP_TOKENS the chosen are
    listed and sorted instead of marked in a bitmap."""
    return (4 if context % 4 == 0 else 1), context <= BITMAP_TOKENS


@cute.kernel
def _select_rows(
    scores: cute.Tensor, hist: cute.Tensor, out: cute.Tensor, threads: cutlass.Constexpr,
    sorted_slots: cutlass.Constexpr, by_bitmap: cutlass.Constexpr, vec: cutlass.Constexpr,
):
    """A dense row: all of its scores count, summed over every split's histogram."""
    # Launched while the scores kernel still runs (programmatic dependent launch): wait
    # for it to finish and its scores and histograms to be visible.
    cute.arch.griddepcontrol_wait()
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    topk = out.shape[1]
    memory = _shared_memory(scores.shape[1], threads, sorted_slots, by_bitmap)
    _select_row(scores, hist, out, tidx, row, topk, None, None, memory, threads, sorted_slots, by_bitmap, vec)


@cute.jit
def launch_select(
    scores: cute.Tensor, hist: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream,
    threads: cutlass.Constexpr, sorted_slots: cutlass.Constexpr, by_bitmap: cutlass.Constexpr,
    vec: cutlass.Constexpr,
):
    """The top-k of every row of scores [M, N] into out [M, topk], hist [splits, M, BINS]
    holding the first digit's counts (the dense indexers'). `vec`: scores a load takes,
    4 where N is a multiple of 4."""
    # use_pdl: the select's launch overlaps the scores kernel's tail; it waits for it
    # in griddepcontrol.wait.
    _select_rows(scores, hist, out, threads, sorted_slots, by_bitmap, vec).launch(
        grid=(scores.shape[0], 1, 1), block=(threads, 1, 1), stream=stream, use_pdl=True
    )


@cute.kernel
def _paged_select_rows(
    scores: cute.Tensor, hist: cute.Tensor, out: cute.Tensor, context_lens: cute.Tensor,
    next_n: cutlass.Constexpr, span: cutlass.Constexpr, threads: cutlass.Constexpr,
    sorted_slots: cutlass.Constexpr, by_bitmap: cutlass.Constexpr, vec: cutlass.Constexpr,
):
    """A paged row: its sequence's prefix counts, summed over the spans that hold it."""
    cute.arch.griddepcontrol_wait()
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    topk = out.shape[1]
    # Row r = b * next_n + j sees the first context_lens[b] - next_n + 1 + j tokens of
    # sequence b (none for a padding sequence), read here on the device.
    context = cutlass.max(context_lens[row // next_n] - next_n + 1 + row % next_n, cutlass.Int32(0))
    memory = _shared_memory(context, threads, sorted_slots, by_bitmap)
    if context <= topk:
        # The whole prefix is the top-k, in token order; -1 pads the rest (every slot of
        # an empty sequence's rows).
        for i in cutlass.range(tidx, topk, threads, unroll=1):
            out[row, i] = cutlass.Int64(cutlass.select_(i < context, i, cutlass.Int32(-1)))
    else:
        # The spans past the row's prefix were not run or count other rows' tokens.
        _select_row(scores, hist, out, tidx, row, topk, context, cute.ceil_div(context, span), memory,
                    threads, sorted_slots, by_bitmap, vec)


@cute.jit
def launch_paged_select(
    scores: cute.Tensor, hist: cute.Tensor, out: cute.Tensor, context_lens: cute.Tensor,
    stream: cuda.CUstream, next_n: cutlass.Constexpr, span: cutlass.Constexpr,
    threads: cutlass.Constexpr, sorted_slots: cutlass.Constexpr, by_bitmap: cutlass.Constexpr,
):
    """The top-k of every row of scores [B*next_n, W] into out, row b*next_n+j counting the
    first context_lens[b] - next_n + 1 + j tokens, hist [spans, rows, BINS] holding the
    first digit's counts per `span` tokens (the paged indexers')."""
    # use_pdl: the select's launch overlaps the scores kernel's tail; it waits for it
    # in griddepcontrol.wait. Rows are W wide, a multiple of 64: 16-byte loads always.
    _paged_select_rows(scores, hist, out, context_lens, next_n, span, threads, sorted_slots, by_bitmap, 4).launch(
        grid=(scores.shape[0], 1, 1), block=(threads, 1, 1), stream=stream, use_pdl=True
    )


def _check_topk(topk: int) -> None:
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"the select takes 1 to {MAX_TOPK} per row; got top-{topk}")


def compile_select(topk: int, threads: int, vec: int, by_bitmap: bool):
    """`launch_select` compiled for top-k and one `select_bucket` (vec, by_bitmap) of
    context lengths, any number of rows, length and split count within it; no GPU needed.
    Called with scores, hist, out, stream."""
    _check_topk(topk)
    # A 16-byte vector of a row starts 16-byte aligned only if the row length is a
    # multiple of four: promised to the compiler, which then emits the wide loads.
    context = cute.sym_int32(divisibility=vec)
    arguments = (
        fake_tensor(cutlass.Float32, (runtime_int(), context)),
        fake_tensor(cutlass.Int32, (runtime_int(), runtime_int(), BINS)),
        fake_tensor(cutlass.Int64, (runtime_int(), topk)), cuda.CUstream(0), threads,
        1 << (topk - 1).bit_length(), by_bitmap, vec,
    )
    return Program(cute.compile(launch_select, *arguments), arguments)


def compile_paged_select(next_n: int, topk: int, span: int, threads: int, by_bitmap: bool):
    """`launch_paged_select` compiled for one (next_n, top-k, span, threads), any batch
    and lengths, table widths up to BITMAP_TOKENS (by_bitmap) or past it; no GPU needed.
    Called with scores, hist, out, context_lens, stream."""
    _check_topk(topk)
    arguments = (
        fake_tensor(cutlass.Float32, (runtime_int(), runtime_int(BLOCK_SIZE))),
        fake_tensor(cutlass.Int32, (runtime_int(), runtime_int(), BINS)),
        fake_tensor(cutlass.Int64, (runtime_int(), topk)), fake_tensor(cutlass.Int32, (runtime_int(),)),
        cuda.CUstream(0), next_n, span, threads, 1 << (topk - 1).bit_length(), by_bitmap,
    )
    return Program(cute.compile(launch_paged_select, *arguments), arguments)
