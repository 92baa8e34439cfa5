"""Hangs while being imported: an "autotuner" that never ends."""

while True:
    pass


def forward(x, weight, eps):
    return x
