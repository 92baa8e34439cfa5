"""A profile the thesis form keeps across a refused submit.

A browser never fills a file input back in, so every refusal (a title with a hidden
character, a workload the op cannot run) cost its author the upload, chosen again for
each submit. The form's bytes wait in the cache instead, under a random token that only
the user who uploaded them can redeem, for HOLD_S; the page names the file and carries
the token in a hidden field. A profile the submit found to be the problem is never
held; one refused before it was read (a blank title) is read at the next submit.

The cache is the broker's Redis in the quick start, so what waits is bounded: one held
profile per user (a new one takes the place of the last), of at most MAX_HELD_BYTES.
Refused submits that each parked a 25 MB file for an hour once filled Redis 75 MB in
three posts.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.core.cache import cache

from research.theses import Upload

HOLD_S = 30 * 60
MAX_HELD_BYTES = 8 * 1024 * 1024
TOKEN_BYTES = 16


@dataclass(frozen=True)
class Held:
    token: str
    name: str
    size: int


def _key(user_id: int) -> str:
    return f"held-upload:{user_id}"


def may_hold(upload: Upload) -> bool:
    return len(upload.data) <= MAX_HELD_BYTES


def hold(user_id: int, upload: Upload) -> Held:
    """Hold `upload` in the user's one slot; the caller asks `may_hold` first."""
    if not may_hold(upload):
        raise ValueError(f"{upload.name} is over the {MAX_HELD_BYTES:,} bytes a held profile may have")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    cache.set(_key(user_id), (token, upload.name, upload.data), HOLD_S)
    return Held(token=token, name=upload.name, size=len(upload.data))


def redeem(user_id: int, token: str) -> Upload | None:
    """The upload held under `token` for this user, or None (unknown, expired, replaced,
    or another user's). It stays held until `release`: a second refusal keeps it."""
    held = cache.get(_key(user_id)) if token and len(token) <= 64 else None
    if not held or not secrets.compare_digest(held[0], token):
        return None
    return Upload(name=held[1], data=held[2])


def release(user_id: int, token: str) -> None:
    if redeem(user_id, token) is not None:
        cache.delete(_key(user_id))
