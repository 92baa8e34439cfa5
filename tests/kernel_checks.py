"""Checks a kernel's forward against its op; imported by the child scripts of the DSL tests.

Triton and CuTe kernels are checked in a child process with the environment a
candidate's child gets, so this stays free of pytest and runs there as plain code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

DISTRIBUTIONS = ("normal", "uniform_outliers")


def check_failures(op, forward: Callable, workloads: Iterable, seeds: Iterable[int]) -> list[str]:
    """One line per (workload, seed, distribution) the forward gets wrong."""
    found = []
    for workload in workloads:
        for seed in seeds:
            for distribution in DISTRIBUTIONS:
                inputs = op.make_inputs(workload, seed, distribution)
                expected = op.reference(
                    {k: v.clone() if hasattr(v, "clone") else v for k, v in inputs.items()})
                correct, detail = op.check(forward(*inputs.values()), expected, inputs)
                if not correct:
                    found.append(f"{workload.name} seed={seed} {distribution}: {detail}")
    return found
