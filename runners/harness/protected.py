"""What a candidate may not change, read from its source and its diff against the kept kernel.

A candidate changes how its kernel computes; it never changes what the harness holds
fixed: tolerances, workloads and context lengths, batch sizes, the harness's own files,
CUDA-graph and all-reduce settings, torch's backend flags, the environment (reward-hacks.md:
"loosen the tolerance", "limit the context window", "shrink max_num_seqs", "disable CUDA
graphs", "disable custom all-reduce"). The configuration watch (configuration.py) sees
such a change when it happens; this check names the line that makes it, and catches one
on a branch the run never took.

Only what the candidate adds counts: a finding the kept kernel already has (which a
reviewer accepted) is not held against it. The source is parsed with `ast`, never run.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass

from runners import python_source

# What a stored-to or called name means, by the dotted path's last parts.
_CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("a tolerance", re.compile(r"(?i)(^|\.)(atol|rtol|tolerances?)(\.|$)")),
    ("the workloads or context lengths", re.compile(
        r"(?i)(^|\.)(workloads?|build_workloads|context_lengths?|default_context_lengths|"
        r"context_length_range|max_(context|seq_len|model_len|num_batched_tokens)|shapes|hidden)"
        r"(\.|$)")),
    ("the batch sizes", re.compile(
        r"(?i)(^|\.)(batch_sizes?|default_batch_sizes|max_batch_size|max_num_seqs)(\.|$)")),
    ("a CUDA-graph setting", re.compile(r"(?i)(cudagraph|cuda_graph|enforce_eager)")),
    ("an all-reduce setting", re.compile(r"(?i)(all_?reduce|nccl)")),
    ("a torch backend flag", re.compile(
        r"^torch\.(backends\.|set_float32_matmul_precision|set_flush_denormal|"
        r"use_deterministic_algorithms|set_default_dtype|set_num_threads|"
        r"set_num_interop_threads|cuda\.set_sync_debug_mode|set_grad_enabled|_C\.)")),
    ("the environment", re.compile(r"^os\.(environ|putenv|unsetenv)")),
]

# Calls that change state by themselves, whatever their result is used for.
_SETTERS = re.compile(
    r"^(torch\.(set_float32_matmul_precision|set_flush_denormal|use_deterministic_algorithms|"
    r"set_default_dtype|set_num_threads|set_num_interop_threads|cuda\.set_sync_debug_mode|"
    r"distributed\.init_process_group)|os\.(putenv|unsetenv)|"
    r"os\.environ\.(update|setdefault|pop|popitem|clear)|setattr|delattr)$")

_HARNESS = ("runners.harness", "runners.ops", "runners.e2e")
# Stores into these are monkeypatching what the harness, the baseline or torch rely on.
_LIBRARIES = ("torch.", "triton.", "cutlass.", "numpy.", "time.", "gc.", "sys.", "threading.",
              "os.", "builtins.")


@dataclass(frozen=True)
class Finding:
    line: int
    what: str  # "changes a tolerance", "imports the harness"
    code: str  # the statement, one line, for the reviewer and for matching the kept kernel

    def __str__(self) -> str:
        return f"line {self.line} {self.what}: `{self.code}`"


class _Names:
    """Local name -> the dotted path it was imported as (`np` -> numpy)."""

    def __init__(self, tree: ast.Module) -> None:
        self.imported: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    self.imported[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def dotted(self, node: ast.expr) -> str | None:
        """`torch.backends.cuda.matmul.allow_tf32` for an attribute chain rooted at an
        import; None for one rooted at the candidate's own names."""
        parts = []
        while True:
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            elif isinstance(node, ast.Subscript):
                key = node.slice
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    parts.append(key.value)
                node = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "type" and node.args:
                node = node.args[0]  # type(get_op("x")).attr is the op's class attribute
            elif isinstance(node, ast.Call):
                node = node.func  # get_op("rmsnorm").tolerances -> runners.ops.get_op.tolerances
            else:
                break
        if not isinstance(node, ast.Name) or node.id not in self.imported:
            return None
        return ".".join([self.imported[node.id], *reversed(parts)])


