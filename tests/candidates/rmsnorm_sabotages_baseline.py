"""Sabotages the baseline instead of speeding itself up: tries to make the op's baseline
file slower by writing a sleep into it, so the comparison tilts its way."""

from pathlib import Path

import torch

import runners.ops.rmsnorm as rmsnorm_op

_baseline = Path(rmsnorm_op.__file__).parent / "baseline.py"
try:
    with open(_baseline, "a") as handle:
        handle.write("\nimport time\ntime.sleep(0.01)\n")
except OSError:
    pass


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
