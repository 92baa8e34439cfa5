"""Reading a candidate's Python without running it, whatever it holds.

`ast.parse` raises RecursionError or MemoryError, not SyntaxError, on a source that
nests past the parser's limits (`1+1+…` sixty thousand terms long, `not not … 1`): an
imported kernel of that shape answered the import with a 500 and the command with a
traceback. Here it is a SyntaxError like any other unreadable source, so every caller's
refusal covers it.
"""

from __future__ import annotations

import ast

TOO_DEEP = "nests too deeply for Python's parser (an expression or block thousands of levels deep)"


def parse(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except (RecursionError, MemoryError):
        raise SyntaxError(TOO_DEEP, ("<candidate>", 1, 0, "")) from None
