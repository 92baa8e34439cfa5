"""A git diff as HTML table rows: line numbers, +/- marks, and syntax colours.

Each side's whole file is highlighted first (Pygments), so a line inside a docstring
or a multi-line string is coloured as what it is, and each diff line then takes its
highlighted text by line number. Everything that reaches the page is escaped here.

A diff must not show code other than what runs. Characters that render as nothing or
reorder the text around them (bidirectional controls, zero-width and other format
characters, line and paragraph separators, control characters) are shown as visible
escapes, named in each file's `hidden`, and lines split at "\n" only, as git and
Python split them: a U+2028 cannot start a line the diff's markers do not see.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from pygments.lexers import get_lexer_for_filename
from pygments.lexers.special import TextLexer
from pygments.token import STANDARD_TYPES
from pygments.util import ClassNotFound

from research.hidden_characters import MAYBE_HIDDEN, character_name, hidden_characters, is_hidden

_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@(.*)$")
# The highlighter reads a carriage return as a line break and drops a leading byte-order
# mark, while git's diff splits on newlines only: both stand in for themselves as
# private-use characters while the file is highlighted, so its lines stay the diff's.
_STAND_INS = {"\r": "\ue00d", "\ufeff": "\ue0ff"}
_STANDS_FOR = {stand_in: character for character, stand_in in _STAND_INS.items()}


def _revealed(escaped: str) -> str:
    """Escaped text with every hidden character replaced by a visible, named escape."""
    def visible(match: re.Match) -> str:
        character = _STANDS_FOR.get(match.group(), match.group())
        if not is_hidden(character):
            return character
        return (f'<span class="hidden-char" title="{character_name(character)}">'
                f'&lt;U+{ord(character):04X}&gt;</span>')
    return MAYBE_HIDDEN.sub(visible, escaped)


def _shown(text: str) -> SafeString:
    return mark_safe(_revealed(str(escape(text))))  # noqa: S308  # nosec B308 B703  (escaped first)


@dataclass
class DiffLine:
    kind: str  # "add", "del", "ctx" or "hunk"
    old: int | None
    new: int | None
    html: SafeString


@dataclass
class FileDiff:
    path: str
    lines: list[DiffLine] = field(default_factory=list)
    # The hidden characters in its changed and context lines (named, each once).
    hidden: list[str] = field(default_factory=list)

    @property
    def added(self) -> int:
        return sum(line.kind == "add" for line in self.lines)

    @property
    def removed(self) -> int:
        return sum(line.kind == "del" for line in self.lines)


def _css_class(token) -> str:
    while token not in STANDARD_TYPES:
        token = token.parent
    return STANDARD_TYPES[token]


def highlighted_lines(text: str, filename: str) -> list[str]:
    """The file as HTML, one string per line, each with its own balanced spans."""
    try:
        lexer = get_lexer_for_filename(filename, stripnl=False, ensurenl=False)
    except ClassNotFound:
        lexer = TextLexer(stripnl=False, ensurenl=False)
    lines: list[list[str]] = [[]]
    for character, stand_in in _STAND_INS.items():
        text = text.replace(character, stand_in)
    for token, value in lexer.get_tokens(text):
        css = _css_class(token)
        for index, piece in enumerate(value.split("\n")):
            if index:
                lines.append([])
            if piece:
                lines[-1].append(f'<span class="{css}">{_shown(piece)}</span>' if css else str(_shown(piece)))
    return ["".join(parts) for parts in lines]


def render_file(text: str, path: str) -> FileDiff:
    """A whole file as the diff shows its lines (highlighted, hidden characters named and
    shown as escapes), every line a context line numbered as it is in the file."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no line of its own
    shown = highlighted_lines("\n".join(lines), path)
    return FileDiff(path=path, hidden=hidden_characters(text), lines=[
        DiffLine(kind="ctx", old=None, new=number, html=mark_safe(html))  # noqa: S308  # nosec B308 B703
        for number, html in enumerate(shown, start=1)])


def render_diff(diff_text: str, *, old_file: Callable[[str], str | None],
                new_file: Callable[[str], str | None]) -> list[FileDiff]:
    """Parse `git diff` output; `old_file`/`new_file` give each side's full text by path."""
    files: list[FileDiff] = []
    old_lines: list[str] = []
    new_lines: list[str] = []
    old_no = new_no = 0

    def pick(lines: list[str], number: int, raw: str) -> SafeString:
        # Each line was built from escaped text and our own span tags (highlighted_lines).
        line = lines[number - 1] if 0 < number <= len(lines) else _shown(raw)
        return mark_safe(line)  # noqa: S308  # nosec B308 B703

    for raw in diff_text.split("\n"):
        if raw.startswith("diff --git "):
            path = raw.split(" b/", 1)[-1]
            files.append(FileDiff(path=path))
            old_lines = highlighted_lines(old_file(path) or "", path)
            new_lines = highlighted_lines(new_file(path) or "", path)
            continue
        if not files:
            continue
        current = files[-1]
        hunk = _HUNK.match(raw)
        if hunk:
            old_no, new_no = int(hunk.group(1)), int(hunk.group(2))
            current.lines.append(DiffLine("hunk", None, None, _shown(raw)))
            continue
        if not current.lines:
            continue  # the header: index, mode, ---/+++ lines
        current.hidden += [name for name in hidden_characters(raw[1:]) if name not in current.hidden]
        if raw.startswith("+"):
            current.lines.append(DiffLine("add", None, new_no, pick(new_lines, new_no, raw[1:])))
            new_no += 1
        elif raw.startswith("-"):
            current.lines.append(DiffLine("del", old_no, None, pick(old_lines, old_no, raw[1:])))
            old_no += 1
        elif raw.startswith(" "):
            current.lines.append(DiffLine("ctx", old_no, new_no, pick(new_lines, new_no, raw[1:])))
            old_no += 1
            new_no += 1
    return files
