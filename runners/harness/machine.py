"""The state of the machine an evaluation ran on, reported with its result.

The same kernel on the same GPU model moves by tens of percent with the machine's
settings alone: clocks locked or boosting, the power limit, persistence mode, ECC, a
PCIe link trained below its width. A time means something only next to the state it
was measured in, and two times compare only when their states do; the review page
sets the candidate's beside the kept kernel's and names what differs.

On a GPU it is read through NVML (`nvidia-ml-py`, imported only here and only when
present: a GPU host may lack it, and then what torch knows is reported and the rest
is marked unknown). On a CPU: the model, the frequency governor and the cores.
"""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

# The fields that must match for two results to compare, in the order they are shown.
# Current clocks are shown but not compared: they move with the load of the moment.
COMPARED = ("gpu", "driver", "cuda", "sm_clock_max_mhz", "memory_clock_max_mhz",
            "sm_clock_locked", "power_limit_w", "pcie", "ecc", "persistence",
            "cpu", "governor", "cores", "torch")
LABELS = {
    "host": "host", "gpu": "GPU", "uuid": "GPU UUID", "driver": "driver", "cuda": "CUDA",
    "sm_clock_mhz": "SM clock (MHz)", "sm_clock_max_mhz": "SM clock max (MHz)",
    "sm_clock_locked": "SM clock locked", "memory_clock_mhz": "memory clock (MHz)",
    "memory_clock_max_mhz": "memory clock max (MHz)", "power_limit_w": "power limit (W)",
    "pcie": "PCIe link", "ecc": "ECC", "persistence": "persistence mode",
    "cpu": "CPU", "governor": "CPU governor", "cores": "cores", "torch": "torch",
    "nvml": "NVML",
}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def _cpu_model() -> str | None:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _cpu_state() -> dict[str, Any]:
    return {"cpu": _cpu_model(),
            "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
            "cores": os.cpu_count()}


def _nvml_state(index: int) -> dict[str, Any]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def ask(call, *args):
            try:
                return call(handle, *args)
            except pynvml.NVMLError:
                return None

        def text(value):
            return value.decode() if isinstance(value, bytes) else value

        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        sm_max = ask(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM)
        sm_locked = ask(pynvml.nvmlDeviceGetApplicationsClock, pynvml.NVML_CLOCK_SM)
        power = ask(pynvml.nvmlDeviceGetEnforcedPowerLimit)
        generation, width = (ask(pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                             ask(pynvml.nvmlDeviceGetCurrPcieLinkWidth))
        ecc = ask(pynvml.nvmlDeviceGetEccMode)
        persistence = ask(pynvml.nvmlDeviceGetPersistenceMode)
        return {
            "gpu": text(ask(pynvml.nvmlDeviceGetName)),
            "uuid": text(ask(pynvml.nvmlDeviceGetUUID)),
            "driver": text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "sm_clock_mhz": ask(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": sm_max,
            # Applications clocks below the maximum: a clock someone set, not a boost.
            "sm_clock_locked": None if sm_locked is None or sm_max is None else sm_locked < sm_max,
            "memory_clock_mhz": ask(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
            "memory_clock_max_mhz": ask(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_MEM),
            "power_limit_w": None if power is None else round(power / 1000),
            "pcie": None if generation is None else f"gen {generation} x{width}",
            "ecc": None if ecc is None else ("on" if ecc[0] else "off"),
            "persistence": None if persistence is None else ("on" if persistence else "off"),
            "nvml": "read",
        }
    finally:
        pynvml.nvmlShutdown()


def _torch_gpu_state(index: int) -> dict[str, Any]:
    import torch

    properties = torch.cuda.get_device_properties(index)
    return {"gpu": properties.name, "uuid": str(getattr(properties, "uuid", "")) or None,
            "cuda": torch.version.cuda, "nvml": "not installed: clocks, power and links unknown"}


def machine_state(device: str) -> dict[str, Any]:
    """What this machine is and how it is set, for `device` ("cpu" or "cuda")."""
    import torch

    state: dict[str, Any] = {"host": socket.gethostname(), "torch": torch.__version__}
    if str(device).startswith("cuda"):
        index = torch.cuda.current_device()
        try:
            state.update(_nvml_state(index))
        except ImportError:
            state.update(_torch_gpu_state(index))
        except Exception as error:  # noqa: BLE001 — NVML present but refusing: say so
            state.update(_torch_gpu_state(index))
            state["nvml"] = f"failed: {type(error).__name__}: {error}"
    state.update(_cpu_state())
    return state


def differences(one: dict[str, Any] | None, other: dict[str, Any] | None) -> list[str]:
    """The compared fields whose values differ, by label; a field either side lacks is
    not held against them (an older result that did not report it)."""
    if not one or not other:
        return []
    return [LABELS[key] for key in COMPARED
            if one.get(key) is not None and other.get(key) is not None and one[key] != other[key]]
