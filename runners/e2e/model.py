"""A synthetic decode step of a DeepSeek-V3.2-style layer stack, with random weights.

Each layer: RMSNorm → query latent → lightning indexer and top-k → sparse MLA over the
selected tokens (MQA mode over the 576-wide latent cache) → RMSNorm → MoE (routed
experts plus a shared one). The RMSNorm and indexer top-k calls go through a dispatch
table, so the same step runs once with the kept kernels and once with the candidate.
The indexer runs in bfloat16, or, with `fp8_indexer`, as DeepSeek-V3.2 serves it: its
key cache stored in float8 e4m3 with a scale per token, each step's queries quantized
per (row, head) and their scales folded into the head weights.

Shapes follow DeepSeek-V3.2 on CUDA (hidden 7168, q latent 1536, 128 MLA heads over a
512 + 64 latent, indexer 64 × 128 with top-2048, expert width 2048, top-8 routing) with
fewer layers and experts so a step fits on one GPU; the CPU shape is scaled down so CI
runs the same code eagerly. The MoE is computed densely with routing weights (zero for
unselected experts) so the whole step can be captured in one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runners.ops.dsa_indexer_topk_fp8 import quantize_rows

Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_latent: int
    kv_latent: int  # the part of the MLA cache that values are read from
    rope: int  # the rest of the 576-wide cache entry on DeepSeek-V3.2
    heads: int
    index_heads: int
    index_dim: int
    topk: int
    experts: int
    experts_per_token: int
    expert_width: int

    @property
    def cache_width(self) -> int:
        return self.kv_latent + self.rope


SHAPES = {
    "cuda": ModelShape(layers=2, hidden=7168, q_latent=1536, kv_latent=512, rope=64, heads=128,
                       index_heads=64, index_dim=128, topk=2048, experts=16,
                       experts_per_token=8, expert_width=2048),
    "cpu": ModelShape(layers=2, hidden=256, q_latent=128, kv_latent=64, rope=16, heads=8,
                      index_heads=16, index_dim=64, topk=256, experts=8,
                      experts_per_token=2, expert_width=128),
}

RMS_EPS = 1e-6


@dataclass
class Dispatch:
    """The kernels the step calls for the ops under test."""

    rmsnorm: Kernel
    dsa_indexer_topk: Kernel
    dsa_indexer_topk_fp8: Kernel


class DecodeStep:
    """Random weights and caches for one (context length, batch) point; call() runs a step."""

    def __init__(self, shape: ModelShape, *, context_length: int, batch: int, device: str,
                 seed: int, dispatch: Dispatch, fp8_indexer: bool = False) -> None:
        if context_length < shape.topk:
            raise ValueError(f"context length {context_length} is below top-k {shape.topk}")
        self.shape, self.dispatch, self.fp8_indexer = shape, dispatch, fp8_indexer
        generator = torch.Generator(device=device).manual_seed(seed)
        dtype = torch.bfloat16

        def weight(*dims: int, scale_dim: int) -> torch.Tensor:
            return (torch.randn(*dims, generator=generator, device=device, dtype=torch.float32)
                    * scale_dim**-0.5).to(dtype)

        s = shape
        self.layers = [
            {
                "attn_norm": torch.ones(s.hidden, device=device, dtype=dtype),
                "q_down": weight(s.hidden, s.q_latent, scale_dim=s.hidden),
                "q_norm": torch.ones(s.q_latent, device=device, dtype=dtype),
                "q_up": weight(s.q_latent, s.heads * s.cache_width, scale_dim=s.q_latent),
                "index_q": weight(s.q_latent, s.index_heads * s.index_dim, scale_dim=s.q_latent),
                "index_w": weight(s.hidden, s.index_heads, scale_dim=s.hidden).float(),
                "index_k": weight(context_length, s.index_dim, scale_dim=1),
                "cache": weight(context_length, s.cache_width, scale_dim=1),
                "out": weight(s.heads * s.kv_latent, s.hidden, scale_dim=s.heads * s.kv_latent),
                "moe_norm": torch.ones(s.hidden, device=device, dtype=dtype),
                "router": weight(s.hidden, s.experts, scale_dim=s.hidden),
                # Routed experts and the shared one in one stack: index s.experts is shared.
                "gate": weight(s.experts + 1, s.hidden, s.expert_width, scale_dim=s.hidden),
                "up": weight(s.experts + 1, s.hidden, s.expert_width, scale_dim=s.hidden),
                "down": weight(s.experts + 1, s.expert_width, s.hidden, scale_dim=s.expert_width),
            }
            for _ in range(s.layers)
        ]
        if fp8_indexer:  # the cache as served: e4m3 keys, one float32 scale per token
            for layer in self.layers:
                layer["index_k"], layer["index_k_scale"] = quantize_rows(layer["index_k"])
        self.x = torch.randn(batch, s.hidden, generator=generator, device=device).to(dtype)

    def __call__(self) -> torch.Tensor:
        x = self.x
        for layer in self.layers:
            x = x + self._attention(layer, x)
            x = x + self._moe(layer, x)
        return x

    def _attention(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        s, kernels = self.shape, self.dispatch
        h = kernels.rmsnorm(x, layer["attn_norm"], RMS_EPS)
        q_latent = kernels.rmsnorm(h @ layer["q_down"], layer["q_norm"], RMS_EPS)
        index_q = (q_latent @ layer["index_q"]).view(-1, s.index_heads, s.index_dim)
        index_weights = (h.float() @ layer["index_w"]) * s.index_heads**-0.5
        if self.fp8_indexer:
            index_q, q_scale = quantize_rows(index_q)
            selected = kernels.dsa_indexer_topk_fp8(index_q, layer["index_k"], layer["index_k_scale"],
                                                    index_weights * q_scale, s.topk)
        else:
            selected = kernels.dsa_indexer_topk(index_q, layer["index_k"], index_weights, s.topk)
        q = (q_latent @ layer["q_up"]).view(-1, s.heads, s.cache_width)
        kv = layer["cache"][selected]  # [batch, topk, cache_width]: only what the indexer chose
        scores = torch.einsum("bhc,btc->bht", q, kv).float() * s.cache_width**-0.5
        attended = torch.einsum("bht,btv->bhv", scores.softmax(-1).to(kv.dtype), kv[..., : s.kv_latent])
        return attended.flatten(1) @ layer["out"]

    def _moe(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        h = self.dispatch.rmsnorm(x, layer["moe_norm"], RMS_EPS)
        scores = (h @ layer["router"]).float().sigmoid()
        top = scores.topk(s.experts_per_token, dim=-1)
        routing = torch.zeros_like(scores).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
        routing = torch.cat([routing, torch.ones_like(routing[:, :1])], dim=-1)  # shared expert
        gate = torch.einsum("bh,ehw->ebw", h, layer["gate"])
        up = torch.einsum("bh,ehw->ebw", h, layer["up"])
        out = torch.einsum("ebw,ewh->ebh", torch.nn.functional.silu(gate) * up, layer["down"])
        return torch.einsum("ebh,be->bh", out.float(), routing).to(x.dtype)
