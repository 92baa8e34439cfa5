"""All-reduce (sum) across the ranks of a process group: every rank ends with the sum of
every rank's tensor.

The op's size is the message: the bytes each rank contributes. Small messages are
latency-bound (a one-shot kernel, every rank reading every peer's buffer once, beats a
ring); large ones bandwidth-bound (a ring or two-shot wins): no single kernel is the
fastest everywhere, so a candidate is kept for the range of message sizes it wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runners.ops.base import Op, Workload, WorkloadError, compare_close, make_generator, sample

WORLD_SIZE = 2
KIB, MIB = 1024, 1024 * 1024
# From a decode step's hidden vector (4 KB) to a prefill's activations (64 MB).
MESSAGE_RANGE = (4 * KIB, 64 * MIB)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Every message holds a whole number of elements of every dtype.
_ALIGNMENT = max(dtype.itemsize for dtype in DTYPES.values())


class AllReduceSum(Op):
    name = "allreduce_sum"
    title = "All-reduce (sum)"
    world_size = WORLD_SIZE
    size_name = "message size"
    description = (
        f"Sum of one tensor per rank over a process group of {WORLD_SIZE} ranks, returned "
        "on every rank. Latency-bound for small messages, bandwidth-bound for large ones: "
        "the baseline is torch.distributed.all_reduce (NCCL on CUDA, gloo on the CPU)."
    )
    signature = "forward(x, comm) -> Tensor"
    tolerances = {
        # One rounding of a sum of two values; a candidate may add in another order.
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (1e-2, 1e-2),
    }

    def default_context_lengths(self, device: str) -> list[int]:
        """The message sizes (bytes per rank) measured by default. The CPU's stop at
        4 MB so a gloo evaluation stays within a minute on a small machine."""
        return {"cpu": [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB],
                "cuda": [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB,
                         16 * MIB, 64 * MIB]}[device]

    def context_length_range(self, device: str) -> tuple[int, int]:
        return MESSAGE_RANGE

    def default_batch_sizes(self, device: str) -> list[int]:
        return [1]

    def max_batch_size(self, device: str) -> int:
        return 1  # a collective has no batch: its size is the message

    def build_workloads(
        self, device: str, context_lengths: list[int], batch_sizes: list[int]
    ) -> list[Workload]:
        odd = [size for size in context_lengths if size % _ALIGNMENT]
        if odd:
            raise WorkloadError(f"message size {odd[0]:,} is not a multiple of {_ALIGNMENT} "
                                f"bytes: every message holds whole elements of every dtype")
        return [
            Workload(
                name=f"bytes={size},dtype={dtype}",
                device=device,
                params={"message_bytes": size, "dtype": dtype, "world_size": WORLD_SIZE,
                        "elements": size // DTYPES[dtype].itemsize},
            )
            for size in context_lengths
            for dtype in DTYPES
        ]

    sized_params = frozenset({"elements"})

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        """Every rank's tensor, one row per rank: the judge holds them all (for the
        reference); rank r is given row r alone, never the others'."""
        params = workload.params
        generator = make_generator(seed, workload.device)
        x = sample((params["world_size"], params["elements"]), generator=generator,
                   distribution=distribution, dtype=DTYPES[params["dtype"]])
        return {"x": x}

    def reference(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        return inputs["x"].double().sum(dim=0)

    def check(
        self, output: torch.Tensor, reference_output: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[bool, str]:
        """`output` is one rank's result; `inputs` hold every rank's tensor."""
        x = inputs["x"]
        if not isinstance(output, torch.Tensor):
            return False, f"output is a {type(output).__name__}, not a tensor"
        if output.dtype != x.dtype:
            return False, f"output dtype is {output.dtype}, expected {x.dtype} (the dtype of x)"
        if output.shape != x.shape[1:]:
            return False, f"output shape is {list(output.shape)}, expected {list(x.shape[1:])}"
        rtol, atol = self.tolerance(x.dtype)
        return compare_close(output, reference_output, rtol=rtol, atol=atol)

    def flops(self, workload: Workload) -> int:
        return (workload.params["world_size"] - 1) * workload.params["elements"]

    def bytes(self, workload: Workload) -> int:
        # What one rank moves in a one-shot all-reduce: its share written once, every
        # rank's share read, the sum written.
        return (workload.params["world_size"] + 2) * workload.params["message_bytes"]


OP = AllReduceSum(Path(__file__).parent)
