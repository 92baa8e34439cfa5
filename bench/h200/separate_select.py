"""A separate top-k for logits some other kernel wrote: our CuTe select, fed a histogram.

DeepGEMM's `fp8_mqa_logits` and `fp8_paged_mqa_logits` stop at the [rows, N] float32
logits; a serving engine follows them with its own top-k. The best separate top-k at
hand is the select of `logits_topk_cute` (one CTA per row, one pass over the row, exact,
ties to the lowest index, deterministic). It expects the first radix digit's histogram
that our scores kernel fuses in, so here one more launch makes it: a pass over the
logits that counts each row's scores by their top 11 key bits, and, where a row sees
fewer tokens than the logits are wide (a paged sequence shorter than the longest), first
overwrites the scores past its length with -inf (DeepGEMM leaves them unwritten), so
they sort last. Rows shorter than top-k then get the lowest-indexed -inf positions,
which `select` turns into -1, as the paged ops want.

Two launches then, count and select, both compiled once per (rows, width, top-k).
Needs CuTe DSL; compiles without a GPU under CUTE_DSL_ARCH=sm_90a.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "runners").is_dir())


def _load_select_module():
    """The kept bf16 kernel's module, as the project ships it (its select is shared by
    the e4m3 kernel)."""
    name = "_separate_select_logits_topk_cute"
    if name in sys.modules:
        return sys.modules[name]
    path = ROOT / "runners/ops/dsa_indexer_topk/kernels/logits_topk_cute.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_cute_select = _load_select_module()
sys.path.insert(0, str(ROOT))
from runners.kernel_lib.cute_host import Program, current_stream, fake_tensor, sm_count  # noqa: E402
from runners.kernel_lib.indexer_select import BINS as _BINS, radix_key, write_hist  # noqa: E402
_COUNT_THREADS = 256
SELECT_THREADS = 1024


@cute.kernel
def _mask_and_count(
    scores: cute.Tensor, lengths: cute.Tensor, hist: cute.Tensor, tokens_per_cta: cutlass.Constexpr,
):
    """One span of one row per CTA: scores past the row's length become -inf, and every
    score's first digit (key bits 31..21, as the select reads them) is counted in shared
    memory, then written to hist[split, row, :]."""
    tidx, _, _ = cute.arch.thread_idx()
    split, row, _ = cute.arch.block_idx()
    context = scores.shape[1]

    smem = cutlass.memory.SmemAllocator()
    sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(_BINS), 16)
    for i in cutlass.range(tidx, _BINS, _COUNT_THREADS, unroll=1):
        sHist[i] = 0
    cute.arch.sync_threads()

    valid = lengths[row]
    start = split * tokens_per_cta
    end = cutlass.min(start + tokens_per_cta, context)
    # Unrolled so each thread has several loads in flight: the pass is memory-bound.
    for token in cutlass.range(start + tidx, end, _COUNT_THREADS, unroll=4):
        score = scores[row, token]
        if token >= valid:
            score = cutlass.Float32(-math.inf)
            scores[row, token] = score
        digit = cutlass.Int32(radix_key(score) >> cutlass.Uint32(21))
        cute.arch.atomic_add(sHist.iterator + digit, cutlass.Int32(1))

    cute.arch.sync_threads()
    write_hist(sHist, hist, split, row, 1, _COUNT_THREADS)


@cute.jit
def _launch_count(
    scores: cute.Tensor, lengths: cute.Tensor, hist: cute.Tensor, stream: cuda.CUstream,
    tokens_per_cta: cutlass.Constexpr,
):
    _mask_and_count(scores, lengths, hist, tokens_per_cta).launch(
        grid=(hist.shape[0], scores.shape[0], 1), block=(_COUNT_THREADS, 1, 1), stream=stream
    )


def splits_for(rows: int, context: int, sms: int) -> tuple[int, int]:
    """(CTAs per row, tokens each): about four CTAs per SM, spans a multiple of the block."""
    wanted = max(1, 4 * sms // rows)
    per_cta = math.ceil(math.ceil(context / wanted) / _COUNT_THREADS) * _COUNT_THREADS
    return math.ceil(context / per_cta), per_cta


@functools.cache
def compiled_count(rows: int, context: int, splits: int, per_cta: int):
    fake = fake_tensor
    arguments = (fake(cutlass.Float32, (rows, context)), fake(cutlass.Int32, (rows,)),
                 fake(cutlass.Int32, (splits, rows, _BINS)), cuda.CUstream(0), per_cta)
    return Program(cute.compile(_launch_count, *arguments), arguments)


def compile_for(rows: int, context: int, topk: int) -> None:
    """Both kernels for this shape, before any capture (capture cannot compile)."""
    splits, per_cta = splits_for(rows, context, sm_count())
    compiled_count(rows, context, splits, per_cta)
    _cute_select.compiled_select(topk, SELECT_THREADS, *_cute_select.select_bucket(context))


def select(logits: torch.Tensor, lengths: torch.Tensor, topk: int, pad: bool) -> torch.Tensor:
    """Top-k indices [rows, topk] (int64, in token order) of each row's first lengths[row]
    scores of `logits` [rows, N] (float32, row-major; overwritten past each length).
    With `pad`, positions at or past a row's length (chosen only where it is shorter
    than topk) read -1."""
    if not logits.is_contiguous():
        raise ValueError("the select reads row-major logits without padding between rows")
    rows, context = logits.shape
    splits, per_cta = splits_for(rows, context, sm_count())
    hist = torch.empty(splits, rows, _BINS, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, topk, dtype=torch.int64, device=logits.device)
    stream = current_stream(logits)
    compiled_count(rows, context, splits, per_cta)(logits, lengths, hist, stream)
    _cute_select.compiled_select(topk, SELECT_THREADS, *_cute_select.select_bucket(context))(
        logits, hist, out, stream)
    if pad:
        out.masked_fill_(out >= lengths.unsqueeze(1), -1)
    return out
