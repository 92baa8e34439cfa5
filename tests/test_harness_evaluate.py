"""Verdicts of whole evaluations: A/A is never a win, real effects are, and what a
candidate does wrong is told by the guard that caught it.

The planted-bug corpus (test_harness_corpus.py) covers the wrong and hostile
candidates one by one; these are the verdict rules and the evaluation's own behaviour.
"""

from __future__ import annotations

import importlib
import textwrap

import pytest
import torch

from runners.harness import Limits, UsageError, evaluate, roofline
from runners.harness.stats import MIN_NOISE_FLOOR
from runners.ops import get_op

LIMITS = Limits(import_s=3, call_s=3, memory_bytes=512 * 2**20)

RMSNORM = """
import torch

def reference(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
"""


def _evaluate(tmp_path, body: str, op: str = "rmsnorm", **options):
    path = tmp_path / "candidate.py"
    prelude = RMSNORM if op == "rmsnorm" else "import torch\n"
    path.write_text(prelude + textwrap.dedent(body))
    options.setdefault("context_lengths", [64] if op == "rmsnorm" else [2048])
    options.setdefault("time_budget_s", 0.05)
    options.setdefault("limits", LIMITS)
    return evaluate(op, path, **options)


def _failing(result):
    return {guard.name: guard.detail for guard in result.guards if guard.status == "fail"}


def test_it_rejects_a_file_that_is_not_python(tmp_path):
    path = tmp_path / "candidate.py"
    path.write_text("def forward(x, weight, eps)\n    return x\n")
    result = evaluate("rmsnorm", path, context_lengths=[64], limits=LIMITS)
    assert result.verdict == "rejected" and result.correct is False
    assert _failing(result) == {"loads": "candidate.py is not valid Python: expected ':' (line 1)"}
    assert result.error == "candidate.py is not valid Python: expected ':' (line 1)"
    assert result.params is None
    assert all(workload.baseline_ms is None for workload in result.workloads)


def test_it_rejects_a_file_without_forward(tmp_path):
    result = _evaluate(tmp_path, "def fwd(x, weight, eps):\n    return x\n")
    assert _failing(result) == {"loads": "candidate.py defines no forward() function"}


def test_it_rejects_a_candidate_whose_import_fails(tmp_path):
    result = _evaluate(tmp_path, "import triton_that_does_not_exist\n")
    assert _failing(result)["loads"].startswith(
        "importing candidate.py raised ModuleNotFoundError: No module named 'triton_that_does_not_exist'")


def test_a_candidate_that_breaks_once_it_is_timed_is_rejected_by_the_timed_calls(tmp_path):
    result = _evaluate(tmp_path, """
        seen = []

        def forward(x, weight, eps):
            # Being timed: back at an earlier workload, which only a timing process does.
            if (x.shape, x.dtype) in seen[:-1]:
                raise RuntimeError("only while being checked")
            if not seen or seen[-1] != (x.shape, x.dtype):
                seen.append((x.shape, x.dtype))
            return reference(x, weight, eps)
    """)
    assert result.correct is True
    assert result.verdict == "rejected"
    failing = _failing(result)
    assert list(failing) == ["timed-calls"]
    assert failing["timed-calls"] == (
        "forward raised RuntimeError: only while being checked (a timed call of t=64,dtype=float32)")


def test_running_out_of_memory_once_timed_is_a_resources_failure(tmp_path):
    result = _evaluate(tmp_path, """
        seen = []

        def forward(x, weight, eps):
            # Being timed: back at an earlier workload, which only a timing process does.
            if (x.shape, x.dtype) in seen[:-1]:
                raise MemoryError("no more")
            if not seen or seen[-1] != (x.shape, x.dtype):
                seen.append((x.shape, x.dtype))
            return reference(x, weight, eps)
    """)
    failing = _failing(result)
    assert list(failing) == ["resources"]
    assert failing["resources"] == (
        "ran out of memory: MemoryError: no more (a timed call of t=64,dtype=float32)")


@pytest.mark.parametrize("op_name", ["rmsnorm", "rmsnorm", "dsa_indexer_topk"])
def test_the_baseline_against_itself_is_correct_and_no_gain(op_name):
    contexts = [64] if op_name == "rmsnorm" else [2048]
    result = evaluate(op_name, "baseline", context_lengths=contexts, time_budget_s=0.1,
                      limits=LIMITS)
    assert result.correct is True
    assert result.verdict == "no-gain", [(w.name, w.speedup, w.noise_floor) for w in result.workloads]
    assert result.candidate == "baseline"
    for workload in result.workloads:
        assert workload.samples >= 10
        assert workload.speedup_ci[0] <= workload.speedup <= workload.speedup_ci[1]
        assert workload.noise_floor >= MIN_NOISE_FLOOR["cpu"]
        assert workload.aa_speedup > 0


