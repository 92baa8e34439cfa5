"""The paged indexer in plain torch: gather a group of sequences' blocks to the widest
context, every score of every head, mask each row past its prefix, one top-k."""

from __future__ import annotations

import torch

# Float32 logits made at a time: whole, a 64 x 256K batch's intermediates passed 20 GiB,
# over the quarter of an 80 GB card each of the judge's processes gets. A group of
# sequences at a time keeps them near 4 GiB; the group depends on shapes alone, so one
# graph still serves every length.
LOGITS_AT_ONCE = 2**28


def forward(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    batch, next_n, heads, dim = q.shape
    width = block_table.shape[1] * kv_cache.shape[1]
    group = max(1, LOGITS_AT_ONCE // (next_n * heads * width))
    scores = torch.empty(batch, next_n, width, dtype=torch.float32, device=q.device)
    for start in range(0, batch, group):
        end = min(start + group, batch)
        keys = kv_cache[block_table[start:end].long()].view(end - start, width, dim)
        logits = torch.einsum("bjhd,bnd->bjhn", q[start:end], keys).float().relu_()
        scores[start:end] = torch.einsum("bjhn,bjh->bjn", logits, weights.view(batch, next_n, heads)[start:end])
    # Row (b, j) sees the first context_lens[b] - next_n + 1 + j tokens of sequence b.
    prefixes = context_lens.long().view(-1, 1) - next_n + 1 + torch.arange(next_n, device=q.device)
    positions = torch.arange(width, device=q.device)
    scores.masked_fill_(positions >= prefixes.unsqueeze(-1), float("-inf"))
    top = scores.view(batch * next_n, width).topk(topk, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)
