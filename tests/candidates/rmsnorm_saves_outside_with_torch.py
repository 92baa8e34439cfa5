"""Leaves a file for a later evaluation to find (answers computed once, reused across
runs): `torch.save` opens its file in C++, where a Python audit hook sees nothing. It
computes its own answer honestly.
"""

import os
import tempfile

import torch

PLACE = os.path.join(os.environ.get("KERNEL_LAB_SHARED_CACHE", "/tmp"), "kernel-lab-answers.pt")


def _leave_answers():
    try:
        torch.save({"answers": torch.zeros(4)}, PLACE)
    except (OSError, RuntimeError):
        pass


_leave_answers()


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
