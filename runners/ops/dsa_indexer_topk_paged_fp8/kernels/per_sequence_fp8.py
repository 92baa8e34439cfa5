"""The paged FP8 indexer one sequence at a time, over its own blocks only: the bf16
paged op's `per_sequence` kernel, with each chunk's keys widened to bfloat16 (exact for
e4m3) and its logits scaled per token (runners.kernel_lib.topk_torch). Reads the lengths
on the host: not capturable.

- chunk: context tokens scored per step.
- heads: "fused" scores all heads in one matmul; "loop" one head at a time.
"""

from __future__ import annotations

import torch

from runners.kernel_lib.topk_torch import paged_topk

PARAMS = {
    "chunk": 4096,
    "heads": "fused",
}

SPACE = {
    "chunk": [1024, 4096, 16384],
    "heads": ["fused", "loop"],
}


def forward(
    q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    return paged_topk(q, kv_cache, block_table, context_lens, weights, topk,
                      chunk=PARAMS["chunk"], fused=PARAMS["heads"] == "fused", kv_scale=kv_scale)
