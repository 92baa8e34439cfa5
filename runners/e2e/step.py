"""Builds the decode step for one end-to-end point, in the production configuration.

On CUDA the whole step is captured in one CUDA graph and replayed, as a server runs it:
a kernel that cannot be captured fails here, and launch overhead it adds is counted.
On the CPU the same step runs eagerly at the small shape so CI exercises the code path.
The paged indexer ops run a decode loop instead (model.PagedDecodeLoop): K steps per
call over paged caches whose contexts grow by a token every step, captured once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from runners.e2e.model import SHAPES, DecodeStep, Dispatch, Kernel, PagedDecodeLoop
from runners.harness import timing
from runners.ops import get_op

DISPATCHED_OPS = ("rmsnorm", "dsa_indexer_topk", "dsa_indexer_topk_fp8", "dsa_indexer_topk_paged",
                  "dsa_indexer_topk_paged_fp8")
PAGED_OPS = ("dsa_indexer_topk_paged", "dsa_indexer_topk_paged_fp8")
WARMUP_CALLS = 3


class CaptureError(timing.CaptureError, RuntimeError):
    """The step, with the kernel under test dispatched in, cannot run as a CUDA graph.

    A timing.CaptureError, so a child reports it as a capture failure (kind "capture")."""


def _module_forward(path: Path) -> Kernel:
    spec = importlib.util.spec_from_file_location(f"kept_{path.parent.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forward


def kept_dispatch() -> dict[str, Kernel]:
    """The kept kernel of every dispatched op (the ops' baselines)."""
    return {name: _module_forward(get_op(name).baseline_path) for name in DISPATCHED_OPS}


def build_step(op_name: str, kernel: Kernel, *, device: str, context_length: int, batch: int,
               seed: int, others: Mapping[str, Kernel] | None = None) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running one decode step with `kernel` serving `op_name`
    (K steps of the decode loop for the paged ops) and `others` serving their ops (the
    ops' shipped baselines serve the rest)."""
    for name in (op_name, *(others or {})):
        if name not in DISPATCHED_OPS:
            raise ValueError(f"the decode step does not dispatch {name!r} (it dispatches {', '.join(DISPATCHED_OPS)})")
    kernels = {**kept_dispatch(), **(others or {})}
    kernels[op_name] = kernel
    if op_name in PAGED_OPS:
        step = PagedDecodeLoop(SHAPES[device], context_length=context_length, batch=batch,
                               device=device, seed=seed, dispatch=Dispatch(**kernels),
                               fp8_indexer=op_name.endswith("_fp8"),
                               steps=get_op(op_name).decode_steps[device])
    else:
        # The fp8 op is served by the step's fp8 indexer; every other op beside the bf16 one.
        step = DecodeStep(SHAPES[device], context_length=context_length, batch=batch, device=device,
                          seed=seed, dispatch=Dispatch(**kernels),
                          fp8_indexer=op_name == "dsa_indexer_topk_fp8")
    if device != "cuda":
        return step
    return _captured(step)


def _captured(step: DecodeStep) -> Callable[[], torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream, as capture requires
        for _ in range(WARMUP_CALLS):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            output = step()
    except Exception as error:  # noqa: BLE001 — any capture failure rejects the same way
        raise CaptureError(timing.first_cause(error)) from error

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay
