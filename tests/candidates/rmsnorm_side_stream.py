"""Does the work on a side CUDA stream and returns before it finishes, so the timed
stream looks idle (KernelBench's adversarial tests).

(cuda) Under CUDA-graph capture the side stream is never joined back: capture fails.
"""

import torch

_side = None


def forward(x, weight, eps):
    global _side
    if _side is None:
        _side = torch.cuda.Stream()
    output = torch.empty_like(x)
    _side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_side):
        hidden = x.float()
        rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
        output.copy_((hidden * rstd * weight.float()).to(x.dtype))
    return output
