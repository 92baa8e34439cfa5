"""Markdown from users, rendered to HTML that cannot carry script.

A text's HTML is kept in the cache (Redis, shared by the web processes) under a digest
of the text and of the rendering itself (this file, the Markdown and nh3 versions): a
thesis's idea was re-rendered at every view of its review page, a fifth of that page's
own time. A changed text or renderer is a new key; nothing is ever stale.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

import markdown as md
import nh3
from django.core.cache import cache
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


KEEP_S = 7 * 24 * 3600
_RENDERING = hashlib.sha256(Path(__file__).read_bytes() + metadata.version("markdown").encode()
                            + metadata.version("nh3").encode()).hexdigest()[:16]


def render_markdown(text: str) -> SafeString:
    key = f"markdown:{_RENDERING}:{hashlib.sha256(text.encode()).hexdigest()}"
    html = cache.get(key)
    if html is None:
        html = _rendered(text)
        cache.set(key, html, KEEP_S)
    # nh3 removed every tag, attribute and URL scheme not allowed above (docs/security.md).
    return mark_safe(html)  # noqa: S308  # nosec B308 B703


def _rendered(text: str) -> str:
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
    return cleaned
