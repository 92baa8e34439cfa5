from __future__ import annotations

import json

import pytest
import torch

from runners.harness.roofline import floor_ms
from runners.ops import (
    DISTRIBUTIONS,
    MAX_WORKLOADS,
    Op,
    UnknownOpError,
    WorkloadError,
    get_op,
    list_ops,
)
from runners.ops.base import sample
from runners.ops.dsa_indexer_topk_fp8 import FP8, dequantize_rows, quantize_rows
from runners.space import grid_points, read_literals


ALL_OPS = ["allreduce_sum", "rmsnorm", "dsa_indexer_topk", "dsa_indexer_topk_fp8", "dsa_indexer_topk_paged",
           "dsa_indexer_topk_paged_fp8"]


def test_it_lists_the_shipped_ops_sorted():
    assert list_ops() == ["allreduce_sum", "dsa_indexer_topk", "dsa_indexer_topk_fp8", "dsa_indexer_topk_paged",
                          "dsa_indexer_topk_paged_fp8", "rmsnorm"]


def test_an_unknown_op_is_a_value_error_naming_the_known_ones():
    with pytest.raises(UnknownOpError) as raised:
        get_op("foo")
    assert isinstance(raised.value, ValueError)
    assert str(raised.value) == ("unknown op 'foo' (known: allreduce_sum, dsa_indexer_topk, dsa_indexer_topk_fp8, "
                                 "dsa_indexer_topk_paged, dsa_indexer_topk_paged_fp8, rmsnorm)")


@pytest.mark.parametrize("name", ALL_OPS)
def test_each_op_declares_itself_and_ships_a_baseline_and_a_tunable_kernel(name):
    op = get_op(name)
    assert isinstance(op, Op) and op.name == name
    assert op.title and op.description and op.signature.startswith("forward(")
    assert op.baseline_path.is_file()
    assert op.baseline_path == op.folder / "baseline.py"
    assert op.kernels()
    for path in op.kernels().values():
        params, space = read_literals(path.read_text())
        # Something to sweep, and few enough points that CI checks every one of them.
        assert 2 <= len(grid_points(space)) <= 30
        assert all(value in space[key] for key, value in params.items())


def test_rmsnorm_workloads_cover_both_dtypes_and_a_wide_range_of_tokens():
    op = get_op("rmsnorm")
    names = [workload.name for workload in op.workloads("cpu")]
    assert names == [
        "t=64,dtype=float32", "t=64,dtype=bfloat16",
        "t=512,dtype=float32", "t=512,dtype=bfloat16",
        "t=4096,dtype=float32", "t=4096,dtype=bfloat16",
    ]
    cuda = op.workloads("cuda")
    assert max(workload.params["tokens"] for workload in cuda) == 65536
    assert {workload.params["hidden"] for workload in cuda} == {4096}


def test_rmsnorm_tokens_are_context_length_times_batch_size():
    workloads = get_op("rmsnorm").workloads("cpu", [128], [2])
    assert [workload.name for workload in workloads] == ["t=256,dtype=float32", "t=256,dtype=bfloat16"]


@pytest.mark.parametrize("name", ["dsa_indexer_topk", "dsa_indexer_topk_fp8"])
def test_dsa_workloads_name_context_and_batch_and_match_deepseek_on_cuda(name):
    op = get_op(name)
    assert [w.name for w in op.workloads("cpu")] == ["ctx=2048,m=4", "ctx=8192,m=4", "ctx=32768,m=4"]
    cuda = op.workloads("cuda")
    assert cuda[-1].name == "ctx=262144,m=64"
    assert {(w.params["heads"], w.params["head_dim"], w.params["topk"]) for w in cuda} == {(64, 128, 2048)}


def test_a_workload_serialises_to_json():
    workload = get_op("dsa_indexer_topk").workloads("cpu", [4096], [2])[0]
    assert json.loads(json.dumps(workload.to_dict())) == {
        "name": "ctx=4096,m=2",
        "device": "cpu",
        "params": {"context_length": 4096, "batch": 2, "heads": 16, "head_dim": 64, "topk": 256},
    }


@pytest.mark.parametrize(
    ("op_name", "contexts", "batches", "message"),
    [
        ("rmsnorm", [], None, "no context lengths given"),
        ("rmsnorm", None, [], "no batch sizes given"),
        ("rmsnorm", [0], None, "context length 0 must be positive"),
        ("rmsnorm", [-64], None, "must be positive"),
        ("rmsnorm", [10**9], None, "above rmsnorm's maximum of 16,384 on cpu"),
        ("rmsnorm", [64], [1000], "batch size 1,000 is above"),
        ("rmsnorm", [1.5], None, "not a whole number"),
        ("dsa_indexer_topk", [100], None, "below dsa_indexer_topk's minimum of 256"),
        ("dsa_indexer_topk_fp8", [100], None, "below dsa_indexer_topk_fp8's minimum of 256"),
        ("rmsnorm", list(range(1, 40)), None, f"at most {MAX_WORKLOADS} per evaluation"),
    ],
)
def test_it_refuses_workloads_outside_the_declared_range(op_name, contexts, batches, message):
    with pytest.raises(WorkloadError, match=message):
        get_op(op_name).workloads("cpu", contexts, batches)


