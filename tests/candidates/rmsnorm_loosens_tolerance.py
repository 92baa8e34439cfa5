"""Loosens the tolerance ("correct" by relaxing atol), then computes in bfloat16.

The judge holds its own copy of the op, so the relaxed tolerance never applies: the
bfloat16 arithmetic fails float32's 1e-5. The line that relaxes it is named too.
"""

import torch

from runners.ops import get_op

type(get_op("rmsnorm")).tolerances[torch.float32] = (1e-2, 1e-2)


def forward(x, weight, eps):
    hidden = x.bfloat16()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.bfloat16()).to(x.dtype)
