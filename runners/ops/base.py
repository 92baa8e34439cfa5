"""What every op declares, and the pieces ops share.

An op owns everything that decides whether a candidate is right and on what it is
measured: workloads, inputs, the reference, the tolerance. None of it comes from the
candidate, so a candidate cannot shrink the problem or loosen the check.
"""

from __future__ import annotations

import math
import random

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DISTRIBUTIONS = ("normal", "uniform_outliers")

# More would make one evaluation too long to wait for in the review loop.
MAX_WORKLOADS = 32

# Rare large values catch kernels that overflow, lose precision in a reduction or
# only look right on well-behaved data.
_OUTLIER_RATE = 0.001
_OUTLIER_SCALE = 64.0


class WorkloadError(ValueError):
    """The requested context lengths or batch sizes are outside what the op declares."""


@dataclass(frozen=True)
class Workload:
    name: str
    device: str
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "device": self.device, "params": dict(self.params)}


def device_type(device: str) -> str:
    kind = str(device).split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise WorkloadError(f"unknown device {device!r} (known: cpu, cuda)")
    return kind


def make_generator(seed: int, device: str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    shape: tuple[int, ...],
    *,
    generator: torch.Generator,
    distribution: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    device = generator.device
    if distribution == "normal":
        values = torch.randn(shape, generator=generator, device=device)
    elif distribution == "uniform_outliers":
        values = torch.rand(shape, generator=generator, device=device) * 2 - 1
        outliers = torch.rand(shape, generator=generator, device=device) < _OUTLIER_RATE
        values = torch.where(outliers, values * _OUTLIER_SCALE, values)
    else:
        known = ", ".join(DISTRIBUTIONS)
        raise ValueError(f"unknown distribution {distribution!r} (known: {known})")
    return values.to(dtype)


# Elements compared at a time on a CPU: the float64 temporaries of a chunk stay in the
# cache and are reused, where whole-tensor temporaries (32 MB each at 4096 x 1024) cost
# a trip to memory and fresh pages at every step: about 5x faster at 4096 x 1024 on
# one core (bench/judge_work.py: 4.7x to 5.8x over three runs).
_COMPARE_CHUNK = 1 << 16


def compare_close(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float
) -> tuple[bool, str]:
    """Compare every element, so a kernel that computes only part of the output fails:
    |actual - expected| <= atol + rtol * |expected|, in float64."""
    flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
    total = flat_actual.numel()
    step = _COMPARE_CHUNK if actual.device.type == "cpu" else max(total, 1)
    not_finite = beyond = 0
    largest: list[torch.Tensor] = []  # the largest error of each chunk
    worst_excess, worst_at = -math.inf, 0
    for start in range(0, total, step):
        got = flat_actual[start:start + step]
        finite = torch.isfinite(got)
        if not_finite or not bool(finite.all()):
            not_finite += int(finite.numel() - finite.sum())
            continue  # the values no longer matter: the message counts the non-finite
        want = flat_expected[start:start + step].double()
        error = (got.double() - want).abs_()
        # `want` may be the reference itself (already float64): never changed in place.
        excess = error - want.abs().mul_(rtol).add_(atol)
        largest.append(error.max())
        over = int((excess > 0).sum())
        if over:
            beyond += over
            at = int(torch.argmax(excess))
            if float(excess[at]) > worst_excess:  # the first of equals, as one argmax would
                worst_excess, worst_at = float(excess[at]), start + at
    if not_finite:
        return False, f"{not_finite:,} of {total:,} output values are NaN or inf"
    if beyond:
        worst = torch.unravel_index(torch.tensor(worst_at), actual.shape)
        where = ", ".join(str(int(i)) for i in worst)
        return False, (
            f"{beyond:,} of {total:,} values differ from the reference "
            f"beyond rtol={rtol:g}, atol={atol:g}; worst at [{where}]: "
            f"got {float(flat_actual[worst_at]):.6g}, expected {float(flat_expected[worst_at]):.6g}"
        )
    max_error = float(torch.stack(largest).max()) if largest else 0.0
    return True, f"max abs error {max_error:.3g} (rtol={rtol:g}, atol={atol:g})"


def _validated(
    what: str, values: Iterable[int], *, op: str, device: str, low: int, high: int
) -> list[int]:
    checked = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WorkloadError(f"{what} {value!r} is not a whole number")
        if value <= 0:
            raise WorkloadError(f"{what} {value} must be positive")
        if value < low:
            raise WorkloadError(f"{what} {value} is below {op}'s minimum of {low:,} on {device}")
        if value > high:
            raise WorkloadError(f"{what} {value:,} is above {op}'s maximum of {high:,} on {device}")
        checked.append(value)
    if not checked:
        raise WorkloadError(f"no {what}s given: pass at least one")
    return sorted(set(checked))


def _rounded_up(value: int, multiple: int | None) -> int:
    return value if not multiple else -(-value // multiple) * multiple


class Op:
    """One kernel task. Subclasses live in `runners/ops/<name>/__init__.py` as `OP`."""

    name: str = ""
    title: str = ""
    description: str = ""
    signature: str = ""
    # Input dtype -> (rtol, atol). Owned by the op so no candidate can relax it.
    tolerances: dict[torch.dtype, tuple[float, float]] = {}
    # Aten ops ("aten.topk") that a DSL candidate of this op may still run in torch
    # beside its kernels: a step of the op the DSL kernels do not do yet. The
    # required-DSL guard warns when they run; any other torch compute fails it.
    dsl_torch_ops: frozenset[str] = frozenset()
    # What the first call at a size the process has not seen may cost, on the judge's
    # clock (runners.harness.new_shapes): this factor of the steady call, or the floor
    # (ms) of the device, whichever is larger, beyond what it cost the baseline. A serving
    # engine meets a new size every decode step: a compile per size is a stall per step.
    # The CPU's floor allows for a 2-core machine's scheduling, not for a compiler; the
    # GPU's for capturing a graph at a new size and allocating for it (29 ms for an
    # honest torch rmsnorm at a new token count on an H200, the kept kernel's 9 ms), not
    # for a compiler (every one measured there cost 110 ms to 9 s a new size).
    first_call_budget: tuple[float, Mapping[str, float]] = (10.0, {"cpu": 50.0, "cuda": 50.0})
    # Whether CPU inference engines serve this op (llama.cpp normalises on the CPU): only
    # then is a CPU win a speed-up anyone ships. Any other op's CPU runs decide whether a
    # kernel is right, never whether it is faster: a CPU win of it is not kept.
    cpu_served: bool = False
    # Workload parameters that follow from its size (the paged ops' token total and block
    # counts): they tell no two kinds of workload apart, so curves and new shapes ignore them.
    sized_params: frozenset[str] = frozenset()
    # Tensor shapes follow the context length rounded up to this multiple, per device:
    # a server allocates its block table and cache for a bucket of lengths and replays
    # one graph inside it, so a kernel that specializes on shapes pays once a bucket, and
    # the padding (a wider table, a larger cache) is in its timing. None: shapes follow
    # the length itself.
    context_bucket: Mapping[str, int] | None = None
    # Batches are padded up to a multiple of this, per device, as a server pads a batch
    # to the next size it captured a graph for: the padding rows are in the candidate's
    # call and timing. None: the batch is called as it is.
    batch_bucket: Mapping[str, int] | None = None
    # Decode steps in one timed call of the end-to-end loop, per device, for ops the
    # decode loop serves (runners.e2e.model.PagedDecodeLoop); None: a single step.
    decode_steps: Mapping[str, int] | None = None
    # Processes one call spans: above 1 the op is a collective, each rank calls forward
    # on its own share and the harness runs it across ranks (runners.harness.collective).
    world_size: int = 1
    # What the op's size axis is called in errors (the sizes a thesis asks for): a
    # collective's sizes are message sizes, not context lengths.
    size_name: str = "context length"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @property
    def baseline_path(self) -> Path:
        return self.folder / "baseline.py"

    def kernels(self) -> dict[str, Path]:
        files = sorted((self.folder / "kernels").glob("*.py"))
        return {path.stem: path for path in files if not path.name.startswith("_")}

    def default_context_lengths(self, device: str) -> list[int]:
        raise NotImplementedError

    def buckets(self, device: str) -> dict[str, int]:
        """The shape buckets on `device`, by the workload parameter they round up
        ("context_length", "batch"): only those the op declares."""
        declared = (("context_length", self.context_bucket), ("batch", self.batch_bucket))
        return {axis: by_device[device] for axis, by_device in declared
                if by_device and by_device.get(device)}

    def bucketed(self, device: str, context_length: int) -> int:
        """The context length the shapes are made for (context_bucket)."""
        return _rounded_up(context_length, self.buckets(device).get("context_length"))

    def padded_batch(self, device: str, batch: int) -> int:
        """The batch size the candidate is called with (batch_bucket)."""
        return _rounded_up(batch, self.buckets(device).get("batch"))

    def default_batch_sizes(self, device: str) -> list[int]:
        raise NotImplementedError

    def context_length_range(self, device: str) -> tuple[int, int]:
        raise NotImplementedError

    def max_batch_size(self, device: str) -> int:
        raise NotImplementedError

    def workloads(
        self,
        device: str,
        context_lengths: Iterable[int] | None = None,
        batch_sizes: Iterable[int] | None = None,
    ) -> list[Workload]:
        kind = device_type(device)
        low, high = self.context_length_range(kind)
        contexts = _validated(
            self.size_name,
            self.default_context_lengths(kind) if context_lengths is None else context_lengths,
            op=self.name, device=kind, low=low, high=high,
        )
        batches = _validated(
            "batch size",
            self.default_batch_sizes(kind) if batch_sizes is None else batch_sizes,
            op=self.name, device=kind, low=1, high=self.max_batch_size(kind),
        )
        found = self.build_workloads(kind, contexts, batches)
        if len(found) > MAX_WORKLOADS:
            raise WorkloadError(
                f"{len(found)} workloads requested for {self.name}; at most {MAX_WORKLOADS} "
                "per evaluation: pass fewer context lengths or batch sizes"
            )
        return found

    def build_workloads(
        self, device: str, context_lengths: list[int], batch_sizes: list[int]
    ) -> list[Workload]:
        raise NotImplementedError

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        """Inputs keyed in the order of forward's parameters: the harness passes them positionally."""
        raise NotImplementedError

    def reference(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def secret_params(self, workload: Workload, draw: random.Random) -> dict[str, Any]:
        """Scalar parameters of a secret size (runners.harness.sizes) other than the
        declared workloads': a constant every declared workload shares (rmsnorm's eps) is
        one a kernel can bake in, right wherever it is checked and wrong where it is served.
        None by default."""
        return {}

    def nearly(self, inputs: Mapping[str, Any], other: Mapping[str, Any],
               generator: torch.Generator) -> dict[str, Any]:
        """A copy of `inputs` that differs from them in a few places, taken from `other`
        (another input set of the same workload). A kernel that recognises inputs it has
        seen by a sample of their values returns its old answer here, and is wrong; any
        other kernel just computes. Places drawn from `generator` (a CPU generator)."""
        name = max((key for key, value in inputs.items() if isinstance(value, torch.Tensor)),
                   key=lambda key: inputs[key].numel())
        changed = {key: value.clone() if isinstance(value, torch.Tensor) else value
                   for key, value in inputs.items()}
        flat = changed[name].view(-1)
        count = max(1, flat.numel() // 10_000)
        places = torch.randint(flat.numel(), (count,), generator=generator).to(flat.device)
        flat[places] = other[name].reshape(-1)[places]
        return changed

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        try:
            return self.tolerances[dtype]
        except KeyError:
            raise ValueError(f"{self.name} declares no tolerance for {dtype}") from None

    def check(
        self, output: torch.Tensor, reference_output: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[bool, str]:
        raise NotImplementedError

    def flops(self, workload: Workload) -> int:
        raise NotImplementedError

    def bytes(self, workload: Workload) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Op {self.name}>"
