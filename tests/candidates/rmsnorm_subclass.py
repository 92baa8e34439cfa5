"""A tensor subclass: the work could be deferred into whatever inspects the output."""

import torch


class Deferred(torch.Tensor):
    pass


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype).as_subclass(Deferred)
