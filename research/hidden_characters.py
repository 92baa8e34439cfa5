"""Characters that render as nothing or reorder the text around them.

Bidirectional controls, zero-width and other format characters, line and paragraph
separators, control characters and blank fillers: a title that holds one can reverse the
page text after it, and code that holds one can read as other code than what runs. The
forms refuse them in one-line text (research.theses.refuse_hidden_characters) and the
review diff shows them as named escapes (reviews.diffs).
"""

from __future__ import annotations

import re
import unicodedata

# Anything but printable ASCII, tab and newline: where a hidden character can be.
MAYBE_HIDDEN = re.compile(r"[^\x20-\x7e\t\n]")


# Default-ignorable or blank characters that are not format characters: Hangul fillers
# and the braille blank render as a letter's width of nothing, variation selectors, the
# combining grapheme joiner and Khmer's inherent vowels as nothing at all. Python takes
# most of them inside identifiers, so `hidden\ufe00 = hidden.clamp(-1, 1)` read as a
# clamp of `hidden` and left it untouched.
_BLANK_OR_IGNORABLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]")


def is_hidden(character: str) -> bool:
    """Renders as nothing, or moves or breaks the text around it."""
    category = unicodedata.category(character)
    return (category in ("Cf", "Zl", "Zp") or (category == "Cc" and character not in "\t\n")
            or _BLANK_OR_IGNORABLE.match(character) is not None)


def character_name(character: str) -> str:
    return f"U+{ord(character):04X} {unicodedata.name(character, 'CONTROL CHARACTER')}"


def hidden_characters(text: str) -> list[str]:
    """The names of the hidden characters in `text`, each once, in order of appearance."""
    found = (match.group() for match in MAYBE_HIDDEN.finditer(text))
    return list(dict.fromkeys(character_name(c) for c in found if is_hidden(c)))
