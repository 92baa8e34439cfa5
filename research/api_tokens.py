"""API tokens: created (shown once), checked on every API request, revoked.

Only a token's SHA-256 is stored, so a leaked database does not leak working tokens;
the token has enough entropy (256 bits) that a fast hash is the right one.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from django.core.exceptions import PermissionDenied, ValidationError
from django.utils import timezone

from research.models import ApiToken
from research.theses import refuse_hidden_characters

TOKEN_PREFIX = "kl_"
# "kl_" and 8 characters: enough to tell one's tokens apart, too few to guess the rest.
SHOWN_CHARS = 11


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# A host's name as results show it: a hostname's characters, nothing a page could render.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def api_token_create(*, user, name: str, host: str = "") -> tuple[ApiToken, str]:
    """A new token for `user`; returns the row and the token, which is never stored.

    With `host`, a GPU host's token: it can only import results, each named as that host's."""
    name = name.strip()
    if not name:
        raise ValidationError({"name": "name the token (the host or script that will use it)"})
    if len(name) > ApiToken._meta.get_field("name").max_length:
        raise ValidationError({"name": "at most 100 characters"})
    refuse_hidden_characters("name", name)
    if host and not HOST_NAME.fullmatch(host):
        raise ValidationError({"host": "a host name: letters, digits, '.', '_' and '-', at most 100"})
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken.objects.create(user=user, name=name, host=host, prefix=token[:SHOWN_CHARS],
                                  key_hash=_hash(token))
    return row, token


def api_token_authenticate(token: str) -> ApiToken | None:
    """The live token's row (its last use stamped), or None for an unknown or revoked one."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    row = (ApiToken.objects.select_related("user")
           .filter(key_hash=_hash(token), revoked_at__isnull=True, user__is_active=True).first())
    if row is None:
        return None
    row.last_used_at = timezone.now()
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=row.last_used_at)
    return row


def may_create_host_token(user) -> bool:
    """A GPU host's token imports results: on the tokens page only those who may import
    themselves may make one (`manage.py create_api_token --host`, run on the server, makes
    one for anybody)."""
    return user.has_perm("research.import_results")


def api_token_create_on_page(*, user, name: str, host: str = "") -> tuple[ApiToken, str]:
    """api_token_create for the signed-in `user`, who may name a host only where
    may_create_host_token says so."""
    host = host.strip()
    if host and not may_create_host_token(user):
        raise ValidationError({"host": "a GPU host's token imports results: you need the permission "
                                       "to import results to make one"})
    return api_token_create(user=user, name=name, host=host)


def api_tokens_of(user) -> list[ApiToken]:
    return list(ApiToken.objects.filter(user=user))


def api_token_revoke(*, token: ApiToken, revoked_by) -> None:
    if token.user_id != revoked_by.pk:
        raise PermissionDenied("only its owner may revoke a token")
    ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
