from __future__ import annotations

from django.contrib import admin

from config.admin_lookups import RefusesLookupsOn
from webhooks.models import Attempt, Delivery, Endpoint


@admin.register(Endpoint)
class EndpointAdmin(RefusesLookupsOn, admin.ModelAdmin):
    list_display = ["url", "owner", "enabled", "disabled_reason", "created_at"]
    list_filter = ["enabled"]
    # The secret is never displayed again after creation, not even to admins, nor told
    # a character at a time through the URL's filters (?secret__startswith=whsec_S).
    exclude = ["secret"]
    hidden_fields = ("secret",)
    readonly_fields = ["secret_hint", "created_at"]


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    can_delete = False
    readonly_fields = ["number", "started_at", "finished_at", "status_code", "error", "duration_ms", "succeeded"]


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ["webhook_id", "event_type", "endpoint", "status", "attempts", "last_status_code", "created_at"]
    list_filter = ["status", "event_type"]
    search_fields = ["webhook_id"]
    readonly_fields = ["webhook_id", "body", "payload", "created_at", "delivered_at"]
    inlines = [AttemptInline]
