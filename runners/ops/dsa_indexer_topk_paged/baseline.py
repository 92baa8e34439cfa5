"""The paged indexer in plain torch: gather every sequence's blocks to the widest
context, every score of every head, mask each row past its prefix, one top-k."""

from __future__ import annotations

import torch


def forward(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    batch, next_n, heads, dim = q.shape
    width = block_table.shape[1] * kv_cache.shape[1]
    keys = kv_cache[block_table.long()].view(batch, width, dim)
    logits = torch.einsum("bjhd,bnd->bjhn", q, keys).float().relu_()
    scores = torch.einsum("bjhn,bjh->bjn", logits, weights.view(batch, next_n, heads))
    # Row (b, j) sees the first context_lens[b] - next_n + 1 + j tokens of sequence b.
    prefixes = context_lens.long().view(-1, 1) - next_n + 1 + torch.arange(next_n, device=q.device)
    positions = torch.arange(width, device=q.device)
    scores.masked_fill_(positions >= prefixes.unsqueeze(-1), float("-inf"))
    top = scores.view(batch * next_n, width).topk(topk, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)
