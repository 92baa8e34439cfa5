"""The lightning indexer as a pipeline over context chunks with a running top-k.

The context is scored chunk by chunk, and each chunk's candidates are merged into a
running top-k per row as soon as the chunk is scored, so only the running top-k and
the candidates of two chunks (the one being merged, the one being scored) are ever
live, never the [M, N] scores. Every launch does two things at once: its first M
programs merge the previous chunk's candidates into the running top-k (one program
per row, a bitonic merge), and the rest score the current chunk (the fused logits of
fused_logits_triton.py, one row and BLOCK_N tokens each). The two halves of a launch
read and write disjoint buffers (ping-pong), so the next chunk's logits run on the
SMs beside the current chunk's selection, in one stream and one CUDA graph, with no
side stream to join.

Scoring a chunk also filters it: a score that does not beat the row's k-th best so far
(from the merge a launch earlier) can never make the top-k and is dropped, and the
rest are appended to the row's candidates (an atomic counter per row). After a few
chunks almost nothing survives, so a merge costs one or two sorts of topk values
whatever the chunk size. Chunks start at topk tokens and double up to CHUNK: early
chunks are small because little is filtered yet (the first two chunks see no k-th
best at all), later ones large so that few launches cover a long context (at 256K
tokens and CHUNK=32K, 13 launches).

Scores are compared as one int64 per position: the score's order-preserving integer
key in the high half, the position (inverted, so lower positions win ties) in the low
half. All keys of a row differ, so the running top-k is one set whatever order the
atomics appended candidates in, and the output is its positions sorted by score: the
same inputs always give the same output.

- BLOCK_N: context tokens per scoring program (the N side of each head-block matmul).
- BLOCK_H: heads per matmul; the head loop steps by it.
- CHUNK: the largest chunk, in tokens. Each launch ends with its slowest program, so
  fewer, larger launches lose less time draining and refilling the GPU; the price is
  memory for candidates, 2 × M × CHUNK int64 (a chunk in which every score survives).
- num_warps, num_stages: warps per program (merge and scoring programs alike) and
  software-pipelining depth of the head loop's loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runners.kernel_lib.topk_triton import (
    INTERPRETED, LOWEST, candidate_keys, candidate_positions, dot_precision, key_tile, merge_block,
    row_scores,
)

PARAMS = {
    "BLOCK_N": 128,
    "BLOCK_H": 32,
    "CHUNK": 32768,
    "num_warps": 8,
    "num_stages": 2,
}

SPACE = {
    "BLOCK_N": [128],
    "BLOCK_H": [32],
    "num_stages": [2],
    "CHUNK": [16384, 32768, 65536],
    "num_warps": [4, 8],
}


@triton.jit
def _merge_candidates(best_in, best_out, found_in, pending_in, out_ptr, row, topk,
                      stride_om, finishing, CAPACITY: tl.constexpr, KEEP: tl.constexpr,
                      LOG_KEEP: tl.constexpr):
    """Merge a row's candidates from the previous chunk into its running top-k."""
    lanes = tl.arange(0, KEEP)
    best = tl.load(best_in + row * KEEP + lanes)
    found = tl.load(found_in + row)
    pending_in += row.to(tl.int64) * CAPACITY
    # A compile-time bound (the chunk's size) with a runtime test: Triton 3.6's
    # interpreter cannot loop to a runtime bound under numpy 2.
    for start in range(0, CAPACITY, KEEP):
        if start < found:
            block = tl.load(pending_in + start + lanes, mask=start + lanes < found, other=LOWEST)
            best = merge_block(best, block, LOG_KEEP)
    tl.store(best_out + row * KEEP + lanes, best)
    if finishing:
        tl.store(out_ptr + row * stride_om + lanes, candidate_positions(best), mask=lanes < topk)


