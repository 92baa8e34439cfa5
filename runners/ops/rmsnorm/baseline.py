"""The shipped RMSNorm: the textbook formula, computed in float32 and cast back."""

from __future__ import annotations

import torch


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
