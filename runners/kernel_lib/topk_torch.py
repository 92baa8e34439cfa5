"""Pieces of the plain-torch indexer kernels (chunked_topk, per_sequence,
per_sequence_fp8): a chunk of lightning-indexer scores, and the paged indexer run one
sequence at a time over its own blocks with a running top-k.
"""

from __future__ import annotations

import torch


def head_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, *, fused: bool,
                key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """sum_h weights[:, h] * relu(q[:, h, :] . keys[n, :] * key_scales[n]), float32
    [rows, n]; without `key_scales` (the FP8 keys' per-token scales), unscaled. `fused`
    scores every head in one matmul and sums them with a batched matmul against the
    weights; otherwise one head at a time, so only [rows, n] float32 is live."""
    rows, heads, dim = q.shape
    if fused:
        logits = (q.reshape(rows * heads, dim) @ keys.T).float().view(rows, heads, -1)
        if key_scales is not None:
            logits.mul_(key_scales)
        return torch.bmm(weights.unsqueeze(1), logits.relu_()).squeeze(1)
    scores = torch.zeros(rows, keys.shape[0], dtype=torch.float32, device=q.device)
    for head in range(heads):
        logits = (q[:, head] @ keys.T).float()
        if key_scales is not None:
            logits.mul_(key_scales)
        scores.addcmul_(logits.relu_(), weights[:, head:head + 1])
    return scores


def paged_topk(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               context_lens: torch.Tensor, weights: torch.Tensor, topk: int, *, chunk: int,
               fused: bool, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The paged indexer one sequence at a time: each sequence gathers its own blocks and
    scores its prefix `chunk` tokens at a time (head_scores), keeping a running top-k.
    With `kv_scale` the cache is FP8: q and each chunk's keys are widened to bfloat16
    (exact for e4m3) and the logits scaled per token."""
    batch, next_n, heads, dim = q.shape
    block = kv_cache.shape[1]
    out = torch.full((batch * next_n, topk), -1, dtype=torch.int64, device=q.device)
    rows = weights.view(batch, next_n, heads)
    if kv_scale is not None:
        q = q.bfloat16()
    for sequence, length in enumerate(context_lens.tolist()):
        blocks = block_table[sequence, :-(-length // block)].long()
        # Whole blocks, the tail masked below: matmul shapes in multiples of a block, not
        # one per length (oneDNN builds and keeps a kernel for every new shape).
        keys = kv_cache[blocks].reshape(-1, dim)
        scales = kv_scale[blocks].reshape(-1) if kv_scale is not None else None
        # Token j of the sequence sees its first length - next_n + 1 + j keys.
        limits = torch.arange(length - next_n + 1, length + 1, device=q.device)
        best_values = torch.empty(next_n, 0, device=q.device)
        best_indices = torch.empty(next_n, 0, dtype=torch.int64, device=q.device)
        for start in range(0, keys.shape[0], chunk):
            end = start + chunk
            if scales is None:
                scores = head_scores(q[sequence], keys[start:end], rows[sequence], fused=fused)
            else:
                scores = head_scores(q[sequence], keys[start:end].bfloat16(), rows[sequence],
                                     fused=fused, key_scales=scales[start:end])
            positions = torch.arange(start, start + scores.shape[1], device=q.device)
            scores.masked_fill_(positions >= limits.unsqueeze(1), float("-inf"))
            values = torch.cat([best_values, scores], dim=1)
            indices = torch.cat([best_indices, positions.expand(next_n, -1)], dim=1)
            best_values, order = values.topk(min(topk, values.shape[1]), dim=1)
            best_indices = indices.gather(1, order)
        best_indices = best_indices.masked_fill(best_values == float("-inf"), -1)
        out[sequence * next_n:(sequence + 1) * next_n, :best_indices.shape[1]] = best_indices
    return out
