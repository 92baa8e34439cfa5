"""Writes a fake result onto the harness's result channel (kernelbot's cheat-fd.py):
finds the reply pipe among its descriptors and writes a forged "done in no time" frame
before its real reply.

Each frame carries the number of the request it answers; a forged one breaks the
sequence, and the judge stops the candidate for it.
"""

import json
import os
import struct
import sys

import torch

_calls = 0


def _forge(fd):
    header = json.dumps({"ok": True, "ms": 1e-6, "launches": None, "seq": _calls, "tensors": []}).encode()
    try:
        os.write(fd, struct.pack(">Q", len(header)) + header)
    except OSError:
        pass


def forward(x, weight, eps):
    global _calls
    _calls += 1
    for argument in sys.argv[1:]:
        if argument.isdigit():
            _forge(int(argument))
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
