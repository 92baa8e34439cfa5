"""A fingerprint of a call's inputs, computed alike by the child and by the judge.

The child reports the fingerprint of its inputs after a call; the judge computes it for
the pristine inputs it generated itself from the same seed. A candidate that rewrites
its inputs, and also the child's own comparison, still cannot make the two agree.

It is keyed by a number the judge sends only when it asks, after the call, so a
candidate cannot shape a change to leave it equal. On the host it is a keyed BLAKE2b of
the bytes. On a GPU, copying a GiB of input to the host and hashing it would take
seconds per call, so it is two position-weighted sums of the tensor's 16-bit words,
with key-drawn weights, computed where the tensor is: products stay under 2^32 and
chunk sums under 2^54, so int64 never overflows and the sums are exact whatever the
reduction order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

_CHUNK = 1 << 22
_PRIMES = (65521, 65519)


def _weighted_sums(tensor: torch.Tensor, key: int) -> tuple[int, int]:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)
    first, second = key % _PRIMES[0] + 1, (key >> 16) % _PRIMES[1] + 1
    totals = [0, 0]
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int64) & 0xFFFF
        position = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device)
        for index, (scale, shift) in enumerate(((first, second), (second, first))):
            weight = (position * scale + shift) % _PRIMES[index] + 1
            totals[index] += int((part * weight).sum())
    return totals[0], totals[1]


def input_digest(inputs: Mapping[str, Any], key: int) -> str:
    digest = hashlib.blake2b(digest_size=16, key=key.to_bytes(8, "big"))
    for name, value in inputs.items():
        digest.update(name.encode() + b"\0")
        if not isinstance(value, torch.Tensor):
            digest.update(repr(value).encode())
            continue
        digest.update(f"{value.dtype}{list(value.shape)}".encode())
        if value.is_cuda:
            digest.update(repr(_weighted_sums(value, key)).encode())
        else:
            flat = value.detach().contiguous().reshape(-1)
            digest.update(memoryview(flat.view(torch.uint8).numpy()).cast("B"))
    return digest.hexdigest()


def describe_change(after: Mapping[str, Any], pristine: Mapping[str, Any]) -> str | None:
    """What changed, in words, for the report; None when nothing did."""
    for key, original in pristine.items():
        now = after[key]
        if not isinstance(original, torch.Tensor):
            continue
        if not isinstance(now, torch.Tensor) or now.shape != original.shape or now.dtype != original.dtype:
            return f"{key} went from {list(original.shape)} {original.dtype} to something else"
        if not torch.equal(now, original):
            differ = int((now != original).sum())
            return f"{differ:,} of {original.numel():,} elements of {key} differ"
    return None
