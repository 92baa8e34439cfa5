"""The paged indexer one sequence at a time, over its own blocks only.

The baseline gathers every sequence to the widest context and scores the padding too:
in a mixed batch most of that is waste. Here each sequence gathers its own blocks and
scores its prefix in chunks, keeping a running top-k. It reads the lengths on the host,
so it cannot be captured in a CUDA graph: a CPU kernel, and a starting point.

- chunk: context tokens scored per step.
- heads: "fused" scores all heads in one matmul and reduces them with a batched matmul
  against the weights; "loop" accumulates one head at a time.
"""

from __future__ import annotations

import torch

PARAMS = {
    "chunk": 4096,
    "heads": "fused",
}

SPACE = {
    "chunk": [1024, 4096, 16384],
    "heads": ["fused", "loop"],
}


def _scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = q.shape
    if PARAMS["heads"] == "fused":
        logits = (q.reshape(rows * heads, dim) @ keys.T).float().relu_().view(rows, heads, -1)
        return torch.bmm(weights.unsqueeze(1), logits).squeeze(1)
    scores = torch.zeros(rows, keys.shape[0], dtype=torch.float32, device=q.device)
    for head in range(heads):
        scores.addcmul_((q[:, head] @ keys.T).float().relu_(), weights[:, head:head + 1])
    return scores


def forward(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    batch, next_n, heads, dim = q.shape
    block = kv_cache.shape[1]
    out = torch.full((batch * next_n, topk), -1, dtype=torch.int64, device=q.device)
    rows = weights.view(batch, next_n, heads)
    for sequence, length in enumerate(context_lens.tolist()):
        blocks = block_table[sequence, :-(-length // block)].long()
        # Whole blocks, the tail masked below: matmul shapes in multiples of a block, not
        # one per length (oneDNN builds and keeps a kernel for every new shape).
        keys = kv_cache[blocks].reshape(-1, dim)
        # Token j of the sequence sees its first length - next_n + 1 + j keys.
        limits = torch.arange(length - next_n + 1, length + 1, device=q.device)
        best_values = torch.empty(next_n, 0, device=q.device)
        best_indices = torch.empty(next_n, 0, dtype=torch.int64, device=q.device)
        for start in range(0, keys.shape[0], PARAMS["chunk"]):
            scores = _scores(q[sequence], keys[start:start + PARAMS["chunk"]], rows[sequence])
            positions = torch.arange(start, start + scores.shape[1], device=q.device)
            scores.masked_fill_(positions >= limits.unsqueeze(1), float("-inf"))
            values = torch.cat([best_values, scores], dim=1)
            indices = torch.cat([best_indices, positions.expand(next_n, -1)], dim=1)
            best_values, order = values.topk(min(topk, values.shape[1]), dim=1)
            best_indices = indices.gather(1, order)
        best_indices = best_indices.masked_fill(best_values == float("-inf"), -1)
        out[sequence * next_n:(sequence + 1) * next_n, :best_indices.shape[1]] = best_indices
    return out
