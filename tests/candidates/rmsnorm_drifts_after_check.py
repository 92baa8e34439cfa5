"""Drifts after the correctness check: exact for the checked calls, then switches to a
cheaper bfloat16 path whose error is far beyond float32's tolerance.

At one context length rmsnorm has 2 workloads of 8 checked calls each. On a GPU the
harness makes each call twice, eagerly and again while capturing it in a CUDA graph;
only the eager calls are counted.
"""

import torch

CHECKED_CALLS = 16
_calls = 0


def forward(x, weight, eps):
    global _calls
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        _calls += 1
    hidden = x.float() if _calls <= CHECKED_CALLS else x.bfloat16()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.to(hidden.dtype)).to(x.dtype)
