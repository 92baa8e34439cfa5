"""A constant output tuned to one fixed input: the answer for seed 0's inputs, computed
once per shape (at the first, eager call) and returned whatever forward is given (the
Sakana incident). On a GPU the answer is kept on the device and each call copies it,
which a CUDA graph captures like any kernel."""

import torch

_generator = torch.Generator().manual_seed(0)
_tuned = {}


def _answer(shape, dtype, device):
    key = (shape, dtype, device)
    if key not in _tuned:
        x = torch.randn(shape, generator=_generator).to(dtype)
        hidden = x.float()
        _tuned[key] = (hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + 1e-6)).to(dtype).to(device)
    return _tuned[key]


def forward(x, weight, eps):
    return _answer(tuple(x.shape), x.dtype, x.device).clone()
