"""Partial write: computes only the first half of the rows (the "147x" kernel)."""

import torch


def forward(x, weight, eps):
    out = torch.empty_like(x)
    half = x[: x.shape[0] // 2].float()
    rstd = torch.rsqrt(half.square().mean(dim=-1, keepdim=True) + eps)
    out[: half.shape[0]] = (half * rstd * weight.float()).to(x.dtype)
    return out
