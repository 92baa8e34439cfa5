"""HTTP through Django, its bodies capped before they are read (config.request_limits);
websockets through Channels: only for logged-in users and only from the socket's own
origin, scheme, host and port (config.origins)."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
# No persistent database connections in the web processes (Django's advice under ASGI):
# each request's sync view runs in a thread of its own, and a connection kept open past
# its request stays with that thread, so 20 users exhausted PostgreSQL's 100 connections
# ("too many clients already", bench/page_load.py). Workers keep theirs (settings).
os.environ.setdefault("DB_CONN_MAX_AGE", "0")
# On PostgreSQL they borrow each request's connection from a pool of their own instead
# of opening one (config.settings).
os.environ.setdefault("DB_POOL_MAX", "8")
django_http = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from config.origins import SameOriginValidator  # noqa: E402
from config.request_limits import RequestBodyLimit  # noqa: E402
from research.routing import websocket_urlpatterns  # noqa: E402
from reviews.routing import websocket_urlpatterns as review_websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # One machine, one process: Daphne serves the static files too.
        "http": RequestBodyLimit(ASGIStaticFilesHandler(django_http) if settings.SERVE_STATIC else django_http,
                                 settings.REQUEST_MAX_BYTES),
        "websocket": SameOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns + review_websocket_urlpatterns))
        ),
    }
)
