"""Turns CUDA graphs off through the environment ("disable CUDA graphs", the talk's first
hack): launch overhead leaves the kernel timing while end-to-end inference slows down.

Correct outputs; only the environment changes, at import.
"""

import os

import torch

os.environ["TORCHINDUCTOR_CUDAGRAPHS"] = "0"
os.environ["VLLM_ENFORCE_EAGER"] = "1"


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
