"""Allocates without bound: a workspace that grows every call."""

import torch

_workspace = []


def forward(x, weight, eps):
    while True:
        _workspace.append(torch.ones(1 << 26, dtype=torch.uint8))
