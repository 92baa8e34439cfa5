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
            if not found:
                found += graph_failures(op, forward, workload, seed)
    return found


def graph_failures(op, forward: Callable, workload, seed: int) -> list[str]:
    """The harness times a CUDA graph's replays: forward captured once, then replayed on
    new values copied into the captured inputs must give their answer (a kernel launched
    on any stream but the capturing one is not in the graph, and its replay does nothing)."""
    import torch

    first = op.make_inputs(workload, seed, "normal")
    if not any(torch.is_tensor(v) and v.is_cuda for v in first.values()):
        return []
    args = list(first.values())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(*args)  # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward(*args)
    second = op.make_inputs(workload, seed + 1000, "uniform_outliers")
    for buffer, value in zip(args, second.values(), strict=True):
        if torch.is_tensor(buffer):
            buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    expected = op.reference({k: v.clone() if hasattr(v, "clone") else v for k, v in second.items()})
    correct, detail = op.check(output.clone(), expected, second)
    return [] if correct else [f"{workload.name} seed={seed} replayed from a CUDA graph: {detail}"]
