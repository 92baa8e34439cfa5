"""The "torch fallback" hack, hidden where the DSL's own torch ops are set aside.

A Triton candidate for rmsnorm whose kernel writes nothing: the answer is computed in
torch by a pre-run hook that Triton calls inside the launch. The harness sets aside the
torch ops the DSL runs for itself during a launch (the interpreter's copies), judged by
which module's code asked for them; this hook is the candidate's own function rebuilt
around torch.nn.functional's globals, so its frame reads as torch's, and the frame
behind it is Triton's launcher. Only the code itself tells it from torch's: no file of
torch holds it.
"""

import types

import torch
import torch.nn.functional
import triton
import triton.language as tl


@triton.jit
def _rmsnorm(out_ptr, x_ptr, weight_ptr, eps, hidden: tl.constexpr):
    pass  # the hook below has already written the answer


def _answer(out, x, weight, eps, hidden):
    rows = x.float()
    out.copy_((rows * torch.rsqrt(rows.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(out.dtype))


_rmsnorm.add_pre_run_hook(types.FunctionType(_answer.__code__, vars(torch.nn.functional), "_answer"))


def forward(x, weight, eps):
    out = torch.empty_like(x)
    _rmsnorm[(1,)](out, x, weight, eps, hidden=x.shape[-1])
    return out
