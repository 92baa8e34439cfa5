"""Tampers with the evaluator in-process: replaces the function that writes the child's
replies, to shave what it reports (reference-kernels EVALUATOR_SECURITY.md)."""

import torch

from runners.harness import wire

_real_write = wire.write_message


def _write(fd, header, tensors=None):
    if isinstance(header.get("ms"), float):
        header = {**header, "ms": header["ms"] / 2}
    _real_write(fd, header, tensors)


wire.write_message = _write


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