def test_a_significantly_slower_candidate_is_no_gain(tmp_path):
    result = _evaluate(tmp_path, """
        import time

        def forward(x, weight, eps):
            time.sleep(0.003)
            return reference(x, weight, eps)
    """)
    assert result.verdict == "no-gain"
    assert all(w.significant and w.speedup < 1 for w in result.workloads), result.workloads


def test_a_significantly_faster_candidate_is_a_win(tmp_path, monkeypatch):
    # Speed depends on the machine; a baseline slowed on purpose does not.
    shipped = get_op("rmsnorm").baseline_path
    slow = tmp_path / "slow_baseline.py"
    slow.write_text(RMSNORM + textwrap.dedent("""
        import time

        def forward(x, weight, eps):
            time.sleep(0.003)
            return reference(x, weight, eps)
    """))
    monkeypatch.setattr(type(get_op("rmsnorm")), "baseline_path", property(lambda op: slow))
    result = evaluate("rmsnorm", shipped, context_lengths=[64], time_budget_s=0.05, limits=LIMITS)
    assert result.verdict == "win", [guard for guard in result.guards if guard.status != "pass"]
    assert all(w.significant and w.speedup_ci[0] > 1 for w in result.workloads)
    assert all(w.speedup > 1 + w.noise_floor for w in result.workloads)
    assert result.dispatch["covers_all"] and result.dispatch["axis"] == "tokens"


def test_a_candidate_that_wins_small_sizes_only_gets_a_dispatch_range_for_them(tmp_path, monkeypatch):
    # The kept kernel is slow on small inputs, the candidate on large ones (10 ms: many
    # times what rmsnorm takes at 512 tokens, even on a loaded machine).
    slow_small, slow_large = tmp_path / "slow_small.py", tmp_path / "slow_large.py"
    for path, condition in ((slow_small, "x.shape[0] <= 64"), (slow_large, "x.shape[0] > 64")):
        path.write_text(RMSNORM + textwrap.dedent(f"""
            import time

            def forward(x, weight, eps):
                if {condition}:
                    time.sleep(0.01)
                return reference(x, weight, eps)
        """))
    monkeypatch.setattr(type(get_op("rmsnorm")), "baseline_path", property(lambda op: slow_small))
    result = evaluate("rmsnorm", slow_large, context_lengths=[64, 512], time_budget_s=0.05, limits=LIMITS)
    assert result.verdict == "win"
    assert (result.dispatch["min"], result.dispatch["max"]) == (64, 64)
    assert result.dispatch["summary"].startswith("candidate for tokens 64, kept kernel beyond 64; "
                                                 "a new size's first call up to ")
    # What a size inside the range that no process had seen cost: the workload's own figure.
    inside = result.workloads[0] if result.workloads[0].name.startswith("t=64") else result.workloads[1]
    assert result.dispatch["new_size_first_call_ms"] >= inside.first_call_ms > 0


def test_a_paged_win_says_the_shape_buckets_it_was_called_through(tmp_path, monkeypatch):
    op = get_op("dsa_indexer_topk_paged")
    honest = op.baseline_path
    slow = tmp_path / "slow.py"  # the kept kernel, 20 ms slower a call
    slow.write_text(honest.read_text() + textwrap.dedent("""
        import time

        _fast = forward


        def forward(*args):
            time.sleep(0.02)
            return _fast(*args)
    """))
    monkeypatch.setattr(type(op), "baseline_path", property(lambda op: slow))
    result = evaluate("dsa_indexer_topk_paged", honest, context_lengths=[2048], time_budget_s=0.1,
                      limits=Limits(import_s=20, call_s=20, memory_bytes=1024 * 2**20))
    assert result.verdict == "win", [guard for guard in result.guards if guard.status != "pass"]
    assert result.dispatch["shape_buckets"] == {"context_length": 2048, "batch": 4}
    assert result.dispatch["summary"].endswith("called through shape buckets of 2,048 tokens and 4 sequences")


