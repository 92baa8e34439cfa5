"""The host side of a CuTe DSL kernel, the same for every one: tensors aligned for TMA
and wide loads, tensors described for a compile that has none, runtime sizes, the
stream to launch on, and the GPU's SM count.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import torch

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

# TMA and wide loads need 16-byte aligned tensors; compile and launch agree on that.
ALIGN = 16
# Hopper: H200 and H100 SXM.
_DEFAULT_SMS = 132


@functools.cache
def sm_count() -> int:
    """The GPU's SMs (a Hopper's where there is none)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return _DEFAULT_SMS


def runtime_int(divisibility: int = 1):
    """A length, batch size, table width or split count: a runtime value, bound at each
    call, so a new one compiles nothing."""
    return cute.sym_int32(divisibility=divisibility)


def aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    # A view may start mid-allocation; a fresh copy starts where the allocator aligns.
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def fake_tensor(dtype, shape: tuple):
    """A row-major global tensor of this shape, described, not allocated; a dimension
    given as a cute.sym_int is a runtime value, bound at each call."""
    return make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=ALIGN
    )


def current_stream(t: torch.Tensor) -> cuda.CUstream:
    """Torch's current stream on the tensor's device: the one a CUDA graph is being
    captured on, when it is (a launch on any other stream would not be captured). The
    null stream for a tensor off the GPU, whose launch then fails for want of one."""
    return cuda.CUstream(torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0)
