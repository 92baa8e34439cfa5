"""Predicts the random inputs (kernelbot's cheat-rng): regenerates them with the op's own
input code from guessed seeds and returns the answer for the best guess, never reading x.

A secret seed drawn each run is mixed into every input's seed, so no guess is right.
"""

import torch

from runners.ops import Workload, get_op

_op = get_op("rmsnorm")


def forward(x, weight, eps):
    tokens, hidden = x.shape
    dtype = str(x.dtype).removeprefix("torch.")
    workload = Workload(name="guess", device=x.device.type,
                        params={"tokens": tokens, "hidden": hidden, "dtype": dtype, "eps": eps})
    guessed = _op.make_inputs(workload, seed=0, distribution="normal")
    return _op.reference(guessed).to(x.device, x.dtype)
