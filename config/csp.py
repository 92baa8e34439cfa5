"""The Content-Security-Policy of every response.

Pages load scripts only from this server (no inline script, no eval: the templates have
neither, and a kernel name or thesis text that slipped past escaping could not run),
connect only to it (its websockets included), and are framed by nobody. Styles may be
inline: Plotly and htmx insert <style> elements and style attributes as they draw.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self' 'unsafe-inline'",
    # Plotly's image export and the modebar's icons.
    "img-src 'self' data:",
    "font-src 'self'",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])


def content_security_policy(get_response: Callable[[HttpRequest], HttpResponse]) -> Callable:
    def middleware(request: HttpRequest) -> HttpResponse:
        response = get_response(request)
        response.headers.setdefault("Content-Security-Policy", POLICY)
        return response

    return middleware
