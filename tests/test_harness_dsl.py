"""A required DSL, judged by the harness: the source must define and launch a DSL kernel,
every call must actually launch one and leave the op's compute to it, and interpreted
Triton times are reported but never make a win.

The torch ops a call runs beside its launches are recorded in a child process with a
Triton candidate's environment (`child_environment("triton", "cpu", ...)`): Triton
must see TRITON_INTERPRET when it is first imported, and this test process may have
imported it already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from runners.harness import Limits, evaluate
from runners.harness.dsl import child_environment, describe_ops, torch_compute
from runners.harness.evaluate import _required_dsl
from runners.ops import get_op

import triton  # noqa: F401,E402 — a dependency: its absence must fail, not skip

ROOT = Path(__file__).resolve().parents[1]
FALLBACK = ROOT / "tests" / "candidates" / "rmsnorm_torch_fallback_triton.py"
CLOTHED = ROOT / "tests" / "candidates" / "rmsnorm_hook_in_torch_clothes_triton.py"
LIMITS = Limits(import_s=30, call_s=30, memory_bytes=2 * 2**30)
STATIC_PASS = ("pass", "forward launches @triton.jit kernel _k (forward)")

# A real Triton RMSNorm (all rows of a CPU workload in one program, so the interpreter
# is quick), a kernel that does one small thing (scales a single value), and RMSNorm
# in torch for the candidates that only pretend.
TRITON = """
import torch
import triton
import triton.language as tl


@triton.jit
def _scale_one(pointer, factor):
    tl.store(pointer, tl.load(pointer) * factor)


