"""The lightning indexer over chunks of the context, reducing the top-k as it goes.

The baseline materialises [M, H, N] logits; at long contexts that tensor, not the
arithmetic, is the cost. Here only [M, H, chunk] exists at a time.

- chunk: context tokens scored per step.
- merge: "running" merges each chunk's top-k into a running top-k right away;
  "collect" keeps every chunk's top-k and selects once at the end.
- heads: "fused" scores all heads in one matmul and reduces them with a batched
  matmul against the weights; "loop" accumulates one head at a time, so only
  [M, chunk] float32 is live.
"""

from __future__ import annotations

import torch

from runners.kernel_lib.topk_torch import head_scores

PARAMS = {
    "chunk": 4096,
    "merge": "running",
    "heads": "fused",
}

SPACE = {
    "chunk": [1024, 4096, 16384, 65536],
    "merge": ["running", "collect"],
    "heads": ["fused", "loop"],
}


def _select(values: torch.Tensor, indices: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, order = values.topk(min(topk, values.shape[1]), dim=1)
    return values, indices.gather(1, order)


def forward(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    chunk = PARAMS["chunk"]
    kept_values: list[torch.Tensor] = []
    kept_indices: list[torch.Tensor] = []
    for start in range(0, k.shape[0], chunk):
        scores = head_scores(q, k[start:start + chunk], weights, fused=PARAMS["heads"] == "fused")
        values, indices = scores.topk(min(topk, scores.shape[1]), dim=1)
        kept_values.append(values)
        kept_indices.append(indices + start)
        if PARAMS["merge"] == "running" and len(kept_values) == 2:
            merged = _select(torch.cat(kept_values, dim=1), torch.cat(kept_indices, dim=1), topk)
            kept_values, kept_indices = [merged[0]], [merged[1]]
    _, indices = _select(torch.cat(kept_values, dim=1), torch.cat(kept_indices, dim=1), topk)
    return indices
