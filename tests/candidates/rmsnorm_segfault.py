"""A segmentation fault, as a bad pointer in a native extension gives."""

import ctypes


def forward(x, weight, eps):
    return ctypes.string_at(0)
