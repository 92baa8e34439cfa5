"""The address a request came from, as login throttling counts it.

Served directly, it is the connection's peer (REMOTE_ADDR). Behind TRUSTED_PROXIES
reverse proxies (a TLS terminator, a load balancer), every request's peer is the
nearest proxy, so counting it would put every user behind one address: each proxy
appends the peer it saw to X-Forwarded-For, and the address the outermost trusted
proxy saw is the N-th from the right. Entries further left are the client's own
words and are never read; a request with fewer entries than proxies did not come
through all of them and counts as its peer.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def client_address(request: HttpRequest) -> str | None:
    peer = request.META.get("REMOTE_ADDR")
    proxies = settings.TRUSTED_PROXIES
    if proxies <= 0:
        return peer
    forwarded = [entry.strip() for entry in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    forwarded = [entry for entry in forwarded if entry]
    if len(forwarded) < proxies:
        return peer
    seen = forwarded[-proxies]
    try:
        return str(ipaddress.ip_address(seen))
    except ValueError:  # not an address: a proxy that passes anything on is not trusted
        return peer
