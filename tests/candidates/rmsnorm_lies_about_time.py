"""Reaches into the child's timer and reports a tenth of each call's real time.

It patches a method the child's integrity check does not watch, and hides the patch
from the source check (a module found by name, a setattr on a local), so only the
judge's own clock (round trips less the baseline's overhead) can tell. The work itself
is slow: 5 ms a call.
"""

import importlib
import time

import torch

_runner = importlib.import_module("runners.harness.timing").CpuRunner
_real_run = _runner.run


def _run(self, slot):
    elapsed_ms, launches = _real_run(self, slot)
    return elapsed_ms / 10, launches


setattr(_runner, "run", _run)


def forward(x, weight, eps):
    time.sleep(0.005)
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
