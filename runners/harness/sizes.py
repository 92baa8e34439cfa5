"""Secret sizes: workloads the candidate cannot know, checked beside the declared ones.

Every declared size may be a multiple of a kernel's tile (64, 128, 2048 tokens…), and a
kernel can be right only there. So each run also checks sizes drawn from its secret
seed: context lengths that are odd (a multiple of no power of two), one below the
smallest declared and one inside the declared span (above it when there is one size),
within the op's declared range, at a batch size the run does not declare where the op
allows another, no larger than the largest declared (half again the only one, when
there is one): a secret size costs about what was asked, no more. Where an op's declared
workloads share a constant (rmsnorm's eps), a secret size draws its own
(`Op.secret_params`). They are checked for correctness only; a dispatch range is made of
sizes that were checked and timed, and names the secret sizes checked inside it.
"""

from __future__ import annotations

import math
import random

from runners.harness.seeds import derive_seed
from runners.ops import Op, Workload

PREFIX = "secret size "


def _odd(value: float, low: int, high: int) -> int:
    size = min(high, max(low, int(value))) | 1
    return size if size <= high else size - 2


def secret_workloads(op: Op, device: str, workloads: list[Workload],
                     batch_sizes: list[int] | None, secret_seed: int) -> list[Workload]:
    """Two context lengths and one batch size drawn from the secret seed (see above)."""
    draw = random.Random(derive_seed(secret_seed, "secret sizes"))
    low, high = op.context_length_range(device)
    declared = [w.params["context_length"] for w in workloads if "context_length" in w.params]
    if not declared:  # rmsnorm's workloads carry tokens: its contexts are what was asked
        declared = [w.params["tokens"] for w in workloads if "tokens" in w.params] or [low]
    smallest, largest = min(declared), max(declared)
    batches = sorted(set(batch_sizes or op.default_batch_sizes(device)))
    others = [batch for batch in range(1, op.max_batch_size(device) + 1) if batch not in batches]
    below = [batch for batch in others if batch < max(batches)]
    batch = draw.choice(below or others) if others else batches[0]
    # rmsnorm's size is its tokens, context × batch: its secret contexts are scaled down.
    per_batch = batch if "context_length" not in workloads[0].params else 1
    top = largest if largest > smallest else smallest + smallest // 2 + 3
    top = max(low, min(high, top // per_batch))
    bottom = max(low, smallest // (2 * per_batch))
    first = max(bottom, min(top, smallest // per_batch))

    def between(start: int, end: int) -> float:
        return math.exp(draw.uniform(math.log(max(1, start)), math.log(max(1, end))))

    contexts = sorted({_odd(between(bottom, first), low, high), _odd(between(first, top), low, high)})
    found = op.workloads(device, contexts, [batch])
    secret = []
    for workload in found:
        params = op.secret_params(workload, draw)
        shown = "".join(f",{key}={value:g}" if isinstance(value, float) else f",{key}={value}"
                        for key, value in params.items())
        secret.append(Workload(name=PREFIX + workload.name + shown, device=workload.device,
                               params={**workload.params, **params}))
    return secret


def sizes_along(axis: str, workloads: list[Workload]) -> list[int]:
    return sorted({w.params[axis] for w in workloads if axis in w.params})
