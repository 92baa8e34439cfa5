"""One outbound POST, guarded against server-side request forgery.

A webhook URL is typed in by a user and fetched by our servers, so it could point at
the database, the Redis broker or a cloud metadata service. Before every attempt the
host name is resolved and each address it resolves to must be public; then the
connection goes to that vetted address, not to a second lookup of the name. Resolving
twice would let a DNS server answer "public" to the check and "127.0.0.1" to the
connect (DNS rebinding). The Host header, TLS SNI and certificate check still use the
name from the URL, so virtual hosts and HTTPS work as usual.

http.client is used directly: it follows no redirects (a 3xx to an internal address
would undo the check; Standard Webhooks receivers answer 2xx) and lets the socket be
opened to the vetted address through its connection hook.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

USER_AGENT = "KernelLab-Webhooks/1"
RESPONSE_EXCERPT_BYTES = 300
DEFAULT_PORTS = {"http": 80, "https": 443}


class Refused(Exception):
    """The URL may not be fetched: a bad scheme or a non-public address."""


@dataclass(frozen=True)
class Response:
    status: int
    excerpt: str


def address_refusal(address: str) -> str | None:
    """Why an address may not be reached, or None for a public unicast address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    for kind in ("unspecified", "loopback", "link_local", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if not ip.is_global:  # e.g. carrier-grade NAT 100.64/10, documentation ranges
        return "non-public"
    if isinstance(ip, ipaddress.IPv6Address) and (ip in _SITE_LOCAL or ip.sixtofour is not None):
        # Counted global by ipaddress, but site-local (deprecated, still routed on some
        # networks) or 6to4, whose relay reaches the IPv4 address it embeds (2002:7f00:1::).
        return "site-local" if ip in _SITE_LOCAL else "6to4"
    return None


_SITE_LOCAL = ipaddress.ip_network("fec0::/10")


def check_url(url: str) -> tuple[str, str, int]:
    """The scheme, host and port of a URL we may POST to, or Refused."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS:
        raise Refused(f"only http and https URLs are allowed, not {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise Refused("the URL has no host")
    if parts.username or parts.password:
        raise Refused("credentials in the URL are not supported")
    try:
        port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError as exc:
        raise Refused(f"bad port: {exc}") from exc
    return parts.scheme, parts.hostname, port


def resolve(host: str, port: int, *, allow_private: bool) -> str:
    """The address to connect to, after checking every address the host resolves to.

    Any non-public address refuses the whole host: connecting to "the public one"
    would still let a name that also resolves internally be used to probe.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"could not resolve {host}: {exc.strerror}") from exc
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not allow_private:
        for address in addresses:
            reason = address_refusal(address)
            if reason:
                shown = host if host == address else f"{host} resolves to {address},"
                raise Refused(
                    f"refused: {shown} a {reason} address; webhooks may only reach public "
                    "addresses (WEBHOOKS_ALLOW_PRIVATE_NETWORKS is off)"
                )
    return addresses[0]


class _PinnedAddress:
    """Opens the socket to a vetted address while self.host stays the URL's name."""

    def __init__(self, *args, address: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # http.client opens its socket through this hook in connect(); for HTTPS the
        # socket is then wrapped with server_hostname=self.host, so SNI and the
        # certificate check use the name, not the address.
        self._create_connection = lambda _where, timeout, source: socket.create_connection(
            (address, self.port), timeout, source
        )


class PinnedHTTPConnection(_PinnedAddress, http.client.HTTPConnection):
    pass


class PinnedHTTPSConnection(_PinnedAddress, http.client.HTTPSConnection):
    pass


def post(url: str, *, body: bytes, headers: dict[str, str], timeout_s: float,
         allow_private: bool) -> Response:
    """POST once, within `timeout_s` in all. Raises Refused for a forbidden target,
    OSError (TimeoutError past the deadline) or HTTPException on failure.

    A socket's timeout bounds each read, not the attempt: a receiver that sent a header
    line a second held a delivery worker for as long as it liked. So the socket is shut
    at the deadline, whatever the attempt is waiting on."""
    scheme, host, port = check_url(url)
    address = resolve(host, port, allow_private=allow_private)
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection_class = PinnedHTTPSConnection if scheme == "https" else PinnedHTTPConnection
    connection = connection_class(host, port, timeout=timeout_s, address=address)
    past_deadline = threading.Event()

    def cut_off() -> None:
        past_deadline.set()
        if connection.sock is not None:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already

    deadline = threading.Timer(timeout_s, cut_off)
    deadline.daemon = True
    deadline.start()
    try:
        connection.request("POST", target, body=body, headers={"user-agent": USER_AGENT, **headers})
        response = connection.getresponse()
        excerpt = response.read(RESPONSE_EXCERPT_BYTES).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as error:
        if past_deadline.is_set():
            raise TimeoutError(f"no whole answer within {timeout_s:g} s") from error
        raise
    finally:
        deadline.cancel()
        connection.close()
    if past_deadline.is_set():  # the answer was cut short at the deadline
        raise TimeoutError(f"no whole answer within {timeout_s:g} s")
    return Response(status=response.status, excerpt=excerpt)
