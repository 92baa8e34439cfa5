"""HTTP through Django, websockets through Channels: only for logged-in users and
only from an allowed origin (the same hosts as ALLOWED_HOSTS)."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_http = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from research.routing import websocket_urlpatterns  # noqa: E402
from reviews.routing import websocket_urlpatterns as review_websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # One machine, one process: Daphne serves the static files too.
        "http": ASGIStaticFilesHandler(django_http) if settings.SERVE_STATIC else django_http,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns + review_websocket_urlpatterns))
        ),
    }
)
