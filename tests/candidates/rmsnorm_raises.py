"""Crash by exception: what a kernel with a bad launch configuration does."""


def forward(x, weight, eps):
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
