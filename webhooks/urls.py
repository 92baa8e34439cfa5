from __future__ import annotations

from django.urls import path

from webhooks import views

urlpatterns = [
    path("", views.endpoint_list, name="webhook_list"),
    path("new/", views.endpoint_new, name="webhook_new"),
    path("<int:endpoint_id>/", views.endpoint_detail, name="webhook_detail"),
    path("<int:endpoint_id>/deliveries/", views.endpoint_deliveries, name="webhook_deliveries"),
    path("<int:endpoint_id>/toggle/", views.endpoint_toggle, name="webhook_toggle"),
    path("<int:endpoint_id>/delete/", views.endpoint_delete, name="webhook_delete"),
    path("deliveries/<int:delivery_id>/redeliver/", views.delivery_redeliver, name="webhook_redeliver"),
]
