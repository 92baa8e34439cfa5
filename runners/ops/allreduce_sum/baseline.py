"""The shipped all-reduce: torch.distributed's, on the group the harness gives
(NCCL on CUDA, gloo on the CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def forward(x: torch.Tensor, comm) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=comm.group)
    return out
