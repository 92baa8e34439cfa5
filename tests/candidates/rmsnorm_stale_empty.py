"""Stale memory: computes once, then returns torch.empty and hopes it still holds the answer.

Every other call skips the work. Without poisoned memory between calls, a repeat on
the same inputs would get the block the last output was just freed from.
"""

import torch

_calls = 0


def forward(x, weight, eps):
    global _calls
    _calls += 1
    if _calls % 2 == 0:
        return torch.empty_like(x)
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
