"""Hangs in forward: a kernel that never finishes."""


def forward(x, weight, eps):
    while True:
        pass
