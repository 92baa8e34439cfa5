"""`python -m runners.harness`, run as scripts and the Django worker run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runners.harness.stats import MIN_NOISE_FLOOR
from runners.space import grid_points, read_literals

ROOT = Path(__file__).resolve().parent.parent

CONTRACT_KEYS = {"op", "device", "verdict", "correct", "guards", "workloads", "e2e", "dispatch"}
WORKLOAD_KEYS = {"name", "baseline_ms", "candidate_ms", "speedup", "significant"}


def _harness(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runners.harness", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )


def test_an_a_a_run_prints_one_json_object_in_the_contract_shape_and_is_no_gain():
    done = _harness("evaluate", "rmsnorm", "baseline", "--json", "--ctx", "64,256",
                    "--time-budget", "0.1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1
    result = json.loads(done.stdout)
    assert set(result) >= CONTRACT_KEYS
    assert result["op"] == "rmsnorm" and result["device"] == "cpu"
    assert result["correct"] is True
    assert result["verdict"] == "no-gain"
    assert {"baseline_ms", "candidate_ms", "delta_pct"} <= set(result["e2e"])
    assert result["dispatch"] is None
    assert all(set(guard) == {"name", "status", "detail"} for guard in result["guards"])
    assert all(guard["status"] == "pass" for guard in result["guards"])
    assert [w["name"] for w in result["workloads"]] == [
        "t=64,dtype=float32", "t=64,dtype=bfloat16", "t=256,dtype=float32", "t=256,dtype=bfloat16",
    ]
    for workload in result["workloads"]:
        assert set(workload) >= WORKLOAD_KEYS
        assert workload["baseline_ms"] > 0 and workload["candidate_ms"] > 0
        assert workload["samples"] >= 10
        assert workload["noise_floor"] >= MIN_NOISE_FLOOR["cpu"]
        # The CPU has a generous bound, never a roofline to be a fraction of.
        assert workload["floor_ms"] > 0 and workload["roofline_fraction"] is None
    assert isinstance(result["seed"], int) and result["threads"] >= 1
    assert result["timing_meaningful"] is True
    assert result["error"] is None
    # Progress is for people, on stderr.
    assert "verdict: " in done.stderr


def test_a_fake_result_printed_by_a_candidate_is_only_a_log_line():
    done = _harness("evaluate", "rmsnorm", str(ROOT / "tests" / "candidates" / "rmsnorm_fake_result.py"),
                    "--json", "--ctx", "64", "--time-budget", "0.05")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1
    result = json.loads(done.stdout)
    assert result["verdict"] == "rejected" and result["guards"] != []
    assert '"verdict": "win"' in done.stderr


def test_a_candidate_that_prints_cannot_corrupt_the_json(tmp_path):
    candidate = tmp_path / "noisy.py"
    candidate.write_text(
        "import os, sys\n"
        "import torch\n"
        "print('hello from import')\n"
        "def forward(x, weight, eps):\n"
        "    print('{\"verdict\": \"win\"}')\n"
        "    os.write(1, b'{\"verdict\": \"win\"}\\n')\n"
        "    sys.stdout.flush()\n"
        "    x32 = x.float()\n"
        "    rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)\n"
        "    return (x32 * rstd * weight.float()).to(x.dtype)\n"
    )
    done = _harness("evaluate", "rmsnorm", str(candidate), "--json", "--ctx", "64",
                    "--time-budget", "0.05")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["correct"] is True
    assert "hello from import" in done.stderr
    assert done.stdout.count("\n") == 1


def test_a_candidate_that_crashes_at_import_completes_as_rejected(tmp_path):
    candidate = tmp_path / "broken.py"
    candidate.write_text("raise ImportError('no triton here')\n")
    done = _harness("evaluate", "rmsnorm", str(candidate), "--json", "--ctx", "64")
    assert done.returncode == 0
    result = json.loads(done.stdout)
    assert result["verdict"] == "rejected"
    assert [guard for guard in result["guards"] if guard["status"] != "pass"] == [
        {"name": "loads", "status": "fail",
         "detail": "importing broken.py raised ImportError: no triton here"},
    ]
    assert [w["baseline_ms"] for w in result["workloads"]] == [None, None]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["softmax", "baseline"], "unknown op 'softmax' (known: allreduce_sum, dsa_indexer_topk, dsa_indexer_topk_fp8, "
                                  "dsa_indexer_topk_paged, dsa_indexer_topk_paged_fp8, rmsnorm)"),
        (["rmsnorm", "/nonexistent/candidate.py"], "candidate file not found"),
        (["rmsnorm", "baseline", "--ctx", "20x"], "is not a comma-separated list"),
        (["rmsnorm", "baseline", "--ctx", "0"], "context length 0 must be positive"),
        (["rmsnorm", "baseline", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["rmsnorm"], "the following arguments are required: candidate"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, message):
    done = _harness("evaluate", *args, "--json")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert message in done.stderr


def test_ops_lists_every_op_with_its_default_workloads_and_spaces():
    done = _harness("ops", "--json")
    assert done.returncode == 0, done.stderr
    listed = {op["name"]: op for op in json.loads(done.stdout)["ops"]}
    assert sorted(listed) == ["allreduce_sum", "dsa_indexer_topk", "dsa_indexer_topk_fp8", "dsa_indexer_topk_paged",
                              "dsa_indexer_topk_paged_fp8", "rmsnorm"]
    rmsnorm = listed["rmsnorm"]
    assert rmsnorm["signature"] == "forward(x, weight, eps) -> Tensor"
    cpu = rmsnorm["devices"]["cpu"]
    assert cpu["context_lengths"] == [64, 512, 4096]
    assert cpu["workloads"][0]["name"] == "t=64,dtype=float32"
    assert cpu["workloads"][0]["flops"] > 0
    blocked = next(kernel for kernel in rmsnorm["kernels"] if kernel["name"] == "blocked")
    assert blocked["points"] == len(grid_points(read_literals(Path(blocked["path"]).read_text())[1]))
    assert listed["dsa_indexer_topk"]["devices"]["cuda"]["workloads"][-1]["name"] == "ctx=262144,m=64"


def test_the_harness_imports_neither_django_nor_scipy_up_front():
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys, runners.harness, runners.space, runners.ops; runners.ops.list_ops(); "
         "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'scipy', 'triton'}))"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )
    assert done.stdout.strip() == "[]"
