"""Standard Webhooks signing (CONTRACTS §7).

    webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>

where the key is the base64-decoded part of the `whsec_…` secret. Receivers verify it
with any Standard Webhooks library (the tests use the `standardwebhooks` package).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # Standard Webhooks asks for 24 to 64 random bytes


def secret_generate() -> str:
    # Standard (not URL-safe) base64: that is what the reference libraries decode.
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def webhook_id_generate() -> str:
    # Letters and digits only: the id is joined into the signed text with dots.
    return "msg_" + base64.b32encode(secrets.token_bytes(15)).decode().lower()


def signature(*, secret: str, webhook_id: str, timestamp: int, body: str) -> str:
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{webhook_id}.{timestamp}.{body}".encode()
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(*, secret: str, webhook_id: str, timestamp: int, body: str) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(
            secret=secret, webhook_id=webhook_id, timestamp=timestamp, body=body
        ),
    }
