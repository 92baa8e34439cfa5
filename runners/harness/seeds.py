"""Seeds no candidate can predict: one secret per run, every input seed derived from it."""

from __future__ import annotations

import hashlib
import secrets

# JSON readers in JavaScript lose integers above 2**53; the seed is shown in the UI.
_SECRET_BITS = 48


def draw_secret_seed() -> int:
    return secrets.randbits(_SECRET_BITS)


def derive_seed(secret: int, *parts: object) -> int:
    text = ":".join(str(part) for part in (secret, *parts))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)
