"""DeepSeek-V3.2 lightning indexer: per-token scores over the context, then top-k.

I[m, n] = sum_h weights[m, h] * relu(q[m, h, :] . k[n, :]); each query row keeps the
`topk` context positions with the highest score.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runners.ops.base import Op, Workload, make_generator, sample

# CUDA matches DeepSeek-V3.2's indexer; the CPU shape is scaled down so one CPU
# evaluation stays within a few seconds.
SHAPES = {
    "cpu": {"heads": 16, "head_dim": 64, "topk": 256},
    "cuda": {"heads": 64, "head_dim": 128, "topk": 2048},
}


def repeated_indices(indices: torch.Tensor) -> str | None:
    """What is wrong with rows of `indices` [rows, k] that hold an index twice, or None."""
    ordered = indices.sort(dim=1).values
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if not bool(repeated.any()):
        return None
    row = int(repeated.any(dim=1).nonzero()[0])
    index = int(ordered[row, 1:][repeated[row]][0])
    return f"{int(repeated.sum()):,} duplicate indices; row {row} returns {index} more than once"


class DsaIndexerTopk(Op):
    name = "dsa_indexer_topk"
    title = "DSA indexer top-k"
    description = (
        "The DeepSeek-V3.2 lightning indexer: ReLU'd per-head dot products of each query "
        "with every context key, summed with per-head weights, then the top-k context "
        "positions per query. Indices are returned in any order."
    )
    signature = "forward(q, k, weights, topk) -> LongTensor"
    # The logits are a bfloat16 matmul: the roofline's compute ceiling is the bf16 one.
    compute_dtype = "bfloat16"
    # The shipped Triton kernel fuses the logits and leaves the selection to torch's
    # top-k (a fused one comes later); a DSL candidate may too, and is warned.
    dsl_torch_ops = frozenset({"aten.topk"})
    tolerances = {
        torch.float32: (1e-5, 1e-5),
        # The logits of bfloat16 inputs are rounded to bfloat16 by torch's own matmul.
        torch.bfloat16: (1e-2, 1e-2),
    }

    def default_context_lengths(self, device: str) -> list[int]:
        return {
            "cpu": [2048, 8192, 32768],
            "cuda": [4096, 16384, 65536, 131072, 262144],
        }[device]

    def default_batch_sizes(self, device: str) -> list[int]:
        return {"cpu": [4], "cuda": [64]}[device]

    def context_length_range(self, device: str) -> tuple[int, int]:
        # Fewer context tokens than topk leaves no valid answer.
        return SHAPES[device]["topk"], {"cpu": 131072, "cuda": 262144}[device]

    def max_batch_size(self, device: str) -> int:
        return {"cpu": 16, "cuda": 256}[device]

    def build_workloads(
        self, device: str, context_lengths: list[int], batch_sizes: list[int]
    ) -> list[Workload]:
        return [
            Workload(
                name=f"ctx={context},m={batch}",
                device=device,
                params={"context_length": context, "batch": batch, **SHAPES[device]},
            )
            for context in context_lengths
            for batch in batch_sizes
        ]

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        return self.sample_inputs(workload, seed, distribution, torch.bfloat16)

    def sample_inputs(
        self, workload: Workload, seed: int, distribution: str, value_dtype: torch.dtype
    ) -> dict[str, Any]:
        """q and k drawn in `value_dtype`, weights in float32 (the FP8 variant quantizes these)."""
        params = workload.params
        m, heads, dim = params["batch"], params["heads"], params["head_dim"]
        generator = make_generator(seed, workload.device)
        draw = lambda shape, dtype: sample(  # noqa: E731
            shape, generator=generator, distribution=distribution, dtype=dtype
        )
        return {
            "q": draw((m, heads, dim), value_dtype),
            "k": draw((params["context_length"], dim), value_dtype),
            "weights": draw((m, heads), torch.float32) * heads**-0.5,
            "topk": params["topk"],
        }

    def nearly(self, inputs: Mapping[str, Any], other: Mapping[str, Any],
               generator: torch.Generator) -> dict[str, Any]:
        """One key replaced by four times another set's: it scores high enough to move
        into every row's top-k, so an answer kept from the inputs it came from is wrong."""
        changed = {key: value.clone() if isinstance(value, torch.Tensor) else value
                   for key, value in inputs.items()}
        row = int(torch.randint(changed["k"].shape[0], (1,), generator=generator))
        self._louder_key(changed, other, row)
        return changed

    def _louder_key(self, changed: dict[str, Any], other: Mapping[str, Any], row: int) -> None:
        changed["k"][row] = (other["k"][row].float() * 4).to(changed["k"].dtype)

    def reference(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The full [M, N] score matrix in float32: the check needs scores, not indices."""
        return weighted_scores(*self.score_terms(inputs))

    def magnitudes(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """Per score, the sum of its terms' sizes (|weight| x relu(logit) over the heads):
        what its rounding error scales with. A score of signed terms that cancel (an
        outlier key under weights of both signs) is known only to a fraction of this,
        however small it comes out: -1.87 from terms of 9,319 in all, on bf16 inputs."""
        q, k, weights = self.score_terms(inputs)
        return weighted_scores(q, k, weights.abs())

    def score_terms(self, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, weights) in float32, as the scores are made of them."""
        return inputs["q"].float(), inputs["k"].float(), inputs["weights"]

    def check(
        self, output: torch.Tensor, reference_output: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[bool, str]:
        scores = reference_output
        rows, context = scores.shape
        topk = inputs["topk"]
        if output.dtype != torch.int64:
            return False, f"output dtype is {output.dtype}, expected torch.int64 (indices)"
        if tuple(output.shape) != (rows, topk):
            return False, f"output shape is {list(output.shape)}, expected [{rows}, {topk}]"
        outside = (output < 0) | (output >= context)
        if bool(outside.any()):
            row = int(outside.any(dim=1).nonzero()[0])
            return False, (
                f"{int(outside.sum()):,} indices are outside [0, {context}); "
                f"first in row {row}: {int(output[row][outside[row]][0])}"
            )
        repeated = repeated_indices(output)
        if repeated is not None:
            return False, repeated
        ranked = scores.gather(1, output).sort(dim=1, descending=True)
        got = ranked.values
        top = scores.topk(topk, dim=1)
        want = top.values
        rtol, atol = self.tolerance(inputs["q"].dtype)
        # Scores sum signed per-head terms, so a rounding error is relative to the
        # row's largest score rather than to each (possibly cancelled) entry, or to the
        # size of the terms of the two scores compared, where those are larger.
        scale = term_scale(want, self.magnitudes(inputs), output.gather(1, ranked.indices), top.indices)
        beyond = (got - want).abs() > atol * scale + rtol * want.abs()
        if bool(beyond.any()):
            row, rank = (int(i) for i in beyond.nonzero()[0])
            return False, (
                f"{int(beyond.sum()):,} of {got.numel():,} selected scores fall short of the "
                f"true top-{topk} beyond rtol={rtol:g}, atol={atol:g}×(row max or terms' size); row {row}: "
                f"the #{rank + 1} selected score is {float(got[row, rank]):.6g}, "
                f"the true #{rank + 1} is {float(want[row, rank]):.6g}"
            )
        worst = float(((got - want).abs() / scale).max())
        return True, f"top-{topk} scores match; worst gap {worst:.3g} of the row max or the terms' size"

    def flops(self, workload: Workload) -> int:
        params = workload.params
        # A multiply-add per dot-product element, then ReLU, weight and sum per head.
        per_head = 2 * params["head_dim"] + 3
        return params["batch"] * params["heads"] * params["context_length"] * per_head

    def bytes(self, workload: Workload) -> int:
        params = workload.params
        m, heads = params["batch"], params["heads"]
        return (
            2 * m * heads * params["head_dim"]
            + 2 * params["context_length"] * params["head_dim"]
            + 4 * m * heads
            + 8 * m * params["topk"]
        )


OP = DsaIndexerTopk(Path(__file__).parent)


def weighted_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[M, N]: the weights' sum over the heads of relu(q·k), in float32."""
    scores = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float32, device=q.device)
    for head in range(q.shape[1]):
        scores.addcmul_(torch.relu(q[:, head] @ k.T), weights[:, head:head + 1])
    return scores


def term_scale(want: torch.Tensor, magnitudes: torch.Tensor, got_indices: torch.Tensor,
               want_indices: torch.Tensor) -> torch.Tensor:
    """What a gap between the selected and the true score of each rank is measured
    against: the row's largest true score, or the size of the terms of either score
    (`magnitudes` at the selected and the true index of that rank), whichever is larger.
    Indices of -1 (padding) count as no terms."""
    real = torch.isfinite(want)
    row_max = want.masked_fill(~real, 0).abs().amax(dim=1, keepdim=True)
    got_terms = magnitudes.gather(1, got_indices.clamp_min(0)).masked_fill(got_indices < 0, 0)
    want_terms = magnitudes.gather(1, want_indices).masked_fill(~real, 0)
    return torch.maximum(row_max, torch.maximum(got_terms, want_terms)).clamp_min(1e-30)
