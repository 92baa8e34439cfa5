"""Off by one: the loop stops one row short, so the last row is never written."""

import torch


def forward(x, weight, eps):
    out = torch.zeros_like(x)
    hidden = x.float()
    for row in range(x.shape[0] - 1):
        rstd = torch.rsqrt(hidden[row].square().mean() + eps)
        out[row] = (hidden[row] * rstd * weight.float()).to(x.dtype)
    return out