def test_an_unknown_device_is_a_workload_error():
    with pytest.raises(WorkloadError, match="unknown device 'tpu'"):
        get_op("rmsnorm").workloads("tpu")


@pytest.mark.parametrize("name", ALL_OPS)
def test_inputs_depend_only_on_seed_and_distribution(name):
    op = get_op(name)
    workload = op.workloads("cpu")[0]
    first = op.make_inputs(workload, 11, "normal")
    again = op.make_inputs(workload, 11, "normal")
    other_seed = op.make_inputs(workload, 12, "normal")
    other_distribution = op.make_inputs(workload, 11, "uniform_outliers")
    key = next(iter(first))
    assert torch.equal(first[key], again[key])
    assert not torch.equal(first[key], other_seed[key])
    assert not torch.equal(first[key], other_distribution[key])
    assert len(DISTRIBUTIONS) >= 2


def test_an_unknown_distribution_is_refused():
    op = get_op("rmsnorm")
    with pytest.raises(ValueError, match="unknown distribution 'cauchy'"):
        op.make_inputs(op.workloads("cpu")[0], 1, "cauchy")


def test_tolerances_belong_to_the_op_and_are_tight_for_float32():
    op = get_op("rmsnorm")
    assert op.tolerance(torch.float32) == (1e-5, 1e-5)
    assert op.tolerance(torch.bfloat16) == (1e-2, 1e-2)
    with pytest.raises(ValueError, match="no tolerance"):
        op.tolerance(torch.float64)


@pytest.mark.parametrize("name", ALL_OPS)
def test_flop_and_byte_counts_are_positive_and_grow_with_the_workload(name):
    op = get_op(name)
    small, large = op.workloads("cuda")[0], op.workloads("cuda")[-1]
    assert 0 < op.flops(small) < op.flops(large)
    assert 0 < op.bytes(small) < op.bytes(large)


def test_rmsnorm_flops_and_bytes_follow_the_formula():
    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [64])[1]  # bfloat16
    assert op.flops(workload) == 4 * 64 * 1024
    assert op.bytes(workload) == (2 * 64 * 1024 + 1024) * 2


# The dsa check, fed hand-made outputs.

@pytest.fixture
def dsa_case():
    op = get_op("dsa_indexer_topk")
    inputs = op.make_inputs(op.workloads("cpu", [2048])[0], 3, "normal")
    scores = op.reference(inputs)
    right = scores.topk(inputs["topk"], dim=1).indices
    return op, inputs, scores, right


def test_dsa_check_accepts_the_true_top_k_in_any_order(dsa_case):
    op, inputs, scores, right = dsa_case
    shuffled = right[:, torch.randperm(right.shape[1])]
    assert op.check(shuffled, scores, inputs)[0]


def test_dsa_check_rejects_duplicate_indices(dsa_case):
    op, inputs, scores, right = dsa_case
    doubled = right.clone()
    doubled[1, -1] = doubled[1, 0]
    ok, detail = op.check(doubled, scores, inputs)
    assert not ok and "duplicate" in detail and "row 1" in detail


def test_dsa_check_rejects_indices_out_of_range(dsa_case):
    op, inputs, scores, right = dsa_case
    outside = right.clone()
    outside[2, 5] = 2048
    ok, detail = op.check(outside, scores, inputs)
    assert not ok and "outside [0, 2048)" in detail and "row 2" in detail


def test_dsa_check_rejects_the_wrong_dtype_and_shape(dsa_case):
    op, inputs, scores, right = dsa_case
    ok, detail = op.check(right.int(), scores, inputs)
    assert not ok and "expected torch.int64" in detail
    ok, detail = op.check(right[:, :-1], scores, inputs)
    assert not ok and "expected [4, 256]" in detail


def test_dsa_check_rejects_a_selection_that_misses_top_scores(dsa_case):
    op, inputs, scores, right = dsa_case
    worse = scores.topk(inputs["topk"] + 50, dim=1).indices[:, 50:]
    ok, detail = op.check(worse, scores, inputs)
    assert not ok and "fall short of the true top-256" in detail


# The FP8 indexer: inputs quantized as DeepSeek quantizes them, the bf16 op's check.

