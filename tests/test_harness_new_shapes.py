"""The first call at a new shape: which shapes are new, and the budget's arithmetic."""

from __future__ import annotations

from runners.harness.new_shapes import BATCH, LENGTH, TOKENS, FirstCall, guard, neighbours, per_axis, per_workload
from runners.ops import get_op


def test_each_declared_workload_gets_two_unseen_neighbours_of_the_same_kind_per_axis():
    for name, contexts in (("rmsnorm", [64, 4096]), ("dsa_indexer_topk", [2048, 131072]),
                           ("dsa_indexer_topk_paged", [2048, 8192])):
        op = get_op(name)
        declared = op.workloads("cpu", contexts)
        shapes = neighbours(op, "cpu", declared, secret_seed=7)
        axes = [TOKENS] if name == "rmsnorm" else [LENGTH, BATCH]  # rmsnorm's size is its tokens
        counts = {(w.name, axis): 0 for w in declared for axis in axes}
        for shape in shapes:
            counts[(shape.declared.name, shape.axis)] += 1
        # Two each, but where a bucket leaves room for one only (the paged op's batch of 8
        # in buckets of 4: 7 is the only other size in it).
        assert all(count == (1 if (name, axis) == ("dsa_indexer_topk_paged", BATCH) else 2)
                   for (_, axis), count in counts.items()), counts
        names = {w.name for w in declared}
        assert len({(s.declared.name, s.workload.name) for s in shapes}) == len(shapes)
        low, high = op.context_length_range("cpu")
        for shape in shapes:
            old, new = shape.declared.params, shape.workload.params
            assert shape.workload.name not in names
            moved = "batch" if shape.axis == BATCH else "tokens" if name == "rmsnorm" else "context_length"
            step = abs(new[moved] - old[moved])
            assert step % 2 == 1 and step <= max(3 if moved != "batch" else 1, old[moved] // (8 if moved == "batch" else 16))
            assert low <= new.get("context_length", low) <= high
            kind = {k: v for k, v in old.items()
                    if k not in {"context_length", "tokens", "batch", *op.sized_params}}
            assert all(new[k] == v for k, v in kind.items())
            assert all(new[k] == old[k] for k in ("context_length", "batch") if k in old and k != moved)


def test_inside_a_bucket_a_new_length_or_batch_is_new_values_in_the_same_shapes():
    """The paged op's shapes are its buckets', and new sizes are drawn inside the
    declared one's bucket: the declared workload's tensors, other lengths in them."""
    op = get_op("dsa_indexer_topk_paged")
    declared = op.workloads("cpu", [2048], [8])
    shapes_of = lambda w: {k: tuple(v.shape) for k, v in op.make_inputs(w, 1, "normal").items()  # noqa: E731
                           if hasattr(v, "shape")}
    for shape in neighbours(op, "cpu", declared, secret_seed=7):
        moved = shape.workload.params["context_length" if shape.axis == LENGTH else "batch"]
        was = shape.declared.params["context_length" if shape.axis == LENGTH else "batch"]
        same = shapes_of(shape.workload) == shapes_of(shape.declared)
        assert same, (shape.workload.name, shape.declared.name)  # both inside the bucket
        assert moved < was  # the declared sizes are at their buckets' tops
    for shape in neighbours(op, "cpu", op.workloads("cpu", [3001], [6]), secret_seed=7):
        assert shapes_of(shape.workload) == shapes_of(shape.declared)
        if shape.axis == LENGTH:
            assert 2048 < shape.workload.params["context_length"] <= 4096
        else:
            assert 5 <= shape.workload.params["batch"] <= 8


def test_the_neighbours_come_from_the_secret_seed():
    op = get_op("dsa_indexer_topk")
    declared = op.workloads("cpu")
    first = [s.workload.name for s in neighbours(op, "cpu", declared, secret_seed=1)]
    assert first == [s.workload.name for s in neighbours(op, "cpu", declared, secret_seed=1)]
    assert first != [s.workload.name for s in neighbours(op, "cpu", declared, secret_seed=2)]


def _call(candidate_ms: float, steady_ms: float = 1.0, baseline_ms: float = 3.0,
          baseline_steady_ms: float = 1.0, declared: str = "t=64", shape: str = "t=67",
          axis: str = TOKENS) -> FirstCall:
    factor, floors = get_op("rmsnorm").first_call_budget
    allowed = max(factor * steady_ms, floors["cpu"]) + max(0.0, baseline_ms - baseline_steady_ms)
    return FirstCall(declared, shape, axis, candidate_ms, baseline_ms, steady_ms, baseline_steady_ms, allowed)


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
    assert "and as much at another new token count" in result.detail
    assert "1 of 2 workloads over budget (by token count)" in result.detail


def test_a_compile_paid_once_whatever_the_size_is_not_a_cost_per_size():
    # Triton compiles a kernel once more at its first length not divisible by 16: the first
    # new size pays it, the second does not.
    once = [_call(400.0, shape="t=67"), _call(2.0, shape="t=61")]
    assert [call.shape for call in per_workload(once)] == ["t=61"]
    assert guard(get_op("rmsnorm"), once).status == "pass"


def test_a_slow_steady_call_earns_a_larger_budget_only_by_its_factor():
    assert _call(900.0, steady_ms=100.0).over_budget is False  # 10 × 100 ms
    assert _call(1100.0, steady_ms=100.0).over_budget is True


def test_each_axis_counts_its_own_cheaper_call_and_a_workload_reports_its_costlier_axis():
    # Cheap at a new length, a compile at both new batch sizes: it pays per batch size.
    calls = [_call(2.0, shape="ctx=2051,b=8", axis=LENGTH), _call(3.0, shape="ctx=2045,b=8", axis=LENGTH),
             _call(800.0, shape="ctx=2048,b=9", axis=BATCH), _call(790.0, shape="ctx=2048,b=7", axis=BATCH)]
    assert sorted(call.shape for call in per_axis(calls)) == ["ctx=2048,b=7", "ctx=2051,b=8"]
    assert [call.shape for call in per_workload(calls)] == ["ctx=2048,b=7"]
    result = guard(get_op("dsa_indexer_topk"), calls)
    assert result.status == "fail" and "(by batch size)" in result.detail
    assert "and as much at another new batch size" in result.detail
