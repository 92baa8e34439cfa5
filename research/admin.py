from __future__ import annotations

from django.contrib import admin
from django.utils import timezone

from config.admin_lookups import RefusesLookupsOn
from research.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(RefusesLookupsOn, admin.ModelAdmin):
    """Tokens are seen and revoked here, never made (a token made here could not be shown
    to its owner) nor deleted (results name the token they were imported with)."""

    # ?key_hash__startswith=4 told the hash a digit at a time.
    hidden_fields = ("key_hash",)
    list_display = ["name", "user", "prefix", "host", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "host", "user__username"]
    exclude = ["key_hash"]
    readonly_fields = ["user", "name", "prefix", "host", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.action(description="Revoke the selected tokens", permissions=["change"])
    def revoke(self, request, queryset) -> None:
        revoked = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"{revoked} token(s) revoked.")
