"""Load a candidate file as a fresh module, or say in one line why it cannot be.

Only ever called in a child process: the judge never imports candidate code.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from runners import python_source

_MAX_LINE = 300


class CandidateError(Exception):
    """The candidate cannot be run at all: this rejects it, it is not a usage error."""


def one_line(error: BaseException) -> str:
    message = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    return shorten(text)


def shorten(text: str) -> str:
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 1] + "…"


@dataclass(frozen=True)
class Candidate:
    path: Path
    module: ModuleType
    forward: Callable[..., Any]


def load_candidate(path: Path) -> Candidate:
    # A new module name every load, so two loads of one file never share state.
    name = f"_candidate_{secrets.token_hex(6)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CandidateError(f"{path.name} cannot be loaded as a Python module")
    try:
        declared = python_source.foreign_encoding(path.read_bytes().decode("utf-8", errors="replace"))
    except OSError as error:
        raise CandidateError(f"{path.name} cannot be read: {one_line(error)}") from None
    if declared:
        # Python would run other text than every check read: never load it.
        raise CandidateError(f"{path.name} declares an encoding other than UTF-8 "
                             f"(line {declared[0]}: {declared[1]})")
    module = importlib.util.module_from_spec(spec)
    # DSL compilers (Triton, CuTe) look functions' modules up in sys.modules.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise CandidateError(
            f"{path.name} is not valid Python: {error.msg} (line {error.lineno})"
        ) from None
    except BaseException as error:  # SystemExit too: a candidate may not end the run
        raise CandidateError(f"importing {path.name} raised {one_line(error)}") from None
    forward = getattr(module, "forward", None)
    if not callable(forward):
        raise CandidateError(f"{path.name} defines no forward() function")
    return Candidate(path=path, module=module, forward=forward)
