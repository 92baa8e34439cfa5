"""Daphne, with request bodies capped where their bytes arrive.

    python -m config.serve -b 127.0.0.1 -p 8000 config.asgi:application   (daphne's arguments)

Twisted reads a whole request body (to memory, or a temporary file past 100 KB) before
Daphne runs the app, and Daphne then queues every chunk of it in memory at once: the
ASGI cap (config.request_limits) answers 413 only after that, so a 300 MB POST still
grew the server by 300 MB, logged in or not. Here a body that declares more than
REQUEST_MAX_BYTES, or grows past it, is dropped as it arrives and answered 413 once the
client has sent it; nothing of it is kept in memory or on disk.
"""

from __future__ import annotations

import io

from daphne import http_protocol
from daphne.cli import CommandLineInterface


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
        self.body_refused = length is not None and length > _limit()
        if self.body_refused:
            self.content = io.BytesIO()  # stays empty: nothing of the body is kept
        else:
            super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        self.body_bytes += len(data)
        if not self.body_refused and self.body_bytes > _limit():
            self.body_refused = True  # a body of no declared length that grew too long
            self.content.close()
            self.content = io.BytesIO()
        if not self.body_refused:
            super().handleContentChunk(data)

    def process(self):
        if self.body_refused:
            self.basic_error(413, b"Content Too Large",
                             f"The request body is over {_limit():,} bytes, the most this server reads.")
            return None
        return super().process()


def main() -> None:
    # HTTPFactory builds each connection's requests from this module-level name.
    http_protocol.WebRequest = CappedWebRequest
    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
