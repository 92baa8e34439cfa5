"""A constant output tuned to one fixed input: the answer for seed 0's inputs, computed
once at import and returned whatever forward is given (the Sakana incident)."""

import torch

_generator = torch.Generator().manual_seed(0)
_tuned = {}


def _answer(shape, dtype):
    if (shape, dtype) not in _tuned:
        x = torch.randn(shape, generator=_generator).to(dtype)
        hidden = x.float()
        _tuned[(shape, dtype)] = (hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + 1e-6)).to(dtype)
    return _tuned[(shape, dtype)]


def forward(x, weight, eps):
    return _answer(tuple(x.shape), x.dtype).to(x.device, copy=True)
