"""The op registry: every folder here with an `__init__.py` defining `OP` is an op.

Users add an op by adding a folder, so the registry is found by scanning, never listed.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

from runners.ops.base import DISTRIBUTIONS, MAX_WORKLOADS, Op, Workload, WorkloadError

__all__ = [
    "DISTRIBUTIONS",
    "MAX_WORKLOADS",
    "Op",
    "UnknownOpError",
    "Workload",
    "WorkloadError",
    "get_op",
    "list_ops",
]

_HERE = Path(__file__).parent


class UnknownOpError(ValueError):
    pass


@functools.cache
def _registry() -> dict[str, Op]:
    ops: dict[str, Op] = {}
    for folder in sorted(_HERE.iterdir()):
        if folder.name.startswith(("_", ".")) or not (folder / "__init__.py").is_file():
            continue
        module = importlib.import_module(f"{__name__}.{folder.name}")
        op = getattr(module, "OP", None)
        if not isinstance(op, Op):
            raise TypeError(f"runners/ops/{folder.name}/__init__.py must define OP, an Op instance")
        if op.name != folder.name:
            raise TypeError(f"runners/ops/{folder.name} declares the name {op.name!r}; they must match")
        ops[op.name] = op
    return ops


def list_ops() -> list[str]:
    return sorted(_registry())


def get_op(name: str) -> Op:
    try:
        return _registry()[name]
    except KeyError:
        known = ", ".join(list_ops())
        raise UnknownOpError(f"unknown op {name!r} (known: {known})") from None
