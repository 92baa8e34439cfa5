"""Right, and fast once warm, but it compiles for the longest length of the batch it
is given: a JIT kernel specialised on `int(context_lens.max())`, the way a kernel
that sizes its grid from the lengths on the host is. Simulated by sleeping COMPILE_S
on the first call at each longest length. In a server every decode step makes every
length one longer, so it pays the compile every step, although the shapes of its
inputs (the bucket's) never change.
"""

import time

import torch

COMPILE_S = 0.3
_compiled = set()


def forward(q, kv_cache, block_table, context_lens, weights, topk):
    longest = int(context_lens.max())
    if longest not in _compiled:
        time.sleep(COMPILE_S)
        _compiled.add(longest)
    batch, next_n, heads, dim = q.shape
    width = block_table.shape[1] * kv_cache.shape[1]
    keys = kv_cache[block_table.long()].view(batch, width, dim)
    logits = torch.einsum("bjhd,bnd->bjhn", q, keys).float().relu_()
    scores = torch.einsum("bjhn,bjh->bjn", logits, weights.view(batch, next_n, heads))
    prefixes = context_lens.long().view(-1, 1) - next_n + 1 + torch.arange(next_n, device=q.device)
    scores.masked_fill_(torch.arange(width, device=q.device) >= prefixes.unsqueeze(-1), float("-inf"))
    top = scores.view(batch * next_n, width).topk(topk, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)
