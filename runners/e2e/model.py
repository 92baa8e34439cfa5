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

import math

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
    dsa_indexer_topk_paged: Kernel
    dsa_indexer_topk_paged_fp8: Kernel


# Values drawn in float32 at a time: whole, a 64-sequence paged latent cache at 128K is
# 4.7 GiB in float32 (9.4 at 256K), and on an H100 that draw failed a baseline process
# holding a quarter of the card. In slices of the first dimension it is never whole.
DRAW_AT_ONCE = 2**26


def _weight_maker(generator: torch.Generator, device: str) -> Callable[..., torch.Tensor]:
    def weight(*dims: int, scale_dim: int) -> torch.Tensor:
        made = torch.empty(*dims, device=device, dtype=torch.bfloat16)
        rows = max(1, DRAW_AT_ONCE // max(1, math.prod(dims[1:])))
        for part in made.split(rows):
            part.copy_(torch.randn(part.shape, generator=generator, device=device, dtype=torch.float32)
                       * scale_dim**-0.5)
        return made
    return weight


def _layer_weights(s: ModelShape, weight: Callable[..., torch.Tensor], device: str) -> dict:
    """One layer's weights, without its caches."""
    dtype = torch.bfloat16
    return {
        "attn_norm": torch.ones(s.hidden, device=device, dtype=dtype),
        "q_down": weight(s.hidden, s.q_latent, scale_dim=s.hidden),
        "q_norm": torch.ones(s.q_latent, device=device, dtype=dtype),
        "q_up": weight(s.q_latent, s.heads * s.cache_width, scale_dim=s.q_latent),
        "index_q": weight(s.q_latent, s.index_heads * s.index_dim, scale_dim=s.q_latent),
        "index_w": weight(s.hidden, s.index_heads, scale_dim=s.hidden).float(),
        "out": weight(s.heads * s.kv_latent, s.hidden, scale_dim=s.heads * s.kv_latent),
        "moe_norm": torch.ones(s.hidden, device=device, dtype=dtype),
        "router": weight(s.hidden, s.experts, scale_dim=s.hidden),
        # Routed experts and the shared one in one stack: index s.experts is shared.
        "gate": weight(s.experts + 1, s.hidden, s.expert_width, scale_dim=s.hidden),
        "up": weight(s.experts + 1, s.hidden, s.expert_width, scale_dim=s.hidden),
        "down": weight(s.experts + 1, s.expert_width, s.hidden, scale_dim=s.expert_width),
    }


def layer_weights_meta(s: ModelShape) -> dict[str, torch.Tensor]:
    """A layer's weights with shapes and dtypes but no memory, for the loop's roofline."""
    return _layer_weights(s, lambda *dims, scale_dim: torch.empty(*dims, device="meta",
                                                                 dtype=torch.bfloat16), "meta")


def moe(s: ModelShape, layer: dict, x: torch.Tensor, rmsnorm: Kernel) -> torch.Tensor:
    h = rmsnorm(x, layer["moe_norm"], RMS_EPS)
    scores = (h @ layer["router"]).float().sigmoid()
    top = scores.topk(s.experts_per_token, dim=-1)
    routing = torch.zeros_like(scores).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    routing = torch.cat([routing, torch.ones_like(routing[:, :1])], dim=-1)  # shared expert
    gate = torch.einsum("bh,ehw->ebw", h, layer["gate"])
    up = torch.einsum("bh,ehw->ebw", h, layer["up"])
    out = torch.einsum("ebw,ewh->ebh", torch.nn.functional.silu(gate) * up, layer["down"])
    return torch.einsum("ebh,be->bh", out.float(), routing).to(x.dtype)


def sparse_mla(s: ModelShape, layer: dict, q_latent: torch.Tensor, kv: torch.Tensor,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """MQA over the selected tokens' latent cache entries [batch, topk, cache_width];
    `valid` [batch, topk] masks selections that are padding."""
    q = (q_latent @ layer["q_up"]).view(-1, s.heads, s.cache_width)
    scores = torch.einsum("bhc,btc->bht", q, kv).float() * s.cache_width**-0.5
    if valid is not None:
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    attended = torch.einsum("bht,btv->bhv", scores.softmax(-1).to(kv.dtype), kv[..., : s.kv_latent])
    return attended.flatten(1) @ layer["out"]


class DecodeStep:
    """Random weights and caches for one (context length, batch) point; call() runs a step."""

    def __init__(self, shape: ModelShape, *, context_length: int, batch: int, device: str,
                 seed: int, dispatch: Dispatch, fp8_indexer: bool = False) -> None:
        if context_length < shape.topk:
            raise ValueError(f"context length {context_length} is below top-k {shape.topk}")
        self.shape, self.dispatch, self.fp8_indexer = shape, dispatch, fp8_indexer
        generator = torch.Generator(device=device).manual_seed(seed)
        weight = _weight_maker(generator, device)
        s = shape
        self.layers = []
        for _ in range(s.layers):
            layer = _layer_weights(s, weight, device)
            layer["index_k"] = weight(context_length, s.index_dim, scale_dim=1)
            layer["cache"] = weight(context_length, s.cache_width, scale_dim=1)
            self.layers.append(layer)
        if fp8_indexer:  # the cache as served: e4m3 keys, one float32 scale per token
            for layer in self.layers:
                layer["index_k"], layer["index_k_scale"] = quantize_rows(layer["index_k"])
        self.x = torch.randn(batch, s.hidden, generator=generator, device=device).to(torch.bfloat16)

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
        # Only what the indexer chose: [batch, topk, cache_width].
        return sparse_mla(s, layer, q_latent, layer["cache"][selected])

    def _moe(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        return moe(self.shape, layer, x, self.dispatch.rmsnorm)


class PagedDecodeLoop:
    """K decode steps of the stack as a serving engine runs them (the paged indexer ops).

    A batch of sequences of mixed lengths (the paged op's mixed workload at this point's
    longest context) whose indexer keys and latent cache live in paged caches of
    64-token blocks, shuffled, one block table for both. Every step appends one token
    to every sequence (its index key, quantized per token with `fp8_indexer`, and its
    cache entry, written at the position its length names), so every context grows by
    one, then runs each layer with the indexer over every sequence's own prefix and the
    sparse MLA over what it selected (−1 padding masked). All of it is device work on
    device-held lengths, so on CUDA the K steps are captured once and replayed, as a
    server replays its graph with new lengths every step; a kernel that pays per length
    pays it every step here. A sequence that reaches its room (GROWTH tokens more than it
    began with) starts over at its first length, as a server takes in new requests.
    """

    # Tokens each sequence may grow by before it starts over: room for more steps than
    # a timed run takes between resets, and little memory.
    GROWTH = 256

    def __init__(self, shape: ModelShape, *, context_length: int, batch: int, device: str,
                 seed: int, dispatch: Dispatch, fp8_indexer: bool, steps: int) -> None:
        from runners.ops import get_op
        from runners.ops.dsa_indexer_topk_paged import (
            BLOCK_SIZE, blocks_for, mixed_lengths, shuffled_block_table,
        )

        if context_length < shape.topk:
            raise ValueError(f"context length {context_length} is below top-k {shape.topk}")
        self.shape, self.dispatch, self.fp8_indexer, self.steps = shape, dispatch, fp8_indexer, steps
        s = shape
        generator = torch.Generator(device=device).manual_seed(seed)
        layout = torch.Generator().manual_seed(seed)
        params = get_op("dsa_indexer_topk_paged").workload(
            device, context_length, batch, "mixed", 1).params
        typical = (params["tokens"] - context_length) // max(1, batch - 1)
        lengths = mixed_lengths(batch, context_length, params["tokens"], params["min_length"],
                                min(s.topk, typical), layout)
        # Each sequence's own blocks, room to grow included, shuffled across the cache;
        # entries past its room point at other sequences' blocks, as unused entries may.
        owned = [blocks_for(length + self.GROWTH) for length in lengths]
        table = shuffled_block_table(owned, sum(owned), max(owned), layout)
        self.block_size = BLOCK_SIZE
        self.block_table = table.to(torch.int32).to(device)
        self.first_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.context_lens = self.first_lens.clone()
        weight = _weight_maker(generator, device)
        self.layers = []
        for _ in range(s.layers):
            layer = _layer_weights(s, weight, device)
            layer["index_k_new"] = weight(s.hidden, s.index_dim, scale_dim=s.hidden)
            layer["kv_new"] = weight(s.hidden, s.cache_width, scale_dim=s.hidden)
            keys = weight(sum(owned), BLOCK_SIZE, s.index_dim, scale_dim=1)
            if fp8_indexer:  # the cache as served: e4m3 keys, one float32 scale per token
                layer["index_cache"], layer["index_scale"] = quantize_rows(keys)
            else:
                layer["index_cache"] = keys
            layer["cache"] = weight(sum(owned), BLOCK_SIZE, s.cache_width, scale_dim=1)
            self.layers.append(layer)
        self.x = torch.randn(batch, s.hidden, generator=generator, device=device).to(torch.bfloat16)

    @property
    def tokens_per_call(self) -> int:
        return self.steps * self.x.shape[0]

    def __call__(self) -> torch.Tensor:
        x = self.x
        for _ in range(self.steps):
            x = self.step()
        return x

    def step(self) -> torch.Tensor:
        lens = self.context_lens
        lens.add_(1)
        lens.copy_(torch.where(lens > self.first_lens + self.GROWTH, self.first_lens + 1, lens))
        position = (lens - 1).long()
        blocks = self.block_table.long().gather(1, (position // self.block_size).unsqueeze(1)).squeeze(1)
        slots = position % self.block_size
        x = self.x
        for layer in self.layers:
            x = x + self._attention(layer, x, blocks, slots)
            x = x + moe(self.shape, layer, x, self.dispatch.rmsnorm)
        return x

    def _attention(self, layer: dict, x: torch.Tensor, blocks: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
        s, kernels = self.shape, self.dispatch
        h = kernels.rmsnorm(x, layer["attn_norm"], RMS_EPS)
        key = h @ layer["index_k_new"]
        if self.fp8_indexer:
            key, scale = quantize_rows(key)
            layer["index_scale"][blocks, slots] = scale
        layer["index_cache"][blocks, slots] = key
        layer["cache"][blocks, slots] = h @ layer["kv_new"]
        q_latent = kernels.rmsnorm(h @ layer["q_down"], layer["q_norm"], RMS_EPS)
        index_q = (q_latent @ layer["index_q"]).view(-1, 1, s.index_heads, s.index_dim)
        index_weights = (h.float() @ layer["index_w"]) * s.index_heads**-0.5
        if self.fp8_indexer:
            index_q, q_scale = quantize_rows(index_q)
            selected = kernels.dsa_indexer_topk_paged_fp8(
                index_q, layer["index_cache"], layer["index_scale"], self.block_table,
                self.context_lens, index_weights * q_scale.view(-1, s.index_heads), s.topk)
        else:
            selected = kernels.dsa_indexer_topk_paged(
                index_q, layer["index_cache"], self.block_table, self.context_lens, index_weights, s.topk)
        valid = selected >= 0
        chosen = selected.clamp_min(0)
        where = self.block_table.long().gather(1, chosen // self.block_size)
        return sparse_mla(s, layer, q_latent, layer["cache"][where, chosen % self.block_size], valid)
