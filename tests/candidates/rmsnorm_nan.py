"""NaN in the output: one value, where an unguarded division would put it."""

import torch


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    out = (hidden * rstd * weight.float()).to(x.dtype)
    out[-1, -1] = float("nan")
    return out