@triton.jit
def _score_chunk(q_ptr, k_ptr, w_ptr, best_in, found_out, pending_out, row, start,
                 context, topk, stride_qm, stride_qh, stride_kn, stride_wm,
                 heads: tl.constexpr, dim: tl.constexpr, CAPACITY: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 KEEP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Score BLOCK_N tokens of one row; append those that beat its k-th best so far."""
    tokens = start + tl.arange(0, BLOCK_N)
    valid = tokens < context
    dims = tl.arange(0, BLOCK_D)
    keys = key_tile(k_ptr, tokens, valid, dims, stride_kn, dim, UPCAST)
    scores = row_scores(q_ptr, w_ptr, row, keys, dims, stride_qm, stride_qh, stride_wm,
                        heads, dim, BLOCK_N, BLOCK_H, PRECISION, UPCAST)
    floor = tl.load(best_in + row * KEEP + topk - 1)
    candidates = candidate_keys(scores, tokens)
    keep = valid & (candidates > floor)
    kept = tl.sum(keep.to(tl.int32), axis=0)
    if kept > 0:
        first = tl.atomic_add(found_out + row, kept, sem="relaxed")
        slots = first + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(pending_out + row.to(tl.int64) * CAPACITY + slots, candidates, mask=keep)


@triton.jit
def _pipeline_step(
    q_ptr, k_ptr, w_ptr, out_ptr, best_in, best_out, found_in, found_out,
    pending_in, pending_out, rows, context, topk, chunk_start, merging, finishing,
    stride_qm, stride_qh, stride_kn, stride_wm, stride_om,
    heads: tl.constexpr, dim: tl.constexpr, CAPACITY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KEEP: tl.constexpr, LOG_KEEP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    program = tl.program_id(0)
    # Merging programs come first: the GPU starts programs roughly in order, so the
    # merges start at once and the scoring programs fill the SMs around them.
    if program < merging:
        _merge_candidates(best_in, best_out, found_in, pending_in, out_ptr, program, topk,
                          stride_om, finishing, CAPACITY, KEEP, LOG_KEEP)
    else:
        # Consecutive programs score the same tokens for different rows, so a key
        # tile is read from HBM once and from L2 by the others.
        tile = program - merging
        row = tile % rows
        start = chunk_start + (tile // rows) * BLOCK_N
        _score_chunk(q_ptr, k_ptr, w_ptr, best_in, found_out, pending_out, row, start,
                     context, topk, stride_qm, stride_qh, stride_kn, stride_wm,
                     heads, dim, CAPACITY, BLOCK_N, BLOCK_H, BLOCK_D, KEEP,
                     PRECISION, UPCAST)


def _chunks(context: int, first: int, largest: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk: `first` tokens, then doubling up to `largest`."""
    chunks, start, size = [], 0, first
    while start < context:
        chunks.append((start, min(start + size, context)))
        start, size = start + size, min(2 * size, largest)
    return chunks


def forward(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    # The kernel indexes the head dimension with unit stride.
    q, k, weights = q.contiguous(), k.contiguous(), weights.contiguous()
    rows, heads, dim = q.shape
    context = k.shape[0]
    block_n = PARAMS["BLOCK_N"]
    # The running top-k is a power of two for the bitonic merges.
    keep = max(triton.next_power_of_2(topk), 16)
    # Chunk boundaries are multiples of BLOCK_N, so a scoring tile never straddles two.
    chunks = _chunks(context, max(keep, block_n), max(PARAMS["CHUNK"], block_n))
    capacity = max(end - start for start, end in chunks)
    device = q.device
    # Ping-pong pairs: a launch reads one of each and writes the other.
    best = torch.full((2, rows, keep), -(2**63), dtype=torch.int64, device=device)
    pending = torch.empty(2, rows, capacity, dtype=torch.int64, device=device)
    found = torch.zeros(len(chunks), rows, dtype=torch.int32, device=device)
    out = torch.empty(rows, topk, dtype=torch.int64, device=device)
    # Launch i scores chunk i (if any) and merges chunk i - 1 (if any).
    for step in range(len(chunks) + 1):
        scoring, merging = step < len(chunks), step > 0
        start, end = chunks[step] if scoring else (0, 0)
        grid = (rows * merging + rows * triton.cdiv(end - start, block_n),)
        _pipeline_step[grid](
            q, k, weights, out, best[step % 2], best[(step + 1) % 2],
            found[max(step - 1, 0)], found[min(step, len(chunks) - 1)],
            pending[(step + 1) % 2], pending[step % 2],
            rows, context, topk, start, rows * merging, int(step == len(chunks)),
            q.stride(0), q.stride(1), k.stride(0), weights.stride(0), out.stride(0),
            heads=heads, dim=dim, CAPACITY=capacity, BLOCK_N=block_n,
            BLOCK_H=PARAMS["BLOCK_H"], BLOCK_D=triton.next_power_of_2(dim),
            KEEP=keep, LOG_KEEP=keep.bit_length() - 1,
            PRECISION=dot_precision(q.dtype), UPCAST=INTERPRETED,
            num_warps=PARAMS["num_warps"], num_stages=PARAMS["num_stages"],
        )
    return out
