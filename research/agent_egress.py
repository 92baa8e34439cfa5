"""The way out of a networked agent's jail: a CONNECT proxy to the hosts its declaration
names, and nowhere else.

A jail that shared the worker's network namespace reached the worker's loopback: an
agent read the password hashes from PostgreSQL and made its user a superuser, and Redis
answered it too. So every jail has a network namespace of its own, holding only its own
loopback, and an agent declared with `hosts = ["api.example.com:443"]` reaches exactly
those. Inside the jail a forwarder (`research/agent_forward.py`, run by the system's
python3) listens on 127.0.0.1:PROXY_PORT and hands each connection over a Unix socket to
this proxy, outside. The proxy accepts only `CONNECT host:port` for a declared pair,
resolves the host once, refuses it if any address it has is not public (loopback,
private, link-local, the cloud metadata address: `webhooks.outbound.resolve`), connects
to the address it checked and pipes bytes both ways. HTTPS_PROXY points the agent at the
forwarder; plain HTTP is refused (a model's API is HTTPS).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from pathlib import Path

from research.agent_forward import pipe_both_ways
from webhooks import outbound

PROXY_PORT = 3128
HEAD_MAX_BYTES = 8192
CONNECT_TIMEOUT_S = 10.0


class Egress:
    """The proxy for one run of an agent: started with it, closed after it."""

    def __init__(self, hosts: tuple[str, ...], *, allow_private: bool = False) -> None:
        self.allowed = {host.lower() for host in hosts}
        self.allow_private = allow_private
        self.refusals: list[str] = []
        self._folder = Path(tempfile.mkdtemp(prefix="kernel-lab-egress-"))
        self.socket_path = self._folder / "egress.sock"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.socket_path))
        # The agent's user (nobody) connects; the folder stays the worker's alone, and the
        # socket is reached only through the jail's bind mount.
        self.socket_path.chmod(0o666)
        self._server.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self._server.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        with client:
            client.settimeout(CONNECT_TIMEOUT_S)
            try:
                head = _read_head(client)
            except OSError:
                return
            if head is None:
                return self._refuse(client, 400, "no request head")
            request, rest = head
            parts = request.split()
            if len(parts) != 3 or parts[0] != "CONNECT":
                return self._refuse(client, 405, f"only CONNECT to a declared host: {request[:100]!r}")
            target = parts[1].lower()
            if target not in self.allowed:
                return self._refuse(client, 403, f"{target[:100]} is not a host this agent's declaration names")
            host, _, port = target.rpartition(":")
            try:
                address = outbound.resolve(host.strip("[]"), int(port), allow_private=self.allow_private)
                upstream = socket.create_connection((address, int(port)), timeout=CONNECT_TIMEOUT_S)
            except outbound.Refused as error:
                return self._refuse(client, 403, f"{target}: {error}")
            except (OSError, ValueError) as error:
                return self._refuse(client, 502, f"{target}: {error}")
            with upstream:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
                client.settimeout(None)
                upstream.settimeout(None)
                pipe_both_ways(client, upstream)

    def _refuse(self, client: socket.socket, status: int, why: str) -> None:
        self.refusals.append(why)
        body = f"{why}\n".encode()
        try:
            client.sendall(f"HTTP/1.1 {status} Refused\r\ncontent-length: {len(body)}\r\n"
                           "connection: close\r\n\r\n".encode() + body)
        except OSError:
            pass


def _read_head(client: socket.socket) -> tuple[str, bytes] | None:
    """The request line, and whatever came after the head."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_MAX_BYTES:
            return None
        chunk = client.recv(1024)
        if not chunk:
            return None
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return head.split(b"\r\n", 1)[0].decode("latin-1"), rest
