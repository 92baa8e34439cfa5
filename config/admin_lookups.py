"""The admin filters a list by any field named in its URL (?secret__startswith=whsec_S),
so a field it never shows can still be read a character at a time. Admins of models
with such fields refuse lookups on them."""

from __future__ import annotations


class RefusesLookupsOn:
    """A ModelAdmin mixin: `hidden_fields` cannot be filtered on through the URL."""

    hidden_fields: tuple[str, ...] = ()

    def lookup_allowed(self, lookup: str, value: str, request=None) -> bool:
        parts = lookup.split("__")
        if any(part in self.hidden_fields for part in parts):
            return False
        return super().lookup_allowed(lookup, value, request)
