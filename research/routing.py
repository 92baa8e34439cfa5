from __future__ import annotations

from django.urls import path

from research.consumers import SweepConsumer

websocket_urlpatterns = [
    path("ws/sweeps/<int:sweep_id>/", SweepConsumer.as_asgi()),
]
