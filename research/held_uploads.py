"""A profile the thesis form keeps across a refused submit.

A browser never fills a file input back in, so every refusal (a title with a hidden
character, a workload the op cannot run) cost its author the upload, chosen again for
each submit. The form's bytes wait in the cache instead, under a random token that only
the user who uploaded them can redeem, for HOLD_S; the page names the file and carries
the token in a hidden field. A profile the submit found to be the problem is never
held; one refused before it was read (a blank title) is read at the next submit.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.core.cache import cache

from research.services import Upload

HOLD_S = 60 * 60
TOKEN_BYTES = 16


@dataclass(frozen=True)
class Held:
    token: str
    name: str
    size: int


def _key(user_id: int, token: str) -> str:
    return f"held-upload:{user_id}:{token}"


def hold(user_id: int, upload: Upload) -> Held:
    token = secrets.token_urlsafe(TOKEN_BYTES)
    cache.set(_key(user_id, token), (upload.name, upload.data), HOLD_S)
    return Held(token=token, name=upload.name, size=len(upload.data))


def redeem(user_id: int, token: str) -> Upload | None:
    """The upload held under `token` for this user, or None (unknown, expired, or
    another user's). It stays held until `release`: a second refusal keeps it."""
    if not token or len(token) > 64:
        return None
    held = cache.get(_key(user_id, token))
    return Upload(name=held[0], data=held[1]) if held else None


def release(user_id: int, token: str) -> None:
    cache.delete(_key(user_id, token))
