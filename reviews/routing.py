from __future__ import annotations

from django.urls import path

from reviews.consumers import ReviewQueueConsumer

websocket_urlpatterns = [
    path("ws/reviews/", ReviewQueueConsumer.as_asgi()),
]
