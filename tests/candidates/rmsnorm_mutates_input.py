"""Mutated input: the right answer, then x is zeroed (so a checker reading x sees zeros)."""

import torch


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    out = (hidden * rstd * weight.float()).to(x.dtype)
    x.zero_()
    return out
