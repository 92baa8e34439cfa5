"""Wrong dtype: returns float32 whatever the input, silently changing the precision."""

import torch


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return hidden * rstd * weight.float()
