"""Drifts after the correctness check: exact for the checked calls, then switches to a
cheaper bfloat16 path whose error is far beyond float32's tolerance.

At one context length rmsnorm has 2 workloads of 10 checked calls each, then 4 secret
sizes of 4: 36 calls on a CPU. On a GPU forward itself runs only when the harness
captures a slot (once eagerly, once while capturing; only the eager calls are counted):
6 checked slots, then the timed one.
"""

import torch

CHECKED_CALLS = 6 if torch.cuda.is_available() else 36
_calls = 0


def forward(x, weight, eps):
    global _calls
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        _calls += 1
    hidden = x.float() if _calls <= CHECKED_CALLS else x.bfloat16()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.to(hidden.dtype)).to(x.dtype)
