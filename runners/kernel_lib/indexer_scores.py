"""Pieces of the CuTe DSL lightning indexers' scores kernels (logits_topk_cute,
logits_topk_fp8_cute and their paged forms) that are the same in all four: the
warpgroup sizes and register split, the head sums on the tensor cores (REDUCE="mma"),
and the host's tensor descriptions and stream.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.cutlass_dsl import T, dsl_user_op

MMA_THREADS = 256
REDUCTIONS = ("shuffle", "scatter", "mma")
# REDUCE="mma": the head-weighted sum is a second wgmma, m64n8k16 with the ReLU'd scores
# as its A (bfloat16, in registers) and the weights as its B; column n of B holds query
# row n % ROWS's weights, so every lane of a quad ends with whole sums.
HEAD_SUM_N = 8
# Registers per thread once the loading warpgroup gives its own up: 40 for it, and for
# each MMA warpgroup as many as fill the SM's 64K (multiples of 8): 232 when two take
# turns, 152 when three do (their accumulators then hold at most 128 columns).
LOADER_REGISTERS = 40
MMA_REGISTERS = {2: 232, 3: 152}
# TMA and wide loads need 16-byte aligned tensors; compile and launch agree on that.
ALIGN = 16


@dsl_user_op
def relu_bf16x2(low, high, *, loc=None, ip=None) -> cutlass.Int32:
    """relu(low) and relu(high) rounded to bfloat16, packed low first: one cvt."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(),
        [cutlass.Float32(low).ir_value(loc=loc, ip=ip), cutlass.Float32(high).ir_value(loc=loc, ip=ip)],
        "cvt.rn.relu.bf16x2.f32 $0, $2, $1;",
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def as_operand_a(cols: int) -> cute.Layout:
    """An accumulator's ((2, 2, cols/8), 1, 1) registers, compact, seen as a 16-bit wgmma
    A fragment ((2, 2, 2), 1, cols/16): a thread's values of accumulator columns
    16kk..16kk+15 sit where the A operand of k-block kk wants them (the register reuse
    FlashAttention-3 makes of P)."""
    return cute.make_layout(((2, 2, 2), 1, cols // 16), stride=((1, 2, 4), 0, 8))


@cute.jit
def head_sums(
    head_mma: cute.TiledMma, head_acc: cute.Tensor, acc: cute.Tensor, relu: cute.Tensor,
    tCrW: cute.Tensor, cols: cutlass.Constexpr,
):
    """head_acc = relu(acc) @ W on the tensor cores: one cvt per two scores, then
    cols/16 wgmma of m64n8k16. The caller waits for them."""
    packed = cute.recast_tensor(relu, cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = relu_bf16x2(acc[2 * i], acc[2 * i + 1])
    operand = cute.make_tensor(relu.iterator, as_operand_a(cols))
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cols // 16):
        head_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(head_mma, head_acc, operand[(None, None, kb)], tCrW[(None, None, kb, 0)], head_acc)
    warpgroup.commit_group()
    return head_mma


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
        fields = ([("data", ctypes.c_void_p)] + [(f"extent{i}", ctypes.c_int32) for i in range(len(extents))]
                  + [(f"stride{i}", ctypes.c_int64) for i in range(len(steps))])
        descriptor = type("Descriptor", (ctypes.Structure,), {"_fields_": fields})
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