@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_fp8_quantization_round_trips_within_e4m3_precision(distribution):
    values = sample((8, 16, 64), generator=torch.Generator().manual_seed(5),
                    distribution=distribution, dtype=torch.float32)
    values[0, 0] = 0.0  # an all-zero row must not divide by zero
    fp8, scale = quantize_rows(values)
    assert fp8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (8, 16)
    back = dequantize_rows(fp8, scale)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, and 2^-10 of the
    # scale among the subnormals a row's outlier pushes small values into.
    bound = 2**-4 * values.abs() * (1 + 1e-6) + 2**-10 * scale.unsqueeze(-1)
    assert bool(((back - values).abs() <= bound).all())
    # Each row's absmax lands on e4m3's largest value: no range is wasted, none clipped.
    assert torch.equal(fp8[1:].float().abs().amax(dim=-1), torch.full((7, 16), 448.0))
    assert torch.equal(fp8[0, 0].float(), torch.zeros(64))


def test_fp8_inputs_are_deepseeks_layout_and_score_like_the_unquantized_values():
    op, bf16 = get_op("dsa_indexer_topk_fp8"), get_op("dsa_indexer_topk")
    workload = op.workloads("cpu", [2048])[0]
    inputs = op.make_inputs(workload, 3, "uniform_outliers")
    assert list(inputs) == ["q", "k", "k_scale", "weights", "topk"]  # forward's order
    assert (inputs["q"].dtype, inputs["q"].shape) == (FP8, (4, 16, 64))
    assert (inputs["k"].dtype, inputs["k"].shape) == (FP8, (2048, 64))
    assert (inputs["k_scale"].dtype, inputs["k_scale"].shape) == (torch.float32, (2048,))
    assert (inputs["weights"].dtype, inputs["weights"].shape) == (torch.float32, (4, 16))
    # The same draws unquantized, with DeepSeek's softmax scale folded into the weights
    # as it is in the FP8 weights: scores move by a few percent of the row's largest,
    # where a lost q or k scale would move them by orders of magnitude.
    values = op.sample_inputs(workload, 3, "uniform_outliers", torch.float32)
    exact = bf16.reference({**values, "weights": values["weights"] * 64**-0.5})
    gap = (op.reference(inputs) - exact).abs() / exact.abs().amax(dim=1, keepdim=True)
    assert float(gap.max()) < 0.1


def test_fp8_tolerance_is_declared_for_e4m3_only():
    op = get_op("dsa_indexer_topk_fp8")
    assert op.tolerance(FP8) == (1e-2, 1e-2)
    with pytest.raises(ValueError, match="no tolerance"):
        op.tolerance(torch.bfloat16)


@pytest.fixture
def fp8_case():
    op = get_op("dsa_indexer_topk_fp8")
    inputs = op.make_inputs(op.workloads("cpu", [2048])[0], 3, "normal")
    scores = op.reference(inputs)
    return op, inputs, scores


def test_fp8_check_accepts_the_true_top_k_in_any_order(fp8_case):
    op, inputs, scores = fp8_case
    right = scores.topk(inputs["topk"], dim=1).indices
    ok, detail = op.check(right[:, torch.randperm(right.shape[1])], scores, inputs)
    assert ok, detail


def test_fp8_check_rejects_a_selection_that_ignores_the_key_scales(fp8_case):
    op, inputs, scores = fp8_case
    unscaled = op.reference({**inputs, "k_scale": torch.ones_like(inputs["k_scale"])})
    wrong = unscaled.topk(inputs["topk"], dim=1).indices
    ok, detail = op.check(wrong, scores, inputs)
    assert not ok and "fall short of the true top-256" in detail


def test_fp8_counts_one_byte_elements_and_its_floor_uses_the_fp8_peak():
    op = get_op("dsa_indexer_topk_fp8")
    workload = op.workloads("cuda")[-1]
    m, heads, dim, n, topk = 64, 64, 128, 262144, 2048
    assert workload.name == f"ctx={n},m={m}"
    assert op.bytes(workload) == m * heads * dim + n * (dim + 4) + 4 * m * heads + 8 * m * topk
    flops = m * heads * n * (2 * dim + 4)
    assert op.flops(workload) == flops
    assert floor_ms(op, workload, "h200") == pytest.approx(flops / 1979e12 * 1e3)


def test_rmsnorm_check_rejects_nan_and_a_lowered_precision():
    op = get_op("rmsnorm")
    inputs = op.make_inputs(op.workloads("cpu", [64])[0], 3, "normal")
    expected = op.reference(inputs)
    good = expected.float()
    assert op.check(good, expected, inputs)[0]
    poisoned = good.clone()
    poisoned[3, 7] = float("nan")
    ok, detail = op.check(poisoned, expected, inputs)
    assert not ok and "1 of 65,536 output values are NaN or inf" in detail
    ok, detail = op.check(good.bfloat16(), expected, inputs)
    assert not ok and "output dtype is torch.bfloat16, expected torch.float32" in detail
