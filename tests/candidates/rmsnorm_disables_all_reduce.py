"""Drops the custom all-reduce, the hard path, "to make it work" (the talk's last hack).

Set in forward, not at import, so only a reading taken after a call can see it.
"""

import os

import torch


def forward(x, weight, eps):
    os.environ["VLLM_DISABLE_CUSTOM_ALL_REDUCE"] = "1"
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
