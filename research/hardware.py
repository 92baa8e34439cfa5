"""Hardware classes a thesis can target, and the Celery queue that serves each.

A GPU host runs `celery -A config worker -Q <queue>` for its class; the CPU queue is
served by the worker the quick start launches.
"""

from __future__ import annotations

from typing import NamedTuple


class Hardware(NamedTuple):
    label: str
    device: str  # what the harness calls it: "cpu" or "cuda"
    queue: str


HARDWARE: dict[str, Hardware] = {
    "cpu": Hardware("CPU (this machine)", "cpu", "runner.cpu"),
    "h100": Hardware("NVIDIA H100 (sm_90)", "cuda", "runner.sm90"),
    "h200": Hardware("NVIDIA H200 (sm_90)", "cuda", "runner.sm90"),
    "b200": Hardware("NVIDIA B200 (sm_100)", "cuda", "runner.sm100"),
}

HARDWARE_CHOICES = [(key, hw.label) for key, hw in HARDWARE.items()]


def gpu_class(gpu_name: str) -> str | None:
    """The GPU class a card's name belongs to ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    squeezed = gpu_name.lower().replace(" ", "")
    found = [key for key, hw in HARDWARE.items() if hw.device == "cuda" and key in squeezed]
    return found[0] if len(found) == 1 else None

MODEL_CONTEXTS = [
    ("none", "No model context"),
    ("deepseek-v3.2", "DeepSeek-V3.2 (sparse attention, MLA, MoE)"),
    ("deepseek-v4-flash", "DeepSeek-V4-Flash (third-party facts)"),
]

KERNEL_DSLS = [
    ("torch", "torch"),
    ("triton", "Triton"),
    ("cute", "CuTe DSL"),
]
