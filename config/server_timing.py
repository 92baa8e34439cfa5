"""`Server-Timing: app;dur=<ms>` on every response: the app's own time for the request.

Browsers show it in the network panel of their developer tools, and bench/page_load.py
reads it to tell the app's time from the round trip. Outermost in MIDDLEWARE, so it
covers every middleware and the view; under ASGI it includes the wait for the thread
that runs synchronous views.
"""

from __future__ import annotations

import time

from asgiref.sync import iscoroutinefunction
from django.utils.decorators import sync_and_async_middleware


def _header(started: float) -> str:
    return f"app;dur={(time.perf_counter() - started) * 1000:.1f}"


@sync_and_async_middleware
def server_timing(get_response):
    # Both flavours, so it adds no sync/async switch of its own to the chain it times.
    if iscoroutinefunction(get_response):
        async def middleware(request):
            started = time.perf_counter()
            response = await get_response(request)
            response["Server-Timing"] = _header(started)
            return response
    else:
        def middleware(request):
            started = time.perf_counter()
            response = get_response(request)
            response["Server-Timing"] = _header(started)
            return response
    return middleware
