"""The checks that read a candidate's source without running it.

A worker's evaluation runs the DSL check (dsl.static_check) and the protected-settings
check (protected.check) on every candidate beside what it measures; an imported results
file says it ran them, and a forged one would say so too. The lab runs them again, on
the source in the file, before it stores anything: the same functions, so an import
can never pass a check an evaluation would fail. `loads` here is the part of the
evaluation's `loads` guard that needs no process: the source compiles and defines
forward at its top level.
"""

from __future__ import annotations

import ast

from runners import python_source
from runners.harness import dsl as dsls
from runners.harness import imports, protected
from runners.harness.result import Guard


def _loads(source: str) -> Guard:
    try:
        tree = python_source.parse(source)
    except SyntaxError as error:
        return Guard("loads", "fail", f"not valid Python: {error.msg} (line {error.lineno})")
    if not any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "forward"
               for node in tree.body):
        return Guard("loads", "fail", "defines no top-level `def forward(...)`")
    return Guard("loads", "pass", "compiles and defines forward()")


def source_checks(source: str, dsl: str, kept_source: str | None) -> list[Guard]:
    """`loads`, the required-DSL check (for a DSL other than torch) and protected-settings
    against `kept_source`, in that order; a source that does not compile gets `loads` only."""
    loads = _loads(source)
    if loads.status == "fail":
        return [loads]
    guards = [loads]
    if dsl != "torch":
        guards.append(Guard("required-dsl", *dsls.static_check(source, dsl)))
    settings = protected.check(source, kept_source)
    if settings is not None:
        guards.append(Guard("protected-settings", *settings))
    return guards


def lib_checks(lib_files: list[dict], dsl: str) -> list[Guard]:
    """The required-DSL and protected-settings checks of a results file's shared code
    (its header's `lib_files`: path and source), each failure naming its file, as an
    evaluation runs them on the files a candidate imports."""
    files = [imports.LibFile(entry["path"], entry["source"].encode("utf-8")) for entry in lib_files]
    wrong_dsl, settings = imports.check(files, dsl)
    return [Guard(name, *found) for name, found in (("required-dsl", wrong_dsl),
                                                     ("protected-settings", settings)) if found]


def first_failure(guards: list[Guard]) -> Guard | None:
    return next((guard for guard in guards if guard.status == "fail"), None)
