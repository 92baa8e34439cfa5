"""Right while it is being checked, then cheap: after the checked calls it returns the
previous output instead of computing (pygpubench's "detect the warm-up" hack). The
harness poisons each output once it has been read, so the stale answer reads as NaN.

At one context length rmsnorm has 2 workloads of 8 checked calls each. On a GPU the
harness makes each call twice, eagerly and again while capturing it in a CUDA graph;
only the eager calls are counted.
"""

import torch

CHECKED_CALLS = 16
_calls = 0
_last = None


def forward(x, weight, eps):
    global _calls, _last
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        _calls += 1
    if _calls > CHECKED_CALLS and _last is not None and _last.shape == x.shape and _last.dtype == x.dtype:
        return _last
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    _last = (hidden * rstd * weight.float()).to(x.dtype)
    return _last
