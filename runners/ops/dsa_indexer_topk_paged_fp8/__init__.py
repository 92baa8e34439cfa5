"""The paged decode indexer in FP8, DeepSeek-V3.2's indexer cache as served.

The paged op's batch (`dsa_indexer_topk_paged`: its layout, lengths, −1 padding and
check), with the keys stored as float8_e4m3fn and one float32 scale per token
(`kv_scale` [num_blocks, 64], beside `kv_cache` [num_blocks, 64, D]), and the queries
in e4m3 with their per-(row, head) scale folded into the weights. With q and the keys
the stored values,

    I[r, n] = sum_h weights[r, h] · relu(kv_scale[n] · (q[b, j, h, :] · key_b[n, :]))

DeepGEMM's `fp8_paged_mqa_logits` packs the scale into the cache row; here it is its
own tensor, as the dense FP8 op's `k_scale` is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runners.ops.base import Workload
from runners.ops.dsa_indexer_topk_fp8 import FP8, dequantize_rows, quantize_rows
from runners.ops.dsa_indexer_topk_paged import DsaIndexerTopkPaged, blocks_for


class DsaIndexerTopkPagedFp8(DsaIndexerTopkPaged):
    name = "dsa_indexer_topk_paged_fp8"
    title = "DSA indexer top-k, paged decode (FP8)"
    description = (
        "The paged decode indexer as DeepSeek-V3.2 serves it: float8_e4m3fn queries and "
        "paged keys with a float32 scale per key token, q's scale folded into the per-head "
        "weights; the top-k positions of each row's causal prefix, as indices into that "
        "sequence's context in any order, padded with -1 where the prefix is shorter than top-k."
    )
    signature = ("forward(q, kv_cache, kv_scale, block_table, context_lens, weights, topk) "
                 "-> LongTensor")
    compute_dtype = "float8_e4m3fn"
    tolerances = {FP8: (1e-2, 1e-2)}  # the dense FP8 op's, for the same reasons

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        values = self.sample_paged(workload, seed, distribution, torch.float32,
                                   store_keys=lambda keys: dict(zip(("kv_cache", "kv_scale"), quantize_rows(keys))))
        q, q_scale = quantize_rows(values["q"])
        batch, next_n, heads, dim = q.shape
        return {
            "q": q,
            "kv_cache": values["kv_cache"],
            "kv_scale": values["kv_scale"],
            "block_table": values["block_table"],
            "context_lens": values["context_lens"],
            "weights": values["weights"] * q_scale.view(batch * next_n, heads) * dim**-0.5,
            "topk": values["topk"],
        }

    def _loudest(self, inputs: Mapping[str, Any]) -> float:
        return float(inputs["kv_scale"].amax())

    def _louder_slot(self, changed: dict[str, Any], other: Mapping[str, Any], block: int,
                     slot: int, loudest: float) -> None:
        # Louder through its scale (the e4m3 values are at their range already): four
        # times the cache's largest.
        changed["kv_cache"][block, slot] = other["kv_cache"][block, slot]
        changed["kv_scale"][block, slot] = loudest * 4

    def gathered_keys(self, inputs: Mapping[str, Any], row: int, length: int) -> torch.Tensor:
        blocks = inputs["block_table"][row, :blocks_for(length)].long()
        dim = inputs["kv_cache"].shape[-1]
        keys = dequantize_rows(inputs["kv_cache"][blocks], inputs["kv_scale"][blocks])
        return keys.reshape(-1, dim)[:length]

    def flops(self, workload: Workload) -> int:
        p = workload.params
        # The bf16 paged count, plus the key scale: one multiply per logit.
        return super().flops(workload) + p["next_n"] * p["tokens"] * p["heads"]

    def bytes(self, workload: Workload) -> int:
        p = workload.params
        rows = p["batch"] * p["next_n"]
        return (
            rows * p["heads"] * p["head_dim"]  # q, one byte an element
            + p["tokens"] * (p["head_dim"] + 4)  # each sequence's keys and their scales
            + 4 * (blocks_for(p["tokens"]) + 2 * p["batch"])
            + 4 * rows * p["heads"]
            + 8 * rows * p["topk"]
        )


OP = DsaIndexerTopkPagedFp8(Path(__file__).parent)
