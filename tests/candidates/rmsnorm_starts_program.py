"""Starts a program at import (a compiler, a profiler, a shell), and carries on when refused."""

import subprocess

import torch

try:
    subprocess.run(["true"], check=False)
except OSError:
    pass


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
