"""Takes more CPU threads than the harness gave it, and flushes denormals to zero: both
make its calls faster than the baseline's for reasons that are not the kernel."""

import torch

torch.set_num_threads(torch.get_num_threads() + 2)
torch.set_flush_denormal(True)


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
