"""The paged indexer one sequence at a time, over its own blocks only.

The baseline gathers every sequence to the widest context and scores the padding too:
in a mixed batch most of that is waste. Here each sequence gathers its own blocks and
scores its prefix in chunks, keeping a running top-k (runners.kernel_lib.topk_torch). It
reads the lengths on the host, so it cannot be captured in a CUDA graph: a CPU kernel,
and a starting point.

- chunk: context tokens scored per step.
- heads: "fused" scores all heads in one matmul and reduces them with a batched matmul
  against the weights; "loop" accumulates one head at a time.
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
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, weights: torch.Tensor, topk: int,
) -> torch.Tensor:
    return paged_topk(q, kv_cache, block_table, context_lens, weights, topk,
                      chunk=PARAMS["chunk"], fused=PARAMS["heads"] == "fused")
