"""Correct: torch's fused rms_norm in float32, rounded once."""

import torch.nn.functional as F


def forward(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
