"""The FP8 lightning indexer in plain torch: dequantize, every score of every head, top-k.

Every e4m3 value is exact in bfloat16, so widening q and k loses nothing and the
matmul runs as torch runs the bf16 indexer's; k's per-token scale then multiplies the
logits before the ReLU, which is the scores of the dequantized keys.
"""

from __future__ import annotations

import torch


def forward(
    q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, topk: int
) -> torch.Tensor:
    logits = torch.einsum("mhd,nd->mhn", q.bfloat16(), k.bfloat16()).float()
    logits.mul_(k_scale).relu_()
    scores = torch.einsum("mhn,mh->mn", logits, weights)
    return scores.topk(topk, dim=-1).indices
