"""RMSNorm in CuTe DSL: one CTA per row, a block-level reduction, float32 accumulation.

Each thread walks the row in vectors of `vec` elements (one wide load each), squares
and sums them in float32; the CTA reduces those sums with warp shuffles and one
exchange through shared memory, then every thread rescales the vectors it read.

- threads: threads per CTA (per row).
- vec: elements per load and store; 8 bfloat16 or 4 float32 are one 128-bit access.

The kernel is compiled once per (dtype, shape, parameters) for the GPU in hand; on a
machine without one, CUTE_DSL_ARCH=sm_90a makes it compile for Hopper, and the launch
then fails for want of a GPU.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor

PARAMS = {
    "threads": 256,
    "vec": 8,
}

SPACE = {
    "threads": [128, 256, 512],
    "vec": [1, 4, 8],
}

_DTYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}
_WARP = 32


@cute.kernel
def _rmsnorm_row(
    x: cute.Tensor, weight: cute.Tensor, y: cute.Tensor, eps: cutlass.Float32,
    hidden: cutlass.Constexpr, threads: cutlass.Constexpr, vec: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    # (vec, hidden // vec) views: column j is the j-th vector of the row.
    x_row = cute.zipped_divide(x[row, None], (vec,))
    y_row = cute.zipped_divide(y[row, None], (vec,))
    w_row = cute.zipped_divide(weight, (vec,))
    vectors = hidden // vec

    squares = cutlass.Float32(0.0)
    for j in range(tidx, vectors, threads):
        chunk = cute.make_rmem_tensor((vec,), x.element_type)
        cute.autovec_copy(x_row[None, j], chunk)
        values = chunk.load().to(cutlass.Float32)
        squares += (values * values).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)

    # Block reduction: shuffles within each warp, then the warps' sums via shared memory.
    squares = cute.arch.warp_reduction_sum(squares)
    smem = cutlass.memory.SmemAllocator()
    warp_sums = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout((threads // _WARP,)), byte_alignment=16
    )
    # warp_idx() broadcasts with a full-warp shuffle, so every lane must call it: called
    # inside the lane-0 branch below, the shuffle waits for 31 lanes that never come.
    warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
    if lane == 0:
        warp_sums[warp] = squares
    cute.arch.sync_threads()
    total = cutlass.Float32(0.0)
    for w in cutlass.range_constexpr(threads // _WARP):
        total += warp_sums[w]
    rstd = cute.math.rsqrt(total / hidden + eps)

    for j in range(tidx, vectors, threads):
        chunk = cute.make_rmem_tensor((vec,), x.element_type)
        scale = cute.make_rmem_tensor((vec,), x.element_type)
        cute.autovec_copy(x_row[None, j], chunk)
        cute.autovec_copy(w_row[None, j], scale)
        out = cute.make_rmem_tensor((vec,), x.element_type)
        out.store(
            (chunk.load().to(cutlass.Float32) * rstd * scale.load().to(cutlass.Float32))
            .to(x.element_type)
        )
        cute.autovec_copy(out, y_row[None, j])


@cute.jit
def _launch(
    x: cute.Tensor, weight: cute.Tensor, y: cute.Tensor, eps: cutlass.Float32,
    stream: cuda.CUstream, threads: cutlass.Constexpr, vec: cutlass.Constexpr,
):
    _rmsnorm_row(x, weight, y, eps, x.shape[1], threads, vec).launch(
        grid=(x.shape[0], 1, 1), block=(threads, 1, 1), stream=stream
    )


def _vector(hidden: int) -> int:
    # Vectors must tile the row exactly.
    vec = PARAMS["vec"]
    while hidden % vec:
        vec //= 2
    return vec


# Wide accesses need 16-byte aligned tensors; compile and launch agree on that alignment.
_ALIGN = 16


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    # A view may start mid-allocation; a fresh copy starts where the allocator aligns.
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


@functools.cache
def compiled(dtype: torch.dtype, tokens: int, hidden: int, threads: int, vec: int):
    """The kernel compiled for one (dtype, shape, parameters); no GPU needed."""
    # Described, not allocated: global-memory row-major tensors of this shape.
    element = _DTYPES[dtype]
    x = make_fake_compact_tensor(
        element, (tokens, hidden), stride_order=(1, 0), assumed_align=_ALIGN
    )
    w = make_fake_compact_tensor(element, (hidden,), assumed_align=_ALIGN)
    return cute.compile(_launch, x, w, x, cutlass.Float32(0.0), cuda.CUstream(0), threads, vec)


def _stream(t: torch.Tensor) -> cuda.CUstream:
    """Torch's current stream on the tensor's device: the one a CUDA graph is being
    captured on, when it is (a launch on any other stream would not be captured). The
    null stream for a tensor off the GPU, whose launch then fails for want of one."""
    return cuda.CUstream(torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0)


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in _DTYPES:
        raise TypeError(f"rows_cute supports {sorted(map(str, _DTYPES))}, not {x.dtype}")
    x, weight = _aligned(x), _aligned(weight)
    tokens, hidden = x.shape
    y = torch.empty_like(x)
    kernel = compiled(x.dtype, tokens, hidden, PARAMS["threads"], _vector(hidden))
    kernel(*(from_dlpack(t, assumed_align=_ALIGN) for t in (x, weight, y)), cutlass.Float32(eps),
           _stream(x))
    return y
