"""The configuration a measurement depends on, taken before the candidate is imported
and compared after every call: any difference is a change the candidate made.

Covers the settings reward hacks flip to look faster or "correct" (reward-hacks.md):
environment variables (CUDA-graph, all-reduce and launch switches live there), torch's
backend flags (TF32, reduced-precision reductions, cuDNN, deterministic algorithms),
thread counts, the denormal mode, the CUDA-graph settings of an already imported
compiler, the process's limits, and what the op declares in this process (workloads,
batch sizes, tolerances, dtypes, and the constants of the harness's own modules). The
judge holds its own copy of the op, so a relaxed tolerance here changes no verdict by
itself; it is still a change, and it is reported as one.

Runs in the child. Values are kept as short strings so that a change reads directly:
"torch.backends.cuda.matmul.allow_tf32: False → True".
"""

from __future__ import annotations

import gc
import hashlib
import os
import resource
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from runners.harness import timing
from runners.ops import Op

_SHOWN_VALUE = 60

# Simple values whose repr is their content: what a module's constants hold.
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype)
_CONTAINERS = (tuple, list, dict, set, frozenset)


def _torch_flags() -> dict[str, Callable[[], Any]]:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return {
        "torch.backends.cuda.matmul.allow_tf32": lambda: matmul.allow_tf32,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            lambda: matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            lambda: matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cudnn.enabled": lambda: cudnn.enabled,
        "torch.backends.cudnn.benchmark": lambda: cudnn.benchmark,
        "torch.backends.cudnn.deterministic": lambda: cudnn.deterministic,
        "torch.backends.cudnn.allow_tf32": lambda: cudnn.allow_tf32,
        "torch.backends.mkldnn.enabled": lambda: torch.backends.mkldnn.enabled,
        "torch.backends.cuda.flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled,
        "torch.backends.cuda.mem_efficient_sdp_enabled": torch.backends.cuda.mem_efficient_sdp_enabled,
        "torch.backends.cuda.math_sdp_enabled": torch.backends.cuda.math_sdp_enabled,
        "torch.get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "torch.are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled,
        "torch.is_deterministic_algorithms_warn_only_enabled":
            torch.is_deterministic_algorithms_warn_only_enabled,
        "torch.get_default_dtype": torch.get_default_dtype,
        "torch.is_grad_enabled": torch.is_grad_enabled,
        "torch.get_num_threads": torch.get_num_threads,
        "torch.get_num_interop_threads": torch.get_num_interop_threads,
        "denormals flushed to zero": _denormals_flushed,
    }


def _denormals_flushed() -> bool:
    """torch.set_flush_denormal has no getter: a subnormal survives a multiply unless
    the CPU is told to flush it."""
    tiny = torch.tensor([2.0 ** -140], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


def _cuda_settings() -> dict[str, Callable[[], Any]]:
    if not torch.cuda.is_initialized():
        return {}
    return {
        "torch.cuda.current_device": torch.cuda.current_device,
        "torch.cuda.get_sync_debug_mode": torch.cuda.get_sync_debug_mode,
        # The harness sets it to 0 before each call; a candidate that raises it is
        # carving out L2 that the flush would not evict.
        "persisting-L2 limit (bytes)": timing.persisting_l2_limit,
    }


def _compiler_settings() -> dict[str, Callable[[], Any]]:
    """CUDA-graph switches of a compiler, only where one is already imported: importing
    it here would change the process being measured."""
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is None:
        return {}
    return {
        "torch._inductor.config.triton.cudagraphs": lambda: inductor.triton.cudagraphs,
        "torch._inductor.config.triton.cudagraph_trees": lambda: inductor.triton.cudagraph_trees,
    }


def _process_settings() -> dict[str, Callable[[], Any]]:
    settings: dict[str, Callable[[], Any]] = {
        "sys.getswitchinterval": sys.getswitchinterval,
        "gc.get_threshold": gc.get_threshold,
        # Read, never set: os.nice(0) would call setpriority, which the jail refuses.
        "nice": lambda: os.getpriority(os.PRIO_PROCESS, 0),
        "distributed process group initialised":
            lambda: torch.distributed.is_available() and torch.distributed.is_initialized(),
    }
    if hasattr(os, "sched_getaffinity"):
        settings["os.sched_getaffinity"] = lambda: sorted(os.sched_getaffinity(0))
    for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE"):
        settings[f"resource.{name}"] = lambda limit=getattr(resource, name): resource.getrlimit(limit)
    return settings


def _declared(op: Op, device: str) -> dict[str, Callable[[], Any]]:
    """What the op declares: the workloads run, their batch sizes, tolerances, dtypes."""
    return {
        f"{op.name} workloads": lambda: [workload.to_dict() for workload in op.workloads(device)],
        f"{op.name} context lengths": lambda: op.default_context_lengths(device),
        f"{op.name} context length range": lambda: op.context_length_range(device),
        f"{op.name} batch sizes": lambda: op.default_batch_sizes(device),
        f"{op.name} max batch size": lambda: op.max_batch_size(device),
        f"{op.name} tolerances": lambda: sorted((str(dtype), op.tolerance(dtype))
                                                for dtype in type(op).tolerances),
        f"{op.name} class attributes": lambda: _digest(_public_plain(vars(type(op)))),
    }


def _public_plain(namespace: Mapping[str, Any]) -> list[tuple[str, str]]:
    return sorted((name, repr(value)) for name, value in namespace.items()
                  if not name.startswith("_") and _plain(value))


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, _CONTAINERS) and depth < 4:
        items = value.items() if isinstance(value, dict) else ((item, None) for item in value)
        return all(_plain(key, depth + 1) and _plain(item, depth + 1) for key, item in items)
    return False


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:12]


