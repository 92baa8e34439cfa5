"""Right when every sequence is as long as the block table is wide, wrong otherwise: one
sequence at a time, it scores every block the sequence's row of the table lists, with
the FP8 keys scaled per token as the op's own per-sequence kernel scores them
(runners.kernel_lib.topk_torch.head_scores), and never reads `context_lens`. In a batch
of equal lengths that is the answer; in a mixed one it reads past each sequence's end
into other sequences' blocks (and, with next_n = 2, past each row's causal prefix)."""

import torch

from runners.kernel_lib.topk_torch import head_scores


def forward(q, kv_cache, kv_scale, block_table, context_lens, weights, topk):
    batch, next_n, heads, dim = q.shape
    rows = weights.view(batch, next_n, heads)
    picked = []
    for sequence in range(batch):  # the batch's shape, not its lengths: no host read
        blocks = block_table[sequence].long()
        keys = kv_cache[blocks].reshape(-1, dim).bfloat16()  # e4m3 widens to bfloat16 exactly
        scores = head_scores(q[sequence].bfloat16(), keys, rows[sequence], fused=True,
                             key_scales=kv_scale[blocks].reshape(-1))
        picked.append(scores.topk(topk, dim=-1).indices)
    return torch.cat(picked)
