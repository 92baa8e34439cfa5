"""Right when every sequence is as long as the block table is wide, wrong otherwise: it
scores every block the table lists as if each sequence filled its row, never reading
`context_lens`. In a batch of equal lengths that is the answer; in a mixed one it reads
past each sequence's end into other sequences' blocks (and, with next_n = 2, past each
row's causal prefix)."""

import torch


def forward(q, kv_cache, block_table, context_lens, weights, topk):
    batch, next_n, heads, dim = q.shape
    width = block_table.shape[1] * kv_cache.shape[1]
    keys = kv_cache[block_table.long()].view(batch, width, dim)
    logits = torch.einsum("bjhd,bnd->bjhn", q, keys).float().relu_()
    scores = torch.einsum("bjhn,bjh->bjn", logits, weights.view(batch, next_n, heads))
    return scores.view(batch * next_n, width).topk(topk, dim=-1).indices
