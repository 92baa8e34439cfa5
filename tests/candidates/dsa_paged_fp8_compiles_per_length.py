"""Right, and fast once warm, but it compiles for the longest length of the batch it is
given: the op's per-sequence kernel (runners.kernel_lib.topk_torch.paged_topk) with its
chunk specialised to span the longest sequence, the way a JIT kernel that sizes its
tiles from `int(context_lens.max())` on the host is. Simulated by sleeping COMPILE_S on
the first call at each longest length. In a server every decode step makes every length
one longer, so it pays the compile every step, although the shapes of its inputs (the
bucket's) never change.
"""

import time

from runners.kernel_lib.topk_torch import paged_topk

COMPILE_S = 0.3
_compiled = set()


def forward(q, kv_cache, kv_scale, block_table, context_lens, weights, topk):
    longest = int(context_lens.max())
    if longest not in _compiled:
        time.sleep(COMPILE_S)
        _compiled.add(longest)
    block = kv_cache.shape[1]
    # Whole blocks of the longest sequence: every sequence is scored in one step.
    span = max(1, -(-longest // block)) * block
    return paged_topk(q, kv_cache, block_table, context_lens, weights, topk,
                      chunk=span, fused=True, kv_scale=kv_scale)
