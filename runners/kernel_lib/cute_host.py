"""The host side of a CuTe DSL kernel, the same for every one: tensors aligned for TMA
and wide loads, tensors described for a compile that has none, runtime sizes, the
stream to launch on, the GPU's SM count, and a compiled program that takes torch tensors.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

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


@functools.cache
def _descriptor_type(extents: int, strides: int) -> type[ctypes.Structure]:
    """The memref descriptor's C layout for so many runtime extents and strides: made once
    per layout, not on every launch."""
    fields = ([("data", ctypes.c_void_p)] + [(f"extent{i}", ctypes.c_int32) for i in range(extents)]
              + [(f"stride{i}", ctypes.c_int64) for i in range(strides)])
    return type("Descriptor", (ctypes.Structure,), {"_fields_": fields})


class _RuntimeTensor:
    """A torch tensor as the argument of a program compiled for a fake tensor whose
    extents are partly runtime values (cute.sym_int): the memref descriptor the program
    reads, that is the data pointer, then each runtime extent (int32), then each
    runtime stride (int64), in mode order.

    `from_dlpack` cannot make it: its tensors are static unless marked, and its marks
    never make a stride a runtime value. Handed a static tensor, such a program read
    extents from past the end of the descriptor (a grid of 0 CTAs, which CUDA refused
    as an invalid launch)."""

    def __init__(self, t: torch.Tensor, fake: Any) -> None:
        shapes, strides = fake.dynamic_shapes_mask, fake.dynamic_strides_mask
        if t.dim() != len(shapes) or any(not dynamic and t.shape[mode] != extent
                                         for mode, (dynamic, extent) in enumerate(zip(shapes, fake.shape))):
            raise ValueError(f"a tensor of shape {tuple(t.shape)} for a program compiled for {fake.shape}")
        if t.data_ptr() % ALIGN:
            raise ValueError(f"the program assumes {ALIGN}-byte aligned tensors; this one starts at {t.data_ptr():#x}")
        extents = [t.shape[mode] for mode, dynamic in enumerate(shapes) if dynamic]
        steps = [t.stride(mode) for mode, dynamic in enumerate(strides) if dynamic]
        descriptor = _descriptor_type(len(extents), len(steps))
        self.tensor = t  # the memory stays alive while the call runs
        self.descriptor = descriptor(t.data_ptr(), *extents, *steps)

    def __c_pointers__(self) -> list[int]:
        return [ctypes.addressof(self.descriptor)]


class Program:
    """A compiled CuTe program called with torch tensors: each tensor argument is passed
    as the fake tensor it was compiled for describes it (its runtime extents and
    strides), the other arguments as they are. Everything else is the compiled
    program's (its PTX, say). Its compile-time arguments (cutlass.Constexpr) come last
    and are not passed again."""

    def __init__(self, compiled: Any, arguments: Sequence[Any]) -> None:
        self.compiled = compiled
        # A fake tensor (make_fake_compact_tensor's) is the argument that says which of its
        # extents and strides are runtime values.
        self.fakes = [argument if hasattr(argument, "dynamic_shapes_mask") else None for argument in arguments]

    def __call__(self, *arguments: Any) -> Any:
        return self.compiled(*(_RuntimeTensor(argument, fake) if fake is not None else argument
                               for argument, fake in zip(arguments, self.fakes)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def current_stream(t: torch.Tensor) -> cuda.CUstream:
    """Torch's current stream on the tensor's device: the one a CUDA graph is being
    captured on, when it is (a launch on any other stream would not be captured). The
    null stream for a tensor off the GPU, whose launch then fails for want of one."""
    return cuda.CUstream(torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0)
