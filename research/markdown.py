"""Markdown from users, rendered to HTML that cannot carry script."""

from __future__ import annotations

import markdown as md
import nh3
from django.utils.safestring import SafeString, mark_safe

_ALLOWED_TAGS = {
    "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "code", "pre",
    "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td",
}


def render_markdown(text: str) -> SafeString:
    html = md.markdown(text, extensions=["fenced_code", "tables", "sane_lists"])
    cleaned = nh3.clean(
        html,
        tags=_ALLOWED_TAGS,
        attributes={"a": {"href", "title"}, "code": {"class"}},
        url_schemes={"http", "https", "mailto"},
        link_rel="noopener noreferrer nofollow",
    )
    # nh3 has removed every tag, attribute and URL scheme not allowed above (docs/security.md).
    return mark_safe(cleaned)  # noqa: S308  # nosec B308 B703
