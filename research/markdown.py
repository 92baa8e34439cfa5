"""Markdown from users, rendered to HTML that cannot carry script."""

from __future__ import annotations

import markdown as md
import nh3
from django.utils.safestring import SafeString, mark_safe

_ALLOWED_TAGS = {
    "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "code", "pre",
    "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td",
}


# Python-Markdown scans ahead for the end of a link at every "[" it meets, so unmatched
# brackets cost it quadratic time and more: 8,000 of them in a thesis idea (the form
# takes 20,000 characters) held each view of its page 12 s. Past this many, brackets
# stand aside as a private-use character while the text is rendered (no link is made
# of them) and come back as themselves after.
MAX_LINK_BRACKETS = 300
_BRACKET_STAND_IN = "\ue05b"


def render_markdown(text: str) -> SafeString:
    aside = text.count("[") > MAX_LINK_BRACKETS
    if aside:
        text = text.replace(_BRACKET_STAND_IN, "").replace("[", _BRACKET_STAND_IN)
    html = md.markdown(text, extensions=["fenced_code", "tables", "sane_lists"])
    cleaned = nh3.clean(
        html,
        tags=_ALLOWED_TAGS,
        attributes={"a": {"href", "title"}, "code": {"class"}},
        url_schemes={"http", "https", "mailto"},
        link_rel="noopener noreferrer nofollow",
    )
    if aside:
        cleaned = cleaned.replace(_BRACKET_STAND_IN, "[")
    # nh3 has removed every tag, attribute and URL scheme not allowed above (docs/security.md).
    return mark_safe(cleaned)  # noqa: S308  # nosec B308 B703
