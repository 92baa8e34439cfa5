"""Tries the network (to fetch an answer, or to report home), and carries on when refused.

Only ever the loopback address: if the sandbox failed, nothing leaves the machine.
"""

import socket

import torch


def forward(x, weight, eps):
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=0.2).close()
    except OSError:
        pass
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
