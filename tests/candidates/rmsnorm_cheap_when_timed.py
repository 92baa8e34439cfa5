"""Right while it is being checked, then cheap: after the checked calls it returns the
previous output instead of computing (pygpubench's "detect the warm-up" hack). Every
timed call has inputs no earlier call had, so the stale answer is wrong.

At one context length rmsnorm has 2 workloads of 10 checked calls each, then 4 secret
sizes of 4: 36 calls on a CPU. On a GPU forward itself runs only when the harness
captures a slot (once eagerly, once while capturing; only the eager calls are counted):
6 checked slots, then the timed one.
"""

import torch

CHECKED_CALLS = 6 if torch.cuda.is_available() else 36
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
