"""Correct, and compiled per shape: a JIT kernel specialised on the shapes of its
inputs (simulated by sleeping COMPILE_S on the first call at each). The paged op's
shapes are its length buckets', as a server allocates its block table and cache, so
it compiles once a bucket and never while lengths grow inside one, which is what a
server pays too: the first-call guard must let it pass."""

import time

import torch

COMPILE_S = 0.3
_compiled = set()


def forward(q, kv_cache, block_table, context_lens, weights, topk):
    shapes = tuple(tuple(t.shape) for t in (q, kv_cache, block_table, context_lens, weights))
    if shapes not in _compiled:
        time.sleep(COMPILE_S)
        _compiled.add(shapes)
    batch, next_n, heads, dim = q.shape
    width = block_table.shape[1] * kv_cache.shape[1]
    keys = kv_cache[block_table.long()].view(batch, width, dim)
    logits = torch.einsum("bjhd,bnd->bjhn", q, keys).float().relu_()
    scores = torch.einsum("bjhn,bjh->bjn", logits, weights.view(batch, next_n, heads))
    prefixes = context_lens.long().view(-1, 1) - next_n + 1 + torch.arange(next_n, device=q.device)
    scores.masked_fill_(torch.arange(width, device=q.device) >= prefixes.unsqueeze(-1), float("-inf"))
    top = scores.view(batch * next_n, width).topk(topk, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)
