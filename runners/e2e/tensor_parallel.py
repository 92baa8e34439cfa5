"""A tensor-parallel decode step, as a serving engine runs one model across the GPUs of a host.

Megatron-style: each layer's attention and its MLP are each split across the ranks as
a column-parallel matmul (each rank its own heads, its own slice of the MLP's width)
then a row-parallel one (each rank the matching rows of the output projection). A
row-parallel matmul leaves every rank a partial sum of the layer's output; the ranks
all-reduce it, and every rank goes on with the same activations: a residual add, the
next norm, the next layer. That all-reduce is the op under test (allreduce_sum), two
of them per layer per decode step.

One call runs `decode_steps` steps for a batch of sequences whose KV cache already
holds `context_length` tokens: each step appends its keys and values to the cache, and
its output (the final norm of the residual stream) is the next step's input, as the
embedding of a sampled token would be; the call returns every step's output. Every
call starts from the same cache (the decode positions are written again) and a token
batch of its own, so calls are independent and each has its own answer.

The row-parallel matmuls write into one buffer per rank that every all-reduce of every
call is given, as a serving engine's do: vLLM's custom all-reduce sums a registered
buffer, and under CUDA graphs every call's tensors live at the addresses captured. So
the all-reduce sees the same tensor again and again with new contents, which the op's
own checks, each on a fresh tensor, never show it.

The weights and the cache are drawn whole from one seed by whoever holds the seed (the
judge: `draw_weights`) and cut per rank (`shard`), so every side computes with the same
weights and no rank holds more than its own shard. The same step on one rank, with no
all-reduce and in float64, is the exact answer (`exact_outputs`): one rank's shard is the
whole model, and summing the ranks' partial sums is the arithmetic of not splitting them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]

# The dtype a serving engine runs decode in: activations, weights, cache and every
# all-reduced message.
DTYPE = torch.bfloat16
RMS_EPS = 1e-6


@dataclass(frozen=True)
class TensorParallelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int  # the MLP's width
    context_length: int  # tokens already in the KV cache when a call starts
    batch: int
    decode_steps: int  # per call

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def message_bytes(self) -> int:
        """What every all-reduce of the step sums on each rank: a batch of hidden vectors."""
        return self.batch * self.hidden * DTYPE.itemsize

    @property
    def all_reduces_per_call(self) -> int:
        return 2 * self.layers * self.decode_steps

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def check(self, world_size: int) -> None:
        """Raises ValueError, naming the dimension, where the model cannot be split so."""
        if world_size < 1:
            raise ValueError(f"world size {world_size} is not a number of ranks")
        if self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} is not a multiple of the {self.heads} heads")
        for name, size in (("heads", self.heads), ("MLP width", self.ffn)):
            if size % world_size:
                raise ValueError(f"{name} {size} cannot be split evenly across {world_size} ranks")


# The CPU shape keeps the check quick in CI; its messages, 8 × 256 bfloat16 values,
# are 4 KB: the op's smallest declared size, a decode step's hidden vectors. The CUDA
# shape (not yet run on a GPU) is a 2-layer slice of a mid-size model: 64 KB messages.
SHAPES = {
    "cpu": TensorParallelShape(layers=2, hidden=256, heads=4, ffn=512, context_length=32,
                               batch=8, decode_steps=3),
    "cuda": TensorParallelShape(layers=2, hidden=2048, heads=16, ffn=5632, context_length=512,
                                batch=16, decode_steps=4),
}

# How each weight is cut across the ranks: by output columns (the column-parallel
# matmuls: each rank its heads, or its slice of the MLP's width), by input rows (the
# row-parallel ones, matching them), by heads (the cache); the norms are whole on every
# rank.
COLUMN_PARALLEL = ("query", "key", "value", "gate", "up")
ROW_PARALLEL = ("attention_out", "down")
PER_HEAD = ("keys", "values")
NORMS = ("attention_norm", "mlp_norm", "final_norm")


def weight_shapes(shape: TensorParallelShape, world_size: int) -> dict[str, tuple[int, ...]]:
    """Each tensor of one rank's shard (of the whole model for one rank), every layer's
    stacked along a first dimension of layers but the final norm's."""
    shape.check(world_size)
    s = shape
    heads, ffn = s.heads // world_size, s.ffn // world_size
    width = heads * s.head_dim
    return {
        "attention_norm": (s.layers, s.hidden),
        "query": (s.layers, s.hidden, width),
        "key": (s.layers, s.hidden, width),
        "value": (s.layers, s.hidden, width),
        "attention_out": (s.layers, width, s.hidden),
        "mlp_norm": (s.layers, s.hidden),
        "gate": (s.layers, s.hidden, ffn),
        "up": (s.layers, s.hidden, ffn),
        "down": (s.layers, ffn, s.hidden),
        "keys": (s.layers, s.batch, heads, s.context_length, s.head_dim),
        "values": (s.layers, s.batch, heads, s.context_length, s.head_dim),
        "final_norm": (s.hidden,),
    }


def draw_weights(shape: TensorParallelShape, seed: int) -> dict[str, torch.Tensor]:
    """The whole model and its cache, from one seed."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, dims in weight_shapes(shape, world_size=1).items():
        drawn = torch.randn(*dims, generator=generator)
        if name in NORMS:
            drawn = 1 + 0.1 * drawn  # near one, not one: all ones would hide a dropped norm
        elif name not in PER_HEAD:
            drawn = drawn * dims[-2] ** -0.5  # by fan-in: activations stay of order one
        weights[name] = drawn.to(DTYPE)
    return weights


def draw_tokens(shape: TensorParallelShape, seed: int, calls: int) -> torch.Tensor:
    """Each call's first token batch, [calls, batch, hidden]: what a call starts from."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(calls, shape.batch, shape.hidden, generator=generator).to(DTYPE)


