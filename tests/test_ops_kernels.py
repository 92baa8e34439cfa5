"""Every shipped candidate, and every point of every shipped SPACE, is correct."""

from __future__ import annotations

import pytest

from runners.harness.correctness import check_correctness
from runners.harness.worker import LocalWorker
from runners.ops import get_op, list_ops
from runners.harness.dsl import kernel_dsl
from runners.space import grid_points, materialize, read_literals

# Small, but uneven: rmsnorm's 300 rows leave a partial block, dsa's 5000 tokens a
# partial chunk, and 5000 spans several chunks for every chunk size but the largest.
SMALL = {
    "rmsnorm": ([64, 300], [1]),
    "dsa_indexer_topk": ([2048, 5000], [3]),
    "dsa_indexer_topk_fp8": ([2048, 5000], [3]),
    # The mixed batch's lengths span several chunks at 5000 for all but the largest.
    "dsa_indexer_topk_paged": ([2048, 5000], [5]),
    "dsa_indexer_topk_paged_fp8": ([2048, 5000], [5]),
}


# Ops checked here run in one process. A collective op's kernels need their ranks:
# tests/test_allreduce.py checks every point of their SPACE across two ranks.
SINGLE_PROCESS_OPS = [name for name in list_ops() if get_op(name).world_size == 1]


def _points():
    for op_name in SINGLE_PROCESS_OPS:
        for kernel, path in get_op(op_name).kernels().items():
            if kernel_dsl(path) != "torch":
                continue  # Triton and CuTe kernels need their own process: tests/test_kernels_*.py
            for point in grid_points(read_literals(path.read_text())[1]):
                label = ",".join(f"{key}={value}" for key, value in point.items())
                yield pytest.param(op_name, path, point, id=f"{op_name}-{kernel}-{label}")


def _assert_correct(op_name, path):
    op = get_op(op_name)
    contexts, batches = SMALL[op_name]
    workloads = op.workloads("cpu", contexts, batches)
    # The project's own kernels: checked by the judge's code, run in this process.
    candidate = LocalWorker(op_name, "cpu", path)
    guards = check_correctness(op, candidate, workloads, feed=candidate.arena, secret_seed=2024,
                               progress=lambda message: None)
    failures = [f"{guard.name}: {guard.detail}" for guard in guards if guard.status != "pass"]
    assert not failures
    assert {guard.name for guard in guards} == {
        "correctness", "output-type", "inputs-unchanged", "deterministic",
    }


@pytest.mark.parametrize("op_name", SINGLE_PROCESS_OPS)
def test_the_shipped_baseline_is_correct(op_name):
    _assert_correct(op_name, get_op(op_name).baseline_path)


@pytest.mark.parametrize(("op_name", "path", "point"), list(_points()))
def test_every_point_of_every_kernel_space_is_correct(op_name, path, point, tmp_path):
    candidate = tmp_path / path.name
    candidate.write_text(materialize(path.read_text(), point))
    _assert_correct(op_name, candidate)
