"""Predicts the random inputs (kernelbot's cheat-rng): regenerates them with the op's own
input code from a guessed seed and returns the answer for that guess, never reading x.
The guess is made once per shape (at the first, eager call) and its answer copied out
on every call, so on a GPU it survives CUDA-graph capture.

A secret seed drawn each run is mixed into every input's seed, so no guess is right.
"""

import torch

from runners.ops import Workload, get_op

_op = get_op("rmsnorm")
_guessed = {}


def _guess(x, eps):
    tokens, hidden = x.shape
    key = (tokens, hidden, x.dtype, x.device, eps)
    if key not in _guessed:
        dtype = str(x.dtype).removeprefix("torch.")
        workload = Workload(name="guess", device=x.device.type,
                            params={"tokens": tokens, "hidden": hidden, "dtype": dtype, "eps": eps})
        guessed = _op.make_inputs(workload, seed=0, distribution="normal")
        _guessed[key] = _op.reference(guessed).to(x.device, x.dtype)
    return _guessed[key]


def forward(x, weight, eps):
    return _guess(x, eps).clone()
