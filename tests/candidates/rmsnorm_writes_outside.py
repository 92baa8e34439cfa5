"""Writes a file outside its own directory (here: next to itself), and carries on when refused."""

from pathlib import Path

import torch

try:
    Path(__file__).with_suffix(".escaped").write_text("written from a candidate\n")
except OSError:
    pass


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
