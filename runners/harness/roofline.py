"""The roofline: the physical floor of a workload's time, and how close a time comes.

The floor is max(flops / peak compute, bytes / peak bandwidth) at the datasheet peaks
of skills/hardware/peaks.toml. Honest code never reaches a datasheet peak, so a time
below the floor is impossible: the candidate skipped work or fooled the timer.
Measured rates (`measured_*`) are what is attainable, not what is possible; they never
set the floor.
"""

from __future__ import annotations

import functools
import re
import tomllib
from pathlib import Path
from typing import Any

from runners.ops.base import Op, Workload

PEAKS_PATH = Path(__file__).resolve().parents[2] / "skills" / "hardware" / "peaks.toml"

# Device names as torch reports them -> peaks.toml keys. Whole-word matches, so a
# GH200 (different memory) is not taken for an H200. The H100 NVL is left unknown: its
# 3.9 TB/s is above the SXM table's 3.35, so that table's floor could reject real times.
_GPU_NAMES = (
    (re.compile(r"\bH100\b(?!.*\bNVL\b)"), "h100"),
    (re.compile(r"\bH200\b"), "h200"),
    (re.compile(r"\bB200\b"), "b200"),
)

# Workload dtype names -> the compute peaks that can serve them. float32 lists TF32 too:
# an fp32 op may run its products on tensor cores in TF32 and legitimately beat the
# plain FP32 rate, so its floor uses the faster of the two.
_PEAK_KEYS = {
    "bfloat16": ("bf16_tflops",),
    "float16": ("bf16_tflops",),
    "float8": ("fp8_tflops",),
    "float32": ("fp32_tflops", "tf32_tflops"),
}
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "fp8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
    "fp32": "float32", "float": "float32",
}


@functools.cache
def load_peaks() -> dict[str, dict[str, Any]]:
    with PEAKS_PATH.open("rb") as handle:
        return tomllib.load(handle)


def hardware_key(device: str) -> str | None:
    """The peaks.toml key of the machine `device` runs on; None when it has no table."""
    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(int(index) if index else None)
    for pattern, key in _GPU_NAMES:
        if pattern.search(name):
            return key
    return None


def compute_dtype(op: Op, workload: Workload) -> str | None:
    """The dtype the workload's arithmetic runs in, by canonical name.

    A workload may carry it (`params["dtype"]`, as rmsnorm's do); otherwise the op may
    declare it (`compute_dtype`, e.g. "bfloat16" for an indexer fed bfloat16 q and k).
    """
    declared = workload.params.get("dtype") or getattr(op, "compute_dtype", None)
    if declared is None:
        return None
    name = str(declared).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def _peak_tflops(peaks: dict[str, Any], dtype: str | None) -> float:
    # An undeclared or unlisted dtype gets the fastest rate the hardware has: the floor
    # then stays safe (it never rejects a real time), only less tight.
    keys = _PEAK_KEYS.get(dtype or "", ("bf16_tflops", "fp8_tflops", "fp32_tflops", "tf32_tflops"))
    return max(float(peaks[key]) for key in keys if key in peaks)


def floor_ms(op: Op, workload: Workload, hardware: str | None) -> float | None:
    """The shortest physically possible time of one call, in milliseconds."""
    if hardware is None:
        return None
    peaks = load_peaks().get(hardware)
    if peaks is None:
        return None
    compute_s = op.flops(workload) / (_peak_tflops(peaks, compute_dtype(op, workload)) * 1e12)
    memory_s = op.bytes(workload) / (float(peaks["hbm_gbps"]) * 1e9)
    return max(compute_s, memory_s) * 1e3


def achieved_fraction(
    op: Op, workload: Workload, hardware: str | None, time_ms: float
) -> float | None:
    """floor / time: the fraction of the roofline reached; above 1 means impossible.

    None where the hardware's peaks are not a roofline (`report_fraction = false`, the
    CPU's deliberately generous bounds) or unknown, and for a non-positive time.
    """
    if hardware is None or not load_peaks().get(hardware, {}).get("report_fraction", False):
        return None
    floor = floor_ms(op, workload, hardware)
    if floor is None or time_ms <= 0:
        return None
    return floor / time_ms