def test_params_seed_and_threads_are_reported_and_the_judge_keeps_its_threads():
    chunked = get_op("dsa_indexer_topk").kernels()["chunked_topk"]
    before = torch.get_num_threads()
    result = evaluate("dsa_indexer_topk", chunked, context_lengths=[2048], time_budget_s=0.02,
                      seed=1234, limits=LIMITS)
    assert result.verdict != "rejected", result.guards
    # Read from the file's literal, never by running it in the judge.
    assert result.params == {"chunk": 4096, "merge": "running", "heads": "fused"}
    assert result.seed == 1234
    assert result.threads >= 1
    assert result.timing_meaningful is True
    assert torch.get_num_threads() == before


def test_a_time_below_the_physical_floor_is_rejected_as_impossible(monkeypatch):
    # No honest CPU call beats its (generous) floor; a floor of a second is one to beat.
    monkeypatch.setattr(roofline, "floor_ms", lambda op, workload, hardware: 1000.0)
    result = evaluate("rmsnorm", "baseline", context_lengths=[64], time_budget_s=0.02, limits=LIMITS)
    assert result.correct is True and result.verdict == "rejected"
    detail = _failing(result)["roofline"]
    assert detail.startswith("impossible: t=64,dtype=float32: ")
    assert detail.endswith("ms is below the physical floor of 1000 ms")


def test_a_missing_candidate_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="candidate file not found"):
        evaluate("rmsnorm", tmp_path / "nope.py")


def test_an_unknown_dsl_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown DSL 'numba'"):
        evaluate("rmsnorm", "baseline", dsl="numba")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_cuda_is_an_error_not_a_silent_cpu_run():
    with pytest.raises(UsageError, match="CUDA is not available"):
        evaluate("rmsnorm", "baseline", device="cuda")


# --- the cascade: cheap checks first, every later stage skipped once a guard failed ---


class _CountedChildren:
    """Counts the child processes an evaluation starts, by role."""

    def __init__(self, monkeypatch):
        evaluation = importlib.import_module("runners.harness.evaluate")
        self.roles = []
        real = evaluation.Child

        def counted(**options):
            self.roles.append(options["role"])
            return real(**options)

        monkeypatch.setattr(evaluation, "Child", counted)


def test_a_candidate_its_source_rejects_is_stopped_before_any_process_starts(tmp_path, monkeypatch):
    started = _CountedChildren(monkeypatch)
    result = _evaluate(tmp_path, """
        from runners.ops import get_op

        type(get_op("rmsnorm")).tolerances[torch.float32] = (1e-2, 1e-2)

        def forward(x, weight, eps):
            return reference(x, weight, eps)
    """)
    assert started.roles == []
    assert result.verdict == "rejected" and result.stopped_at == "static"
    assert list(_failing(result)) == ["protected-settings"]
    assert result.error == _failing(result)["protected-settings"]
    assert "changes a tolerance" in result.error
    assert all(workload.baseline_ms is None for workload in result.workloads)


def test_a_candidate_wrong_at_its_first_call_is_stopped_there(tmp_path, monkeypatch):
    started = _CountedChildren(monkeypatch)
    result = _evaluate(tmp_path, """
        def forward(x, weight, eps):
            return reference(x, weight, eps) * 1.5
    """, context_lengths=[64, 512])
    assert started.roles == ["candidate"]  # no timing process was started
    assert result.verdict == "rejected" and result.stopped_at == "first-check"
    assert list(_failing(result)) == ["correctness"]
    assert "t=64,dtype=float32, normal inputs, seed #1" in result.error
    assert all(workload.baseline_ms is None for workload in result.workloads)


def test_a_candidate_wrong_later_in_the_matrix_is_stopped_at_correctness(tmp_path, monkeypatch):
    started = _CountedChildren(monkeypatch)
    result = _evaluate(tmp_path, """
        def forward(x, weight, eps):
            out = reference(x, weight, eps)
            return out * 1.5 if x.shape[0] == 512 else out
    """, context_lengths=[64, 512])
    assert result.verdict == "rejected" and result.stopped_at == "correctness"
    assert list(_failing(result)) == ["correctness"] and "t=512" in result.error
    # The timing processes started once the first call passed, and were ended unused.
    assert started.roles == ["candidate", "baseline", "candidate", "control"]
    assert all(workload.baseline_ms is None for workload in result.workloads)


def test_a_candidate_that_passes_every_stage_says_it_was_stopped_nowhere():
    result = evaluate("rmsnorm", "baseline", context_lengths=[64], time_budget_s=0.05, limits=LIMITS)
    assert result.verdict == "no-gain" and result.stopped_at is None
    assert result.to_dict()["stopped_at"] is None
