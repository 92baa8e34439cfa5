"""Right and fast once warm, but the first call at every new shape pays a compile: a
JIT kernel specialised on its sizes (the kept CuTe indexers compiled per context length
for 0.8-1.5 s). Simulated here by sleeping COMPILE_S on the first call of each (shape,
dtype). Warm-up absorbs it, so every timed call is fast; a serving engine, whose sizes
change every step, pays it every step.
"""

import time

import torch

COMPILE_S = 0.3
_compiled = set()


def forward(x, weight, eps):
    if (tuple(x.shape), x.dtype) not in _compiled:
        time.sleep(COMPILE_S)
        _compiled.add((tuple(x.shape), x.dtype))
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
