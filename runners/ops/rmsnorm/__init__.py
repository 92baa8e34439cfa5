"""RMSNorm over the hidden dimension: y = x / sqrt(mean(x^2) + eps) * weight."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runners.ops.base import Op, Workload, compare_close, make_generator, sample

# The CPU hidden size is smaller so one CPU evaluation stays within a few seconds.
HIDDEN = {"cpu": 1024, "cuda": 4096}
EPS = 1e-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class RMSNorm(Op):
    name = "rmsnorm"
    title = "RMSNorm"
    cpu_served = True
    description = (
        "Root-mean-square normalisation of each token's hidden vector, scaled by a "
        "learned weight. Memory-bound: one read of x, one write of y."
    )
    signature = "forward(x, weight, eps) -> Tensor"
    tolerances = {
        torch.float32: (1e-5, 1e-5),
        # bfloat16 keeps 8 bits of mantissa: one rounding of the output alone is ~0.4%.
        torch.bfloat16: (1e-2, 1e-2),
    }

    def default_context_lengths(self, device: str) -> list[int]:
        return {"cpu": [64, 512, 4096], "cuda": [128, 1024, 8192, 65536]}[device]

    def default_batch_sizes(self, device: str) -> list[int]:
        return [1]

    def context_length_range(self, device: str) -> tuple[int, int]:
        return 1, {"cpu": 16384, "cuda": 131072}[device]

    def max_batch_size(self, device: str) -> int:
        return 4

    def build_workloads(
        self, device: str, context_lengths: list[int], batch_sizes: list[int]
    ) -> list[Workload]:
        tokens = sorted({context * batch for context in context_lengths for batch in batch_sizes})
        return [
            Workload(
                name=f"t={count},dtype={dtype}",
                device=device,
                params={"tokens": count, "hidden": HIDDEN[device], "dtype": dtype, "eps": EPS},
            )
            for count in tokens
            for dtype in DTYPES
        ]

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        params = workload.params
        dtype = DTYPES[params["dtype"]]
        generator = make_generator(seed, workload.device)
        x = sample((params["tokens"], params["hidden"]),
                   generator=generator, distribution=distribution, dtype=dtype)
        noise = sample((params["hidden"],),
                       generator=generator, distribution=distribution, dtype=torch.float32)
        weight = (1 + 0.1 * noise).to(dtype)
        # Rows where eps decides the answer: one of zeros and about one in sixteen whose
        # mean square is EPS. Normal rows' mean square is ~1, where a kernel that drops
        # eps, or bakes in another, is right to within any tolerance.
        quiet = torch.rand(params["tokens"], generator=generator, device=generator.device) < 1 / 16
        scale = torch.where(quiet, math.sqrt(EPS), 1.0)
        scale[int(torch.randint(params["tokens"], (1,), generator=generator, device=generator.device))] = 0.0
        x = (x.float() * scale[:, None].to(x.device)).to(dtype)
        return {"x": x, "weight": weight, "eps": params["eps"]}

    def secret_params(self, workload: Workload, draw: random.Random) -> dict[str, Any]:
        # Models ship eps from 1e-6 to 1e-5 and beyond: one drawn at each secret size.
        return {"eps": float(f"{10 ** draw.uniform(-7, -4):.2g}")}

    def reference(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        x = inputs["x"].double()
        rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + inputs["eps"])
        return x * rstd * inputs["weight"].double()

    def check(
        self, output: torch.Tensor, reference_output: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[bool, str]:
        x = inputs["x"]
        if output.dtype != x.dtype:
            return False, f"output dtype is {output.dtype}, expected {x.dtype} (the dtype of x)"
        if output.shape != x.shape:
            return False, f"output shape is {list(output.shape)}, expected {list(x.shape)}"
        rtol, atol = self.tolerance(x.dtype)
        return compare_close(output, reference_output, rtol=rtol, atol=atol)

    def flops(self, workload: Workload) -> int:
        # Square, accumulate, scale by rstd, scale by weight: four per element.
        return 4 * workload.params["tokens"] * workload.params["hidden"]

    def bytes(self, workload: Workload) -> int:
        params = workload.params
        size = DTYPES[params["dtype"]].itemsize
        return (2 * params["tokens"] * params["hidden"] + params["hidden"]) * size


OP = RMSNorm(Path(__file__).parent)