def _category(path: str) -> str | None:
    for category, pattern in _CATEGORIES:
        if pattern.search(path):
            return category
    if path.startswith(_HARNESS):
        return "the harness's own state"
    if path.startswith(_LIBRARIES):
        return "a library's global state"
    return None


def _stores(tree: ast.Module) -> list[tuple[ast.stmt, list[ast.expr]]]:
    found: list[tuple[ast.stmt, list[ast.expr]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            found.append((node, node.targets))
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found.append((node, [node.target]))
        elif isinstance(node, ast.Delete):
            found.append((node, node.targets))
    return found


def _code(source: str, node: ast.AST) -> str:
    text = ast.get_source_segment(source, node) or ast.unparse(node)
    text = " ".join(text.split())
    return text if len(text) <= 100 else text[:99] + "…"


def findings(source: str) -> list[Finding]:
    """Every statement of the source that changes something the harness holds fixed."""
    tree = python_source.parse(source)
    names = _Names(tree)
    found: list[Finding] = []
    if declared := python_source.foreign_encoding(source):
        # Python would run other text than this check (and the reviewer) reads.
        found.append(Finding(declared[0], "declares an encoding other than UTF-8, which Python "
                             "would decode it by instead of the text every check reads", declared[1]))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            modules = [module] if module else [alias.name for alias in node.names]
            if any(name and name.startswith(_HARNESS) for name in modules):
                found.append(Finding(node.lineno, "imports the harness", _code(source, node)))
    for statement, targets in _stores(tree):
        for target in targets:
            path = names.dotted(target)
            category = _category(path) if path else None
            if category:
                found.append(Finding(statement.lineno, f"changes {category}", _code(source, statement)))
                break
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            path = names.dotted(node.func)
            if path is None and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
                path = node.func.id
            if path is None or not _SETTERS.match(path):
                continue
            if path in ("setattr", "delattr"):
                target = names.dotted(node.args[0]) if node.args else None
                attribute = node.args[1] if len(node.args) > 1 else None
                if target is None:
                    continue  # the candidate's own objects
                if isinstance(attribute, ast.Constant):
                    target = f"{target}.{attribute.value}"
                path = target
            else:
                # os.environ.update(NCCL_ALGO=...), os.putenv("NCCL_ALGO", ...): the
                # variable's name says which setting it is.
                named = [arg.value for arg in node.args
                         if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
                path = ".".join([path, *named, *(k.arg for k in node.keywords if k.arg)])
            found.append(Finding(node.lineno, f"changes {_category(path) or 'a global setting'}",
                                 _code(source, node)))
    return sorted(set(found), key=lambda finding: (finding.line, finding.what))


def new_findings(candidate: str, kept: str | None) -> list[Finding]:
    """The candidate's findings less those the kept kernel already makes (same code,
    any line), so a candidate is judged on what it changes."""
    found = findings(candidate)
    if not kept:
        return found
    try:
        accepted = Counter(finding.code for finding in findings(kept))
    except SyntaxError:
        return found
    fresh = []
    for finding in found:
        if accepted[finding.code]:
            accepted[finding.code] -= 1
        else:
            fresh.append(finding)
    return fresh


def check(candidate: str, kept: str | None) -> tuple[str, str] | None:
    """("pass" | "fail", evidence) for the `protected-settings` guard; None for a source
    that is not Python, which the `loads` guard reports."""
    try:
        fresh = new_findings(candidate, kept)
    except SyntaxError:
        return None
    if not fresh:
        return "pass", ("changes no tolerance, workload, batch size, harness file, CUDA-graph, "
                        "all-reduce, backend or environment setting"
                        + (" beyond the kept kernel's" if kept else ""))
    shown = "; ".join(str(finding) for finding in fresh[:3])
    more = f"; and {len(fresh) - 3} more" if len(fresh) > 3 else ""
    return "fail", f"the candidate changes what the harness holds fixed: {shown}{more}"
