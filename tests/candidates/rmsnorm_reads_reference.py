"""Looks for the expected output instead of computing it (pygpubench, reference-kernels):
walks the caller frames for a local named like a reference, then the garbage collector
for any other tensor of the right shape and dtype, and returns what it finds.

In the candidate's process there is no reference to find: it was computed in another.
"""

import gc
import sys

import torch

_NAMES = ("expected", "reference", "ref", "reference_output", "answer")


def _from_frames(x):
    frame = sys._getframe(1)
    while frame is not None:
        for name in _NAMES:
            value = frame.f_locals.get(name)
            if isinstance(value, torch.Tensor) and value.shape == x.shape:
                return value
        frame = frame.f_back
    return None


def _from_heap(x):
    for value in gc.get_objects():
        if isinstance(value, torch.Tensor) and value is not x and value.shape == x.shape \
                and value.dtype == x.dtype:
            return value
    return None


def forward(x, weight, eps):
    found = _from_frames(x)
    if found is None:
        found = _from_heap(x)
    return found.clone() if found is not None else torch.zeros_like(x)
