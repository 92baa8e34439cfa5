"""What the judge works out from the secret seed alone, kept for the next candidate of a sweep.

Every input set of an evaluation is a pure function of (op, workload, seed, distribution),
and every seed is derived from the run's secret seed; each reference is a pure function
of its inputs. The candidates of a sweep whose sources were all fixed before the first
one ran share one secret seed (runners.harness.sweep), so the second candidate needs the
very inputs and references the first one needed: remembered here, the judge makes them
once a sweep instead of once a candidate (on a 2-core CPU, randn, the float64 references
and their copies were 5.7 s of a 20 s rmsnorm evaluation).

Nothing of it reaches a child: the judge still writes each call's inputs into memory the
child maps, one call at a time, and keeps the references to itself. A candidate learns
nothing it would not learn with a seed of its own, because it cannot see the candidates
before it, and none of them could choose what it runs (their sources were fixed first).

`Memo(0)` keeps nothing: the evaluation of a single candidate makes everything itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from runners.ops import Op, Workload

# Inputs and references kept at most on a CPU, and at most this share of the host's
# memory, which is the children's first: one rmsnorm evaluation of the default CPU
# workloads makes 2.8 GiB of them (most of it the timed calls' input sets).
CPU_LIMIT_BYTES = 4 * 2**30
CPU_SHARE = 1 / 4


def limit_bytes(device: str) -> int:
    """None kept on a GPU: there making inputs and references is the device's work, not
    the judge's one core's, and whatever it kept would sit beside the children's memory
    (the paged ops' sweeps already ran a judge out of it: docs/benchmarks/h200-dsa-indexer.md)."""
    if device == "cuda":
        return 0
    return min(CPU_LIMIT_BYTES, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * CPU_SHARE))


def _key(op: Op, workload: Workload, *parts: object) -> tuple:
    params = json.dumps(workload.params, sort_keys=True, default=str)
    return (op.name, workload.device, workload.name, params, *parts)


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_bytes(item) for item in value.values())
    return 0


def _copy(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A set of its own for each caller, as op.make_inputs gives one: whatever a caller
    does to its set (none is meant to change one) never reaches the next caller's."""
    return {name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


class Memo:
    """Input sets and references by their key, up to `limit_bytes` (then made each time)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.hits = 0
        self.made = 0
        self._inputs: dict[tuple, dict[str, Any]] = {}
        self._references: dict[tuple, torch.Tensor] = {}

    def inputs(self, op: Op, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        """`op.make_inputs(workload, seed, distribution)`, a copy of its own."""
        key = _key(op, workload, seed, distribution)
        kept = self._inputs.get(key)
        if kept is not None:
            self.hits += 1
            return _copy(kept)
        made = op.make_inputs(workload, seed, distribution)
        self.made += 1
        if self._keeps(made):
            self._inputs[key] = _copy(made)
        return made

    def reference(self, op: Op, workload: Workload, key: tuple,
                  inputs: Mapping[str, Any]) -> torch.Tensor:
        """`op.reference` of `inputs`, which `key` (seed, distribution, variant) names:
        the caller vouches that the key alone decides them. Read it, never change it."""
        full = _key(op, workload, *key)
        kept = self._references.get(full)
        if kept is not None:
            self.hits += 1
            return kept
        reference = op.reference(_copy(inputs))
        self.made += 1
        if self._keeps(reference):
            self._references[full] = reference
        return reference

    def _keeps(self, value: Any) -> bool:
        size = _bytes(value)
        if self.held_bytes + size > self.limit_bytes:
            return False
        self.held_bytes += size
        return True

    def summary(self) -> str:
        return (f"{self.hits:,} input sets and references reused, {self.made:,} made, "
                f"{self.held_bytes / 2**20:,.0f} MiB held")


# The memo of a lone evaluation: everything made when it is needed, nothing kept.
NO_MEMO = Memo(0)
