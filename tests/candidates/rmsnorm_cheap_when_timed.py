"""Right while it is being checked, then cheap: after the checked calls it returns the
previous output instead of computing (pygpubench's "detect the warm-up" hack). Every
timed call has inputs no earlier call had, so the stale answer is wrong.

It knows the harness's protocol: the process that checks it calls each workload's
checked calls together, one workload after another, never going back to one; a timing
process replays the workloads once each (runners/harness/correctness.py,
REPLAY_ORDER) and then times them in turn. So the first time a call goes back to an
earlier workload, it is being timed, and every call from then on is. On a GPU forward
itself runs only when the harness captures a slot (once eagerly, once while
capturing): only the eager calls are counted.
"""

import torch

_seen = []  # the (shape, dtype) of each workload called so far, the latest last
_timed = False
_last = None


def forward(x, weight, eps):
    global _last, _timed
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        workload = (x.shape, x.dtype)
        if workload in _seen[:-1]:
            _timed = True  # back at an earlier workload: the timing loop
        if not _seen or _seen[-1] != workload:
            _seen.append(workload)
    if _timed and _last is not None and _last.shape == x.shape and _last.dtype == x.dtype:
        return _last
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    _last = (hidden * rstd * weight.float()).to(x.dtype)
    return _last
