from __future__ import annotations

from django.contrib import admin

from reviews.models import Review


@admin.register(Review)
class ReviewAdmin(admin.ModelAdmin):
    """Read-only and append-only: decisions are made on the review page, where four eyes
    are checked, and none is ever deleted (main keeps the merge a keep made; undoing one
    is a new decision, not a missing row)."""

    list_display = ["candidate", "revision", "decision", "reviewer", "author", "producer", "created_at"]
    list_filter = ["decision"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
