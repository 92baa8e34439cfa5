"""DeepSeek-V3.2 lightning indexer in FP8, as DeepSeek runs it: scores, then top-k.

q [M, H, D] and k [N, D] are float8_e4m3fn. k carries one float32 scale per token
(`k_scale` [N], the indexer's K cache layout); q's scale, one per (row, head), is folded
into the weights, as DeepSeek's model does. With q and k the stored FP8 values,

I[m, n] = sum_h weights[m, h] * relu(k_scale[n] * (q[m, h, :] . k[n, :]))

and each query row keeps the `topk` context positions with the highest score.
Workloads, the check and the scoring are the bf16 op's (`dsa_indexer_topk`): only the
inputs, the reference's dequantization and the byte count differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runners.ops.base import Workload
from runners.ops.dsa_indexer_topk import DsaIndexerTopk

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest absmax a scale is derived from, so an all-zero row does not divide by
# zero (DeepSeek's quantizer clamps the same way).
_MIN_ABSMAX = 1e-4


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax quantization over the last dimension, as DeepSeek's act_quant does
    each 128-wide block (its default scale format): each row's largest |value| maps to ±448.

    Returns the FP8 values and one float32 scale per row: values ≈ fp8 * scale[..., None].
    """
    absmax = values.abs().amax(dim=-1).float().clamp_min(_MIN_ABSMAX)
    scale = absmax / FP8_MAX
    scaled = values.float() / scale.unsqueeze(-1)
    # Rounding can leave the absmax a hair above 448: the clamp keeps the cast from
    # depending on how torch treats values beyond e4m3's range.
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8.float() * scale.unsqueeze(-1)


class DsaIndexerTopkFp8(DsaIndexerTopk):
    name = "dsa_indexer_topk_fp8"
    title = "DSA indexer top-k (FP8)"
    description = (
        "The DeepSeek-V3.2 lightning indexer as served: float8_e4m3fn queries and keys, "
        "a float32 scale per key token, q's scale folded into the per-head weights. "
        "ReLU'd per-head dot products of each query with every context key, summed with "
        "the weights, then the top-k context positions per query, in any order."
    )
    signature = "forward(q, k, k_scale, weights, topk) -> LongTensor"
    compute_dtype = "float8_e4m3fn"
    tolerances = {
        # The reference is exact for the FP8 values. The shipped baseline rounds its
        # logits to bfloat16 (as the bf16 op's does), and Hopper's FP8 tensor cores do not
        # accumulate in full float32: the bf16 op's scale-relative tolerance covers both.
        FP8: (1e-2, 1e-2),
    }

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        values = self.sample_inputs(workload, seed, distribution, torch.float32)
        # One q scale per (row, head): a head's 128 dims are one quantization block.
        q, q_scale = quantize_rows(values["q"])
        k, k_scale = quantize_rows(values["k"])
        dim = q.shape[-1]
        return {
            "q": q,
            "k": k,
            "k_scale": k_scale,
            # DeepSeek's weights carry q's scale and the softmax scale D^-0.5.
            "weights": values["weights"] * q_scale * dim**-0.5,
            "topk": values["topk"],
        }

    def _louder_key(self, changed: dict[str, Any], other: Mapping[str, Any], row: int) -> None:
        # Four times louder through its scale: the e4m3 values themselves are at their range.
        changed["k"][row] = other["k"][row]
        changed["k_scale"][row] = other["k_scale"][row] * 4

    def score_terms(self, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bf16 op's terms with the keys dequantized; q's scale is in the weights.

        Every e4m3 value is exact in float32, so the scores are those of the FP8 values
        up to float32 rounding (of the scaled keys, the products and the sums).
        """
        return inputs["q"].float(), dequantize_rows(inputs["k"], inputs["k_scale"]), inputs["weights"]

    def flops(self, workload: Workload) -> int:
        params = workload.params
        # The bf16 op's count, plus the k scale: one multiply per logit.
        return super().flops(workload) + params["batch"] * params["heads"] * params["context_length"]

    def bytes(self, workload: Workload) -> int:
        params = workload.params
        m, heads, dim = params["batch"], params["heads"], params["head_dim"]
        return (
            m * heads * dim  # q, one byte an element
            + params["context_length"] * (dim + 4)  # k and its float32 scale
            + 4 * m * heads  # weights
            + 8 * m * params["topk"]  # int64 indices
        )


OP = DsaIndexerTopkFp8(Path(__file__).parent)
