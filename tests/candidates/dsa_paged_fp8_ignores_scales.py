"""Right where every token of the cache has one scale, wrong otherwise: the bf16 paged
kernel ported to FP8 by widening the e4m3 values to bfloat16 (exact), with `kv_scale`
never read. DeepGEMM's `fp8_paged_mqa_logits` packs each token's scale into the cache
beside its e4m3 values, so a kernel that loads only the e4m3 bytes drops it the same way.
One positive scale for every token scales every logit, so every score, by the same
factor, and the ranking is the right one; the indexer's cache quantises each token by
its own absmax, so its scales differ and the scores it ranks are not the op's."""

import torch


def forward(q, kv_cache, kv_scale, block_table, context_lens, weights, topk):
    batch, next_n, heads, dim = q.shape
    width = block_table.shape[1] * kv_cache.shape[1]
    keys = kv_cache[block_table.long()].view(batch, width, dim).bfloat16()
    logits = torch.einsum("bjhd,bnd->bjhn", q.bfloat16(), keys).float().relu_()
    scores = torch.einsum("bjhn,bjh->bjn", logits, weights.view(batch, next_n, heads))
    # The lengths are honoured: row (b, j) sees the first context_lens[b] - next_n + 1 + j tokens.
    prefixes = context_lens.long().view(-1, 1) - next_n + 1 + torch.arange(next_n, device=q.device)
    scores.masked_fill_(torch.arange(width, device=q.device) >= prefixes.unsqueeze(-1), float("-inf"))
    top = scores.view(batch * next_n, width).topk(topk, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)
