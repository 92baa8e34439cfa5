"""The first call at a new shape: which shapes are new, and the budget's arithmetic."""

from __future__ import annotations

from runners.harness.new_shapes import FirstCall, guard, neighbours, per_workload
from runners.ops import get_op


def test_each_declared_workload_gets_two_unseen_neighbours_of_the_same_kind():
    for name, contexts in (("rmsnorm", [64, 4096]), ("dsa_indexer_topk", [2048, 131072]),
                           ("dsa_indexer_topk_paged", [2048, 8192])):
        op = get_op(name)
        declared = op.workloads("cpu", contexts)
        pairs = neighbours(op, "cpu", declared, secret_seed=7)
        assert [old for old, _ in pairs] == [w for w in declared for _ in range(2)]
        names = {w.name for w in declared}
        for index in range(0, len(pairs), 2):
            assert pairs[index][1].name != pairs[index + 1][1].name
        low, high = op.context_length_range("cpu")
        for old, new in pairs:
            assert new.name not in names
            size = "tokens" if name == "rmsnorm" else "context_length"
            step = abs(new.params[size] - old.params[size])
            assert step % 2 == 1 and step <= max(3, old.params[size] // 16)
            assert low <= new.params.get("context_length", low) <= high
            kind = {k: v for k, v in old.params.items()
                    if k not in {"context_length", "tokens", *op.sized_params}}
            assert all(new.params[k] == v for k, v in kind.items())


def test_the_neighbours_come_from_the_secret_seed():
    op = get_op("dsa_indexer_topk")
    declared = op.workloads("cpu")
    first = [new.name for _, new in neighbours(op, "cpu", declared, secret_seed=1)]
    assert first == [new.name for _, new in neighbours(op, "cpu", declared, secret_seed=1)]
    assert first != [new.name for _, new in neighbours(op, "cpu", declared, secret_seed=2)]


def _call(candidate_ms: float, steady_ms: float = 1.0, baseline_ms: float = 3.0,
          baseline_steady_ms: float = 1.0, declared: str = "t=64", shape: str = "t=67") -> FirstCall:
    factor, floors = get_op("rmsnorm").first_call_budget
    allowed = max(factor * steady_ms, floors["cpu"]) + max(0.0, baseline_ms - baseline_steady_ms)
    return FirstCall(declared, shape, candidate_ms, baseline_ms, steady_ms, baseline_steady_ms, allowed)


def test_a_first_call_within_the_floor_and_the_baselines_own_cost_passes():
    op = get_op("rmsnorm")
    assert _call(51.0).allowed_ms == 52.0  # the CPU floor, 50 ms, plus the baseline's 2 ms
    result = guard(op, [_call(51.0), _call(2.0, declared="t=512", shape="t=515")])
    assert result.status == "pass" and "beside 2 workloads" in result.detail


def test_a_first_call_that_costs_a_compile_at_every_new_size_fails_with_its_numbers():
    op = get_op("rmsnorm")
    result = guard(op, [_call(2.0), _call(1210.0, steady_ms=0.18, declared="t=512", shape="t=515"),
                        _call(1190.0, steady_ms=0.18, declared="t=512", shape="t=509")])
    assert result.status == "fail"
    assert result.detail.startswith("first call at t=509: 1,190.0 ms, steady 0.18 ms at t=512")
    assert "1 of 2 workloads over budget" in result.detail


def test_a_compile_paid_once_whatever_the_size_is_not_a_cost_per_size():
    # Triton compiles a kernel once more at its first length not divisible by 16: the first
    # new size pays it, the second does not.
    once = [_call(400.0, shape="t=67"), _call(2.0, shape="t=61")]
    assert [call.shape for call in per_workload(once)] == ["t=61"]
    assert guard(get_op("rmsnorm"), once).status == "pass"


def test_a_slow_steady_call_earns_a_larger_budget_only_by_its_factor():
    assert _call(900.0, steady_ms=100.0).over_budget is False  # 10 × 100 ms
    assert _call(1100.0, steady_ms=100.0).over_budget is True
