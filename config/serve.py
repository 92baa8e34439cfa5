"""Daphne, with request bodies capped where their bytes arrive.

    python -m config.serve -b 127.0.0.1 -p 8000 config.asgi:application   (daphne's arguments)
    python -m config.serve --fd 3 config.asgi:application                 (a socket it inherits)

With --fd it serves a listening socket it inherited: config.web_processes runs several
such processes behind one address.

Twisted reads a whole request body (to memory, or a temporary file past 100 KB) before
Daphne runs the app, and Daphne then queues every chunk of it in memory at once: the
ASGI cap (config.request_limits) answers 413 only after that, so a 300 MB POST still
grew the server by 300 MB, logged in or not. Here a body that declares more than
REQUEST_MAX_BYTES, or grows past it, is answered 413 at once and dropped as it arrives;
nothing of it is kept in memory or on disk. The connection closes when the body ends or
LINGER_S after the answer, whichever is first: a client that declared 10^15 bytes
streamed 4.3 GB in 5 s into a server that read on until it stopped. (The linger lets an
honest client that is still sending read the 413 rather than a reset, as nginx's
lingering close does.)
"""

from __future__ import annotations

import io
import os
import socket

from daphne import http_protocol, server
from daphne.cli import CommandLineInterface
from twisted.internet import endpoints, reactor

LINGER_S = 5.0


def _limit() -> int:
    from django.conf import settings  # configured once Daphne has loaded the app

    return settings.REQUEST_MAX_BYTES


class CappedWebRequest(http_protocol.WebRequest):
    body_refused = False
    body_bytes = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Twisted would parse every urlencoded or multipart body into `args` before the
        # app runs (~1 GB and seconds of a blocked reactor for 65 MiB, on any URL, logged
        # in or not); Daphne never reads `args`: Django parses what a view asks for.
        self._parsePOSTFormSubmission = False

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > _limit():
            self.content = io.BytesIO()  # stays empty: nothing of the body is kept
            self._refuse()
        else:
            super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        self.body_bytes += len(data)
        if not self.body_refused and self.body_bytes > _limit():
            self.content.close()  # a body of no declared length that grew too long
            self.content = io.BytesIO()
            self._refuse()
        if not self.body_refused:
            super().handleContentChunk(data)

    def _refuse(self) -> None:
        """Answers 413 now, before the rest of the body, and closes the connection
        LINGER_S later at the latest."""
        self.body_refused = True
        text = f"The request body is over {_limit():,} bytes, the most this server reads.\n".encode()
        transport = self.channel.transport
        transport.write(b"HTTP/1.1 413 Content Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                        b"content-length: " + str(len(text)).encode() + b"\r\nconnection: close\r\n\r\n" + text)
        reactor.callLater(LINGER_S, transport.loseConnection)

    def process(self):
        if self.body_refused:  # answered already; the whole body came within the linger
            self.channel.transport.loseConnection()
            return None
        return super().process()


def _server_from_string(reactor_, description: str):
    """Daphne's --fd names its socket "fd:fileno=N", an endpoint Twisted's parser does
    not have; such a socket is adopted as it is (Twisted's adoptStreamPort), any other
    description parsed as Daphne would."""
    if description.startswith("fd:fileno="):
        fileno = int(description.removeprefix("fd:fileno="))
        with socket.socket(fileno=os.dup(fileno)) as inherited:
            family = inherited.family
        return endpoints.AdoptedStreamServerEndpoint(reactor_, fileno, family)
    return endpoints.serverFromString(reactor_, description)


def main() -> None:
    # HTTPFactory builds each connection's requests from this module-level name.
    http_protocol.WebRequest = CappedWebRequest
    server.serverFromString = _server_from_string
    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
