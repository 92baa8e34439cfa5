"""Reading a candidate's Python without running it, whatever it holds.

`ast.parse` raises RecursionError or MemoryError, not SyntaxError, on a source that
nests past the parser's limits (`1+1+…` sixty thousand terms long, `not not … 1`): an
imported kernel of that shape answered the import with a 500 and the command with a
traceback. Here it is a SyntaxError like any other unreadable source, so every caller's
refusal covers it.

Every check reads a source as UTF-8 text, but Python decodes a file by the encoding its
first two lines declare (PEP 263): under `# coding: utf-7` a line that reads as a comment
runs as code. `foreign_encoding` names such a declaration, so the checks can refuse what
they would misread.
"""

from __future__ import annotations

import ast
import codecs
import re

# PEP 263's declaration, as Python's tokenizer finds it on the first or second line.
_CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.ASCII)
# What the checks read a source as: UTF-8, of which ASCII is a part.
_READ_AS = {"utf-8", "utf-8-sig", "ascii"}

TOO_DEEP = "nests too deeply for Python's parser (an expression or block thousands of levels deep)"


def parse(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except (RecursionError, MemoryError):
        raise SyntaxError(TOO_DEEP, ("<candidate>", 1, 0, "")) from None


def foreign_encoding(source: str) -> tuple[int, str] | None:
    """(line, declaration) where the source declares an encoding other than UTF-8, which
    Python would decode it by instead of the text every check reads; None otherwise."""
    for number, line in enumerate(source.splitlines()[:2], start=1):
        found = _CODING.match(line)
        if found:
            try:
                name = codecs.lookup(found.group(1)).name
            except LookupError:
                name = found.group(1)
            return None if name in _READ_AS else (number, line.strip())
    return None
