"""The physical floor of a workload's time, and the fraction of it a time reaches."""

from __future__ import annotations

from pathlib import Path

import pytest

from runners.harness import roofline
from runners.harness.roofline import achieved_fraction, floor_ms, hardware_key, load_peaks
from runners.ops import Op, Workload, get_op

RMSNORM = get_op("rmsnorm")
DSA = get_op("dsa_indexer_topk")


def _workload(op, device, name):
    return next(w for w in op.workloads(device) if w.name == name)


class _Fixed(Op):
    """An op with chosen counts, to put a workload on either side of the ridge."""

    name = "fixed"

    def __init__(self, flops, bytes_, dtype=None):
        super().__init__(Path("."))
        self._flops, self._bytes = flops, bytes_
        if dtype:
            self.compute_dtype = dtype

    def flops(self, workload):
        return self._flops

    def bytes(self, workload):
        return self._bytes


ANY = Workload(name="any", device="cuda")


def test_a_bfloat16_rmsnorm_floor_is_its_bytes_over_h200_bandwidth():
    workload = _workload(RMSNORM, "cuda", "t=1024,dtype=bfloat16")
    # 4096 hidden: x read and y written in bf16 (2 B each), plus the weight once.
    bytes_ = (2 * 1024 * 4096 + 4096) * 2
    assert floor_ms(RMSNORM, workload, "h200") == pytest.approx(bytes_ / 4800e9 * 1e3)


def test_a_float32_rmsnorm_floor_uses_four_byte_elements_and_h100_bandwidth():
    workload = _workload(RMSNORM, "cuda", "t=65536,dtype=float32")
    bytes_ = (2 * 65536 * 4096 + 4096) * 4
    assert floor_ms(RMSNORM, workload, "h100") == pytest.approx(bytes_ / 3350e9 * 1e3)


def test_the_indexer_at_256k_context_is_compute_bound_at_the_bf16_peak(monkeypatch):
    # The indexer's matmuls run in bfloat16 (its q and k are bfloat16).
    monkeypatch.setattr(DSA, "compute_dtype", "bfloat16", raising=False)
    workload = _workload(DSA, "cuda", "ctx=262144,m=64")
    flops = 64 * 64 * 262144 * (2 * 128 + 3)
    bytes_ = 2 * 64 * 64 * 128 + 2 * 262144 * 128 + 4 * 64 * 64 + 8 * 64 * 2048
    assert flops / 989e12 > bytes_ / 4800e9
    assert floor_ms(DSA, workload, "h200") == pytest.approx(flops / 989e12 * 1e3)


def test_a_float32_op_may_reach_the_tf32_tensor_core_rate():
    op = _Fixed(flops=10**15, bytes_=1, dtype="float32")
    assert floor_ms(op, ANY, "h200") == pytest.approx(10**15 / 494e12 * 1e3)
    assert floor_ms(op, ANY, "b200") == pytest.approx(10**15 / 1100e12 * 1e3)


def test_fp8_uses_the_fp8_peak():
    op = _Fixed(flops=10**15, bytes_=1, dtype="fp8")
    assert floor_ms(op, ANY, "h100") == pytest.approx(10**15 / 1979e12 * 1e3)


def test_an_undeclared_dtype_gets_the_fastest_peak_so_the_floor_stays_safe():
    op = _Fixed(flops=10**15, bytes_=1)
    assert floor_ms(op, ANY, "h200") == pytest.approx(10**15 / 1979e12 * 1e3)


def test_the_cpu_floor_uses_its_generous_bounds():
    workload = _workload(RMSNORM, "cpu", "t=4096,dtype=float32")
    bytes_ = (2 * 4096 * 1024 + 1024) * 4
    assert floor_ms(RMSNORM, workload, "cpu") == pytest.approx(bytes_ / 400e9 * 1e3)


def test_measured_rates_never_set_the_floor(monkeypatch):
    workload = _workload(RMSNORM, "cuda", "t=1024,dtype=bfloat16")
    before = floor_ms(RMSNORM, workload, "h200")
    slow = {key: dict(table) for key, table in load_peaks().items()}
    slow["h200"].update(measured_bf16_tflops=1.0, measured_copy_gbps=1.0)
    monkeypatch.setattr(roofline, "load_peaks", lambda: slow)
    assert floor_ms(RMSNORM, workload, "h200") == before


def test_unknown_hardware_has_no_floor_and_no_fraction():
    workload = _workload(RMSNORM, "cuda", "t=1024,dtype=bfloat16")
    assert floor_ms(RMSNORM, workload, None) is None
    assert floor_ms(RMSNORM, workload, "mi300x") is None
    assert achieved_fraction(RMSNORM, workload, None, 1.0) is None


def test_a_time_below_the_floor_shows_as_a_fraction_above_one():
    workload = _workload(RMSNORM, "cuda", "t=65536,dtype=bfloat16")
    floor = floor_ms(RMSNORM, workload, "h200")
    assert achieved_fraction(RMSNORM, workload, "h200", floor * 2) == pytest.approx(0.5)
    impossible = floor / 3
    assert impossible < floor
    assert achieved_fraction(RMSNORM, workload, "h200", impossible) == pytest.approx(3.0)


def test_no_fraction_is_reported_on_the_cpu():
    workload = _workload(RMSNORM, "cpu", "t=64,dtype=float32")
    assert floor_ms(RMSNORM, workload, "cpu") > 0
    assert achieved_fraction(RMSNORM, workload, "cpu", 1.0) is None


def test_every_peaks_table_has_the_same_keys_and_sane_values():
    peaks = load_peaks()
    assert set(peaks) == {"cpu", "h100", "h200", "b200"}
    keys = set(peaks["cpu"])
    assert {"bf16_tflops", "fp32_tflops", "tf32_tflops", "fp8_tflops", "hbm_gbps",
            "measured_bf16_tflops", "measured_copy_gbps", "report_fraction"} <= keys
    for name, table in peaks.items():
        assert set(table) == keys, name
        for key in ("bf16_tflops", "fp32_tflops", "tf32_tflops", "fp8_tflops", "hbm_gbps"):
            assert table[key] > 0, (name, key)
        # A measured rate is attainable, so never above the datasheet ceiling.
        assert table["measured_bf16_tflops"] <= table["bf16_tflops"], name
        assert table["measured_copy_gbps"] <= table["hbm_gbps"], name
    assert peaks["cpu"]["report_fraction"] is False
    assert all(peaks[gpu]["report_fraction"] for gpu in ("h100", "h200", "b200"))


@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA B200", "b200"),
    # Faster memory than the H100 SXM table: its floor could reject honest times.
    ("NVIDIA H100 NVL", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-80GB", None),
])
def test_cuda_device_names_map_to_peaks_tables(monkeypatch, name, key):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert hardware_key("cuda") == key
    assert hardware_key("cuda:0") == key


def test_the_cpu_is_its_own_hardware_key():
    assert hardware_key("cpu") == "cpu"