def _module_constants(names: list[str]) -> dict[str, Callable[[], Any]]:
    """The UPPER_CASE constants of the harness's and the ops' modules, one digest each:
    CALL_ORDER, DISTRIBUTIONS, SHAPES, HIDDEN... are what the run is built from."""
    def constants(module_name: str) -> str:
        module = sys.modules.get(module_name)
        namespace = vars(module) if module is not None else {}
        return _digest(_public_plain({name: value for name, value in namespace.items()
                                      if name.isupper()}))
    return {f"{name} constants": lambda name=name: constants(name) for name in names}


def _around_difference(before: str, after: str) -> tuple[str, str]:
    """Both values cut to where they first differ, so a long one still shows its change."""
    if len(before) <= _SHOWN_VALUE and len(after) <= _SHOWN_VALUE:
        return before, after
    common = 0
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    start = max(0, common - _SHOWN_VALUE // 3)

    def cut(value: str) -> str:
        piece = value[start:start + _SHOWN_VALUE]
        return ("…" if start else "") + piece + ("…" if start + _SHOWN_VALUE < len(value) else "")
    return cut(before), cut(after)


class ConfigurationWatch:
    """The configuration at construction, and what has changed since."""

    def __init__(self, op: Op, device: str) -> None:
        self.op, self.device = op, device
        # The modules present now, before any candidate code: a module imported later
        # (the decode step's, say) has no "before" to compare with.
        self._modules = sorted(name for name in sys.modules
                               if name == "runners" or name.startswith("runners."))
        self.before = self.take()

    def _probes(self) -> dict[str, Callable[[], Any]]:
        return {**_torch_flags(), **_cuda_settings(), **_compiler_settings(),
                **_process_settings(), **_declared(self.op, self.device),
                **_module_constants(self._modules)}

    def take(self) -> dict[str, str]:
        taken = {f"env {name}": value for name, value in os.environ.items()}
        for name, probe in self._probes().items():
            try:
                taken[name] = str(probe())
            except Exception as error:  # a probe that breaks is itself a reading
                taken[name] = f"unreadable ({type(error).__name__})"
        return taken

    def changes(self) -> list[str]:
        """Each setting that differs from the first reading, as "name: before → after"."""
        now = self.take()
        found = []
        for name in sorted(self.before.keys() | now.keys()):
            before, after = self.before.get(name), now.get(name)
            if before == after:
                continue
            if name in self.before and name not in now and not name.startswith("env "):
                continue  # a probe that only exists sometimes (CUDA not yet initialised)
            if name not in self.before and not name.startswith("env "):
                continue
            shown_before, shown_after = _around_difference(before or "", after or "")
            found.append(f"{name}: {shown_before if before is not None else 'unset'} → "
                         f"{shown_after if after is not None else 'unset'}")
        return found