@triton.jit
def _rmsnorm_rows(x_ptr, w_ptr, y_ptr, tokens, eps, hidden: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, hidden)
    mask = (rows < tokens)[:, None]
    offsets = rows[:, None] * hidden + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    w = tl.load(w_ptr + cols).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rmsnorm(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
"""


def _candidate(tmp_path, body: str):
    path = tmp_path / "candidate.py"
    path.write_text(TRITON + textwrap.dedent(body))
    return path


def _guard(result, name):
    return next(guard for guard in result.guards if guard.name == name)


# --- end to end ----------------------------------------------------------------------


def test_interpreted_triton_is_checked_but_never_timed(tmp_path):
    """Its CPU times say nothing about a GPU: correctness only, and the result says so."""
    candidate = _candidate(tmp_path, """
        def forward(x, weight, eps):
            tokens, hidden = x.shape
            y = torch.empty_like(x)
            _rmsnorm_rows[(triton.cdiv(tokens, 64),)](x, weight, y, tokens, eps,
                                                      hidden=hidden, ROWS=64)
            return y
    """)
    result = evaluate("rmsnorm", candidate, dsl="triton", context_lengths=[64],
                      time_budget_s=0.05, limits=LIMITS)
    assert result.correct is True, result.guards
    assert result.timing_meaningful is False
    assert all(w.baseline_ms is None and w.speedup is None and not w.significant
               for w in result.workloads), result.workloads
    assert result.verdict == "no-gain" and result.stopped_at is None
    timing = _guard(result, "timing")
    assert timing.status == "warn" and timing.detail.startswith("not timed: ")
    assert "Triton's CPU interpreter" in timing.detail
    assert result.e2e is None
    required = _guard(result, "required-dsl")
    assert required.status == "pass"
    assert "forward launches @triton.jit kernel _rmsnorm_rows" in required.detail
    assert "counted calls launched triton kernels" in required.detail
    assert required.detail.endswith("and none ran torch compute beside them")


def test_a_triton_kernel_that_is_launched_on_no_call_fails_the_required_dsl(tmp_path):
    candidate = _candidate(tmp_path, """
        def forward(x, weight, eps):
            if x.shape[0] < 0:  # never: the kernel is there for the static check only
                _scale_one[(1,)](torch.ones(1), 2.0)
            return _rmsnorm(x, weight, eps)
    """)
    result = evaluate("rmsnorm", candidate, dsl="triton", context_lengths=[64],
                      time_budget_s=0.05, limits=LIMITS)
    assert result.verdict == "rejected"
    assert _guard(result, "required-dsl").status == "fail"
    assert "launched no triton kernel" in _guard(result, "required-dsl").detail


def test_a_torch_file_asked_to_be_triton_is_rejected_and_never_timed(tmp_path):
    path = tmp_path / "candidate.py"
    path.write_text("import torch\n\ndef forward(x, weight, eps):\n"
                    "    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), "
                    "weight.float(), eps).to(x.dtype)\n")
    result = evaluate("rmsnorm", path, dsl="triton", context_lengths=[64],
                      time_budget_s=0.05, limits=LIMITS)
    # Rejected by its source alone, before any process ran it: never checked, never timed.
    assert result.verdict == "rejected" and result.stopped_at == "static"
    assert result.correct is False
    assert _guard(result, "required-dsl").detail.startswith("does not import triton")
    assert [guard.name for guard in result.guards] == ["required-dsl", "protected-settings"]
    assert all(workload.baseline_ms is None for workload in result.workloads)


def test_a_triton_kernel_launched_for_show_beside_torch_rmsnorm_is_rejected_as_a_torch_fallback():
    result = evaluate("rmsnorm", FALLBACK, dsl="triton", context_lengths=[64],
                      time_budget_s=0.05, limits=LIMITS)
    assert result.correct is True and result.verdict == "rejected"
    required = _guard(result, "required-dsl")
    assert required.status == "fail"
    assert required.detail.startswith("torch fallback: the call ran torch compute on the hot path (")
    assert "aten.rsqrt ×1" in required.detail and "beside its triton kernels" in required.detail


# --- the torch ops a call runs beside its launches, recorded in a Triton child ---------

CHILD = textwrap.dedent("""
    import importlib.util, json, sys
    from pathlib import Path

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from runners.harness.dsl import launch_counter
    from runners.ops import get_op

    class Dispatched(TorchDispatchMode):
        # Every aten op, whoever asked for it: what the counter sets aside shows here.
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def load(path):
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # Triton looks kernels' modules up here
        spec.loader.exec_module(module)
        return module

    def record(forward, args):
        with Dispatched() as dispatched, launch_counter("triton") as counted:
            forward(*args)
        return {"launches": counted.count, "torch_ops": dict(counted.torch_ops),
                "dispatched": sorted(dispatched.ops)}

    def calls(op_name, module, contexts, batches):
        op = get_op(op_name)
        return {workload.name: record(module.forward,
                                      tuple(op.make_inputs(workload, 11, "normal").values()))
                for workload in op.workloads("cpu", contexts, batches)}

    rmsnorm, indexer = get_op("rmsnorm").kernels(), get_op("dsa_indexer_topk").kernels()
    rows = load(rmsnorm["rows_triton"])
    results = {
        "fallback": calls("rmsnorm", load(sys.argv[1]), [64], [1]),
        "rows_triton": calls("rmsnorm", rows, [64], [1]),
        "fused_logits_triton": calls("dsa_indexer_topk", load(indexer["fused_logits_triton"]),
                                     [1000], [3]),
    }
    # Candidate code that Triton itself calls during the launch: a pre-run hook.
    rows._rmsnorm_rows.add_pre_run_hook(lambda *args, **kwargs: torch.ones(2, 2) @ torch.ones(2, 2))
    results["hooked"] = calls("rmsnorm", rows, [64], [1])
    # The same, its hook rebuilt around a module's globals to pass for torch's or Triton's.
    results["clothed"] = calls("rmsnorm", load(sys.argv[2]), [64], [1])
    import types, triton.language
    def mm(*args, **kwargs):
        import torch  # triton.language's namespace has no torch
        return torch.ones(2, 2) @ torch.ones(2, 2)
    rows._rmsnorm_rows.add_pre_run_hook(types.FunctionType(mm.__code__, vars(triton.language), "mm"))
    results["hooked_twice_as_triton"] = calls("rmsnorm", rows, [64], [1])
    op = get_op("rmsnorm")
    inputs = op.make_inputs(op.workloads("cpu", [64], [1])[0], 12, "normal")
    results["clothed_correct"] = op.check(load(sys.argv[2]).forward(*inputs.values()), op.reference(inputs),
                                          inputs)[0]
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("triton-torch-ops")
    env = {**os.environ, **child_environment("triton", "cpu", scratch),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CHILD, str(FALLBACK), str(CLOTHED)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kernel_launched_for_show_beside_torch_compute_is_caught_with_the_op_names(recorded):
    for call in recorded["fallback"].values():
        assert call["launches"] == 1  # what the launch counter alone would pass
        computed = torch_compute(call["torch_ops"])
        assert {"aten.pow", "aten.mean", "aten.add", "aten.rsqrt", "aten.mul"} <= set(computed)
    ops = list(recorded["fallback"].values())
    guard = _required_dsl("triton", STATIC_PASS, [1] * len(ops), [call["torch_ops"] for call in ops])
    assert guard.status == "fail"
    assert guard.detail.startswith("torch fallback: the call ran torch compute on the hot path (")
    assert "aten.mul ×" in guard.detail and "aten.rsqrt ×1" in guard.detail
    assert guard.detail.endswith("beside its triton kernels, in 2 of 2 recorded calls")


def test_the_shipped_rmsnorm_triton_kernel_runs_no_torch_compute(recorded):
    for call in recorded["rows_triton"].values():
        assert call["launches"] == 1
        assert call["torch_ops"] == {"aten.empty_like": 1}
        assert torch_compute(call["torch_ops"]) == {}


def test_the_shipped_indexer_kernel_keeps_only_its_declared_top_k_in_torch(recorded):
    op = get_op("dsa_indexer_topk")
    calls = list(recorded["fused_logits_triton"].values())
    for call in calls:
        assert call["launches"] == 1
        assert torch_compute(call["torch_ops"]) == {"aten.topk": 1}
    guard = _required_dsl("triton", STATIC_PASS, [1] * len(calls),
                          [call["torch_ops"] for call in calls], op.dsl_torch_ops)
    assert guard.status == "warn"
    assert "torch computed aten.topk ×1 in 1 of 1 recorded calls" in guard.detail


def test_torch_ops_the_interpreter_runs_inside_a_launch_do_not_count(recorded):
    for call in recorded["rows_triton"].values():
        # The interpreter copies every argument to the host and back around the grid.
        assert {"aten.copy_", "aten.set_"} <= set(call["dispatched"])
        assert "aten.copy_" not in call["torch_ops"] and "aten.set_" not in call["torch_ops"]


def test_candidate_code_that_triton_calls_inside_a_launch_still_counts(recorded):
    for call in recorded["hooked"].values():
        assert torch_compute(call["torch_ops"]) == {"aten.mm": 1}
        assert "aten.copy_" not in call["torch_ops"]


def test_candidate_code_dressed_as_torch_or_triton_inside_a_launch_still_counts(recorded):
    # Outside the harness: the answer is right, and it is torch's (the kernel writes nothing).
    assert recorded["clothed_correct"] is True
    for call in recorded["clothed"].values():
        assert call["launches"] == 1 and "aten.rsqrt" in call["dispatched"]
        # Inside: its hook's frame is in torch.nn.functional's namespace, its code is no file's of torch.
        assert {"aten.pow", "aten.mean", "aten.rsqrt", "aten.mul"} <= set(torch_compute(call["torch_ops"]))
    for call in recorded["hooked_twice_as_triton"].values():
        assert torch_compute(call["torch_ops"]) == {"aten.mm": 2}


# --- which ops are torch compute, and the rule ------------------------------------------


@pytest.mark.parametrize("name", [
    "aten.empty", "aten.empty_like", "aten.new_empty", "aten.zeros", "aten.full",
    "aten.zero_", "aten.fill_", "aten.view", "aten._unsafe_view", "aten.as_strided",
    "aten.expand", "aten.permute", "aten.transpose", "aten.t", "aten.unsqueeze",
    "aten.squeeze", "aten.select", "aten.slice", "aten.detach", "aten.alias",
])
def test_allocation_fills_and_views_are_not_torch_compute(name):
    assert torch_compute({name: 3}) == {}


@pytest.mark.parametrize("name", [
    "aten.mm", "aten.bmm", "aten.addmm", "aten.mul", "aten.add", "aten.rsqrt", "aten.pow",
    "aten.mean", "aten.sum", "aten.topk", "aten.sort", "aten._to_copy", "aten.copy_",
    "aten.clone", "aten.arange", "aten._local_scalar_dense",
    # A custom op hides whatever it runs behind its own name.
    "mylib.rmsnorm",
])
def test_everything_that_reads_tensor_values_is_torch_compute(name):
    assert torch_compute({name: 2, "aten.view": 1}) == {name: 2}


def test_the_evidence_lists_the_most_run_ops_first():
    ops = Counter({"aten.topk": 1, "aten.mm": 2, "aten.add": 1})
    assert describe_ops(ops) == "aten.mm ×2, aten.add ×1, aten.topk ×1"
    assert describe_ops(ops, most=1) == "aten.mm ×2 and 2 more"


def test_torch_compute_an_op_does_not_declare_fails_and_names_what_it_allows():
    calls = [{"aten.mm": 2, "aten.topk": 1, "aten.empty": 1}, {"aten.empty": 1}]
    guard = _required_dsl("triton", STATIC_PASS, [1, 1], calls, frozenset({"aten.topk"}))
    assert guard.status == "fail"
    assert guard.detail == (
        "torch fallback: the call ran torch compute on the hot path (aten.mm ×2) beside its "
        "triton kernels, in 1 of 2 recorded calls; the op lets its DSL kernels keep only "
        "aten.topk in torch")


def test_calls_that_run_only_allocation_and_views_beside_their_kernels_pass():
    guard = _required_dsl("triton", STATIC_PASS, [2, 2], [{"aten.empty": 1, "aten.view": 2}] * 2)
    assert guard.status == "pass"
    assert guard.detail.endswith("(at least 2), and none ran torch compute beside them")


def test_a_call_with_no_launch_fails_whatever_torch_ran():
    guard = _required_dsl("triton", STATIC_PASS, [1, 0], [{}, {"aten.mm": 1}])
    assert guard.status == "fail" and "launched no triton kernel" in guard.detail


def test_where_no_torch_ops_were_recorded_the_guard_says_nothing_about_them():
    guard = _required_dsl("triton", STATIC_PASS, [1, 1])
    assert guard.status == "pass" and "torch" not in guard.detail.split(";", 1)[1]
