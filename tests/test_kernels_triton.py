"""The shipped Triton kernels: every SPACE point is correct under the CPU interpreter.

The points run in one child process with the environment a candidate's child gets
(`child_environment("triton", "cpu", ...)`): Triton must see TRITON_INTERPRET when it is
first imported, since its own library functions (tl.sum, ...) are decorated then, and
this test process may have imported Triton already. The interpreter runs programs one
by one in numpy, so the shapes are small, yet uneven: 37 rows leave a partial block of
rows, 1000 context tokens a partial block of tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runners.harness.dsl import child_environment, kernel_dsl, static_check
from runners.ops import get_op, list_ops
from runners.space import grid_points, read_literals

import triton  # noqa: F401,E402 — a dependency: its absence must fail, not skip

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import importlib.util, json, sys
    from pathlib import Path

    from runners.ops import Workload, get_op
    from runners.space import materialize
    from tests.kernel_checks import check_failures

    SMALL = {
        "rmsnorm": ([37], [1]),
        "dsa_indexer_topk": ([1000], [3]),
        "dsa_indexer_topk_fp8": ([1000], [3]),
    }
    jobs, scratch = json.loads(sys.argv[1]), Path(sys.argv[2])
    results = {}
    for index, (key, op_name, path, point, shape) in enumerate(jobs):
        candidate = scratch / f"point{index}_{Path(path).name}"
        candidate.write_text(materialize(Path(path).read_text(), point))
        spec = importlib.util.spec_from_file_location(candidate.stem, candidate)
        module = importlib.util.module_from_spec(spec)
        sys.modules[candidate.stem] = module  # Triton looks kernels' modules up here
        spec.loader.exec_module(module)
        op = get_op(op_name)
        workloads = ([Workload(name="model-heads", device="cpu", params=shape)] if shape
                     else op.workloads("cpu", *SMALL[op_name]))
        # One seed, both value distributions: the interpreter is slow.
        results[key] = check_failures(op, module.forward, workloads, (11,))
    print(json.dumps(results))
""")


def _kernels(dsl):
    for op_name in list_ops():
        for name, path in get_op(op_name).kernels().items():
            if kernel_dsl(path) == dsl:
                yield op_name, name, path


# The indexers' CPU workloads have 16 heads: one head block for every BLOCK_H in their
# SPACEs. At the model's 64 heads of 128 (few tokens, so the interpreter stays quick)
# the head loop turns more than once, as it does on a GPU.
MODEL_HEADS = {"context_length": 300, "batch": 2, "heads": 64, "head_dim": 128, "topk": 64}


def _jobs():
    for op_name, name, path in _kernels("triton"):
        for point in grid_points(read_literals(path.read_text())[1]):
            label = ",".join(f"{key}={value}" for key, value in point.items())
            yield f"{op_name}-{name}-{label}", op_name, str(path), point, None
        if "heads" in get_op(op_name).workloads("cpu")[0].params:
            yield f"{op_name}-{name}-PARAMS-at-64-heads", op_name, str(path), {}, MODEL_HEADS


JOBS = list(_jobs())


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("triton-points")
    env = {**os.environ, **child_environment("triton", "cpu", scratch),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(JOBS), str(scratch)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_there_are_triton_kernels_for_every_op():
    assert {op_name for op_name, _, _ in _kernels("triton")} == {
        "rmsnorm", "dsa_indexer_topk", "dsa_indexer_topk_fp8",
    }


@pytest.mark.parametrize("key", [job[0] for job in JOBS])
def test_every_space_point_is_correct_under_the_interpreter(interpreted_results, key):
    assert interpreted_results[key] == []


@pytest.mark.parametrize(("op_name", "name", "path"), list(_kernels("triton")))
def test_the_static_check_finds_the_launched_triton_kernel(op_name, name, path):
    status, detail = static_check(path.read_text(), "triton")
    assert status == "pass", detail


def _torch_files():
    yield from (path for _, _, path in _kernels("torch"))
    yield from (get_op(op_name).baseline_path for op_name in list_ops())


@pytest.mark.parametrize("path", list(_torch_files()), ids=lambda path: f"{path.parent.name}/{path.name}")
def test_torch_kernels_fail_the_triton_check(path):
    status, detail = static_check(path.read_text(), "triton")
    assert status == "fail"
    assert "does not import triton" in detail