def shard(weights: Mapping[str, torch.Tensor], shape: TensorParallelShape, rank: int,
          world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of every weight and of the cache, each its own copy (a rank is
    sent its shard alone, never a view of the whole)."""
    shape.check(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    parts = {}
    for name, tensor in weights.items():
        if name in COLUMN_PARALLEL or name in PER_HEAD:  # [layers, hidden or batch, this cut, ...]
            part = tensor.chunk(world_size, dim=2)[rank]
        elif name in ROW_PARALLEL:  # [layers, this cut, hidden]
            part = tensor.chunk(world_size, dim=1)[rank]
        else:
            part = tensor
        parts[name] = part.clone()
    return parts


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    wide = x.to(_accumulation(x.dtype))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return (normed * weight.to(wide.dtype)).to(x.dtype)


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """Softmax and norms in float32 at least, as serving kernels compute them."""
    return torch.promote_types(dtype, torch.float32)


class TensorParallelDecode:
    """One rank's part of the step: its shard of the model, its heads of the cache, and
    `all_reduce`, called on every row-parallel partial sum. call(tokens) runs the
    decode steps and returns their outputs, [decode_steps, batch, hidden]."""

    def __init__(self, shape: TensorParallelShape, weights: Mapping[str, torch.Tensor], *,
                 world_size: int, all_reduce: AllReduce) -> None:
        shape.check(world_size)
        for name, dims in weight_shapes(shape, world_size).items():
            given = weights.get(name)
            if given is None or tuple(given.shape) != dims:
                found = "nothing" if given is None else f"shape {list(given.shape)}"
                raise ValueError(f"the shard's {name!r} is {found}, not of shape {list(dims)} "
                                 f"(one of {world_size} ranks)")
        self.shape, self.all_reduce = shape, all_reduce
        self.heads = shape.heads // world_size
        self.weights = dict(weights)
        self.dtype = weights["final_norm"].dtype
        device = weights["final_norm"].device
        # The cache it starts from, and room after it for the call's decode steps.
        self.keys, self.values = (
            torch.cat([weights[name], torch.empty(shape.layers, shape.batch, self.heads,
                                                  shape.decode_steps, shape.head_dim,
                                                  dtype=self.dtype, device=device)], dim=3)
            for name in ("keys", "values"))
        # The one buffer every row-parallel matmul writes and every all-reduce is given.
        self.partial = torch.empty(shape.batch, shape.hidden, dtype=self.dtype, device=device)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        s = self.shape
        if tokens.shape != (s.batch, s.hidden) or tokens.dtype != self.dtype:
            raise ValueError(f"the step starts from a token batch of shape [{s.batch}, "
                             f"{s.hidden}] in {self.dtype}, not {list(tokens.shape)} in {tokens.dtype}")
        outputs = []
        x = tokens
        for step in range(s.decode_steps):
            position = s.context_length + step
            residual = x
            for layer in range(s.layers):
                residual = residual + self._attention(layer, residual, position)
                residual = residual + self._mlp(layer, residual)
            x = rms_norm(residual, self.weights["final_norm"])
            outputs.append(x)
        return torch.stack(outputs)

    def _row_parallel(self, activations: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, into the shared buffer, all-reduced across the ranks."""
        torch.matmul(activations, weight, out=self.partial)
        return self.all_reduce(self.partial)

    def _attention(self, layer: int, residual: torch.Tensor, position: int) -> torch.Tensor:
        s, w = self.shape, self.weights
        h = rms_norm(residual, w["attention_norm"][layer])
        heads = (s.batch, self.heads, s.head_dim)
        query = (h @ w["query"][layer]).view(heads)
        self.keys[layer][:, :, position] = (h @ w["key"][layer]).view(heads)
        self.values[layer][:, :, position] = (h @ w["value"][layer]).view(heads)
        wide = _accumulation(self.dtype)
        keys = self.keys[layer][:, :, :position + 1].to(wide)
        values = self.values[layer][:, :, :position + 1].to(wide)
        scores = torch.einsum("bhd,bhtd->bht", query.to(wide), keys) * s.head_dim**-0.5
        attended = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), values)
        return self._row_parallel(attended.to(self.dtype).flatten(1), w["attention_out"][layer])

    def _mlp(self, layer: int, residual: torch.Tensor) -> torch.Tensor:
        w = self.weights
        h = rms_norm(residual, w["mlp_norm"][layer])
        gated = torch.nn.functional.silu(h @ w["gate"][layer]) * (h @ w["up"][layer])
        return self._row_parallel(gated, w["down"][layer])


def exact_outputs(shape: TensorParallelShape, weights: Mapping[str, torch.Tensor],
                  tokens: torch.Tensor) -> torch.Tensor:
    """The step's outputs for one token batch in float64, on one rank with the whole
    model: what every rank of every side should return, up to its own rounding."""
    whole = {name: tensor.double() for name, tensor in weights.items()}
    step = TensorParallelDecode(shape, whole, world_size=1, all_reduce=lambda partial: partial)
    return step(tokens.double())
