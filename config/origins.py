"""Which page may open a websocket: one served from the very origin the socket reaches.

A browser sends the user's session cookie with a socket that any site's page opens, so
the `Origin` header is what tells the app's own pages from another site's. It must be
the same origin as the socket, in full: the scheme (http for ws, https for wss, or
https behind a proxy that says so when SECURE_PROXY_SSL_HEADER is on), the host and the
port of the request's `Host` header, whose host ALLOWED_HOSTS allows; or one of
CSRF_TRUSTED_ORIGINS exactly, for a page served from another origin on purpose.
Channels' AllowedHostsOriginValidator compares the host alone, so a page on another
port of the same host, or served over plain http, passed it.
"""

from __future__ import annotations

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _scheme(scope: dict) -> str:
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy:
        name, secure_value = proxy
        forwarded = _header(scope, name.removeprefix("HTTP_").replace("_", "-").lower().encode())
        if forwarded is not None:
            return "https" if forwarded.split(",")[0].strip() == secure_value else "http"
    return "https" if scope.get("scheme") == "wss" else "http"


def allowed_origin(scope: dict) -> bool:
    """Whether the socket's `Origin` is its own origin, or one trusted by name."""
    origin, host = _header(scope, b"origin"), _header(scope, b"host")
    if not origin:
        return False
    origin = origin.strip().lower()
    if origin in {trusted.lower() for trusted in settings.CSRF_TRUSTED_ORIGINS}:
        return True
    if not host:
        return False
    host = host.strip().lower()
    domain, _ = split_domain_port(host)
    return (bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)
            and origin == f"{_scheme(scope)}://{host}")


class SameOriginValidator:
    """ASGI middleware: refuses a websocket whose origin allowed_origin refuses."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not allowed_origin(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
