"""The results file of a sweep run by the harness itself (`python -m runners.harness sweep`).

JSON Lines, one object a line, written and flushed one line at a time so a run that
stops leaves a valid prefix:

- line 1, the header: what was swept and how (op, kernel and its source, strategy,
  seed, device, hardware, workloads, the kernel timed against, the harness's version),
  and `lib_files`: the shared code the kernel imports (runners.harness.imports), each
  file's path, sha256 and source;
- then one line per evaluated candidate: `{"number", "params", "source", "result"}`,
  numbered 1, 2, 3, …, `result` being the `evaluate --json` object (CONTRACTS §4).

`read` checks a whole file without Django, so a GPU host can check a file before it
uploads it and the app refuses a bad one before writing anything (research.importing).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from runners.harness.dsl import DSLS
from runners.space import STRATEGIES

FORMAT = "kernel-lab-results"
VERSION = 1
DEVICES = ("cpu", "cuda")
VERDICTS = ("win", "no-gain", "rejected")
GUARD_STATUSES = ("pass", "warn", "fail")
KERNEL_NAME = re.compile(r"[A-Za-z0-9_]{1,100}")
# Deeper than any line the harness writes (a result nests about five levels); deeper
# input is refused before anything walks it, so no walk can exhaust Python's stack.
MAX_DEPTH = 32
# JSON amplifies (`{},` is 3 bytes of text, ~70 of dict): the characters that open or
# separate values bound the objects a parse makes, and are counted before parsing. A
# sweep's file of 500 candidates (the most a sweep has) on 50 workloads holds under a million.
MAX_JSON_TOKENS = 4_000_000


class ResultsFileError(ValueError):
    """The file is not a results file this harness can read; the message names the line."""


@dataclass(frozen=True)
class CandidateLine:
    number: int
    params: dict[str, Any]
    source: str
    result: dict[str, Any]


@dataclass(frozen=True)
class ResultsFile:
    header: dict[str, Any]
    candidates: list[CandidateLine]


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(v) and v > 0 for v in value)


_HEADER_FIELDS: dict[str, tuple[str, Any]] = {
    "op": ("a string", lambda v: isinstance(v, str) and bool(v)),
    "kernel": ("a kernel name (letters, digits, _)", lambda v: isinstance(v, str) and KERNEL_NAME.fullmatch(v)),
    "kernel_source": ("a string", lambda v: isinstance(v, str) and bool(v)),
    "strategy": (f"one of {', '.join(STRATEGIES)}", lambda v: v in STRATEGIES),
    "seed": ("a whole number", lambda v: _is_int(v) and -(2**63) <= v < 2**63),
    "budget": ("a positive whole number", lambda v: _is_int(v) and v > 0),
    "device": (f"one of {', '.join(DEVICES)}", lambda v: v in DEVICES),
    "hardware": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "dsl": (f"one of {', '.join(DSLS)}", lambda v: v in DSLS),
    "context_lengths": ("a list of positive whole numbers", _int_list),
    "batch_sizes": ("a list of positive whole numbers", _int_list),
    "baseline_kernel": ("a kernel name (letters, digits, _)", lambda v: isinstance(v, str) and KERNEL_NAME.fullmatch(v)),
    "baseline_source": ("a string", lambda v: isinstance(v, str) and bool(v)),
    "harness": ("an object", lambda v: isinstance(v, dict)),
}


MACHINE_FIELDS = 40
MACHINE_TEXT = 200


def machine_problem(machine: Any) -> str | None:
    """What is wrong with a `machine` object (runners.harness.machine), or None: pages
    show it field by field, so it is a small object of short scalars or absent."""
    if machine is None:
        return None
    if not isinstance(machine, dict) or len(machine) > MACHINE_FIELDS:
        return f"'machine' must be an object of at most {MACHINE_FIELDS} fields, or null"
    for key, value in machine.items():
        if len(key) > MACHINE_TEXT or not (value is None or isinstance(value, (bool, int, float))
                                           or (isinstance(value, str) and len(value) <= MACHINE_TEXT)):
            return f"'machine' field {key[:40]!r} must be a number, true/false, null or a short string"
    return None


def _check_header(header: Any) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ResultsFileError(f"line 1: not a results file header (\"format\": \"{FORMAT}\" expected)")
    if header.get("version") != VERSION:
        raise ResultsFileError(
            f"line 1: results file version {header.get('version')!r}; this app reads version {VERSION}")
    for name, (expected, valid) in _HEADER_FIELDS.items():
        if name not in header:
            raise ResultsFileError(f"line 1: the header has no {name!r}")
        if not valid(header[name]):
            raise ResultsFileError(f"line 1: {name!r} must be {expected}")
    problem = machine_problem(header.get("machine"))
    if problem:
        raise ResultsFileError(f"line 1: {problem}")
    # Copied onto every imported candidate's provenance: short, like the machine's fields.
    run, commit = header.get("run"), header["harness"].get("commit")
    for name, value in (("run", run), ("harness.commit", commit)):
        if value is not None and not (isinstance(value, str) and len(value) <= MACHINE_TEXT):
            raise ResultsFileError(f"line 1: {name!r} must be a string of at most {MACHINE_TEXT} "
                                   "characters, or absent")
    for name in ("kernel_source", "baseline_source"):
        problem = source_problem(header[name]) or _source_length_problem(header[name])
        if problem:
            raise ResultsFileError(f"line 1: {name!r} {problem}")
    problem = _lib_files_problem(header.get("lib_files", []))
    if problem:
        raise ResultsFileError(f"line 1: {problem}")
    # Every other text of the header (its hardware, its harness's versions) is shown or
    # copied into the sweep's context: short, like a result's.
    problem = _text_problem({key: value for key, value in header.items()
                             if key not in ("kernel_source", "baseline_source", "lib_files")}, "the header")
    if problem:
        raise ResultsFileError(f"line 1: {problem}")


LIB_PATH = re.compile(r"[A-Za-z0-9_]{1,100}(/[A-Za-z0-9_]{1,100}){0,8}\.py")


def _lib_files_problem(files: Any) -> str | None:
    """What is wrong with the header's `lib_files`, or None: each a file of the lib
    folder by its relative path, its source, and the sha256 of that source's bytes."""
    if not isinstance(files, list):
        return "'lib_files' must be a list of {\"path\", \"sha256\", \"source\"}"
    for entry in files:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("sha256"), str) and isinstance(entry.get("source"), str)):
            return "'lib_files' must be a list of {\"path\", \"sha256\", \"source\"}"
        if not LIB_PATH.fullmatch(entry["path"]):
            return f"lib file {entry['path'][:100]!r}: a relative path of a .py file, with letters, digits and _"
        problem = source_problem(entry["source"]) or _source_length_problem(entry["source"])
        if problem:
            return f"lib file {entry['path']} {problem}"
        if hashlib.sha256(entry["source"].encode("utf-8")).hexdigest() != entry["sha256"]:
            return f"lib file {entry['path']}: its sha256 is not that of its source"
    if len({entry["path"] for entry in files}) != len(files):
        return "'lib_files' names a file twice"
    return None


def source_problem(source: str) -> str | None:
    """A kernel source the review's diff could not show as Python reads it: a carriage
    return ends a line for Python but not for a diff split on newlines, and a
    byte-order mark is dropped by the highlighter, so the lines would drift apart."""
    if "\r" in source:
        return "holds a carriage return: save it with \\n line endings only"
    if "\ufeff" in source:
        return "holds a byte-order mark (U+FEFF): save it without one"
    return None


# A result's texts are the harness's own one-line details (at most a few hundred
# characters on every run recorded); each becomes page text on the review page, so a
# 40 MB guard detail made a 40 MB page. Generous bounds, far past any real result.
MAX_RESULT_TEXT = 8_000
MAX_RESULT_TEXT_TOTAL = 1_000_000


# Kernel sources are the one long text a file carries (an 823-line kernel is ~40 KB).
MAX_SOURCE_TEXT = 1_000_000


def _texts(value: Any, path: str):
    """Every string below `value`, keys included (a 5 MB key is as much page text)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path} key", str(key)
            yield from _texts(item, f"{path}.{str(key)[:40]}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _texts(item, f"{path}[{index}]")


def _text_problem(value: Any, name: str) -> str | None:
    """The first text of `value` past MAX_RESULT_TEXT, or their sum past the total."""
    total = 0
    for path, text in _texts(value, name):
        if len(text) > MAX_RESULT_TEXT:
            return f"'{path[:80]}' holds {len(text):,} characters; a file's texts are at most {MAX_RESULT_TEXT:,}"
        total += len(text)
    if total > MAX_RESULT_TEXT_TOTAL:
        return f"the texts of {name} hold {total:,} characters in all; at most {MAX_RESULT_TEXT_TOTAL:,}"
    return None


def _source_length_problem(source: str) -> str | None:
    if len(source) > MAX_SOURCE_TEXT:
        return f"holds {len(source):,} characters; a kernel source is at most {MAX_SOURCE_TEXT:,}"
    return None


def _check_result(result: Any, header: dict[str, Any]) -> str | None:
    """What is wrong with one `evaluate --json` object, or None."""
    if not isinstance(result, dict):
        return "'result' must be an object"
    problem = _text_problem(result, "result")
    if problem:
        return problem
    for name in ("op", "device"):
        if result.get(name) != header[name]:
            return f"the result's {name} {result.get(name)!r} is not the header's {header[name]!r}"
    if result.get("verdict") not in VERDICTS:
        return f"'verdict' must be one of {', '.join(VERDICTS)}"
    if not isinstance(result.get("correct"), bool):
        return "'correct' must be true or false"
    guards = result.get("guards")
    if not isinstance(guards, list) or not all(
            isinstance(g, dict) and isinstance(g.get("name"), str) and g.get("status") in GUARD_STATUSES
            and isinstance(g.get("detail", ""), str) for g in guards):
        return "'guards' must be a list of {\"name\", \"status\": pass|warn|fail, \"detail\"}"
    workloads = result.get("workloads")
    if not isinstance(workloads, list):
        return "'workloads' must be a list"
    for w in workloads:
        if not isinstance(w, dict) or not isinstance(w.get("name"), str):
            return "each workload must be an object with a 'name'"
        if [v.get("name") for v in workloads].count(w["name"]) > 1:
            return f"workload {w['name']!r} appears twice"
        for key in ("baseline_ms", "candidate_ms", "speedup", "p_value"):
            if w.get(key) is not None and not _is_number(w[key]):
                return f"workload {w['name']!r}: {key!r} must be a number or null"
        ci = w.get("speedup_ci")
        if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(
                v is None or _is_number(v) for v in ci)):
            return f"workload {w['name']!r}: 'speedup_ci' must be [low, high] or null"
        if not isinstance(w.get("significant", False), bool):
            return f"workload {w['name']!r}: 'significant' must be true or false"
    for key in ("e2e", "dispatch"):
        if result.get(key) is not None and not isinstance(result[key], dict):
            return f"{key!r} must be an object or null"
    problem = machine_problem(result.get("machine"))
    if problem:
        return problem
    # The shared files a candidate ran with are those the header holds, byte for byte.
    held = {entry["path"]: entry["sha256"] for entry in header.get("lib_files", [])}
    ran = result.get("lib_files", [])
    if not isinstance(ran, list) or not all(isinstance(entry, dict) for entry in ran):
        return "'lib_files' must be a list of {\"path\", \"sha256\"}"
    for entry in ran:
        if not isinstance(entry.get("path"), str) or held.get(entry["path"]) != entry.get("sha256"):
            return (f"the result ran lib file {str(entry.get('path'))[:100]!r} "
                    f"(sha256 {str(entry.get('sha256'))[:16]}), which the header does not hold")
    # CONTRACTS §4: the verdict follows from the rest, so a hand-edited one shows.
    failed = not result["correct"] or any(g["status"] == "fail" for g in guards)
    if failed != (result["verdict"] == "rejected"):
        return ("'verdict' is 'rejected' exactly when 'correct' is false or a guard failed; "
                f"here it is {result['verdict']!r}")
    if result["verdict"] == "win" and not (
            result.get("dispatch") and any(w.get("significant") for w in workloads)):
        return "a 'win' needs a dispatch range and a significantly faster workload"
    if result["verdict"] == "win" and result.get("e2e") is None and _judged_in_a_decode_loop(result["op"]):
        return (f"a 'win' for {result['op']} needs its decode loop's report ('e2e'): without it "
                "the kernel was never judged as a server calls it")
    return None


def _judged_in_a_decode_loop(op_name: str) -> bool:
    """Whether the op's end-to-end check is the decode loop a server runs (Op.decode_steps)."""
    from runners.ops import UnknownOpError, get_op  # the ops load torch: only a win asks

    try:
        return bool(get_op(op_name).decode_steps)
    except UnknownOpError:
        return False  # the importer refuses an op it does not know, with its own words


def _walk_problem(value: Any, limit: int) -> str | None:
    """One walk of a parsed line, without recursion: "deep" where lists and objects nest
    more than `limit` levels (before anything else), "nul" where a string or key holds
    a NUL, else None."""
    nul = False
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            nul = nul or "\0" in item
        elif isinstance(item, (list, dict)):
            if depth > limit:
                return "deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending += [(child, depth + 1) for child in children]
    return "nul" if nul else None


def _parse_line(text: str, number: int) -> Any:
    too_deep = f"line {number}: lists and objects nest deeper than {MAX_DEPTH} levels"
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ResultsFileError(too_deep) from None
    except ValueError as error:
        hint = (" (a run that stopped mid-line leaves a partial last line: remove it to import "
                "the rest)") if number > 1 else ""
        raise ResultsFileError(f"line {number}: not valid JSON: {error}{hint}") from None
    problem = _walk_problem(value, MAX_DEPTH)
    if problem == "deep":
        raise ResultsFileError(too_deep)
    # JSON may spell a NUL (\u0000); no source, name or database column holds one.
    if problem == "nul":
        raise ResultsFileError(f"line {number}: a string contains a NUL character")
    return value


def read(data: bytes) -> ResultsFile:
    """Parse and check a whole results file; ResultsFileError names the first bad line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ResultsFileError(f"the file is not UTF-8 text (byte {error.start})") from None
    tokens = sum(text.count(character) for character in "{[,:\n")  # lines too: each is a list entry
    if tokens > MAX_JSON_TOKENS:
        raise ResultsFileError(f"the file holds {tokens:,} JSON values and separators; at most "
                               f"{MAX_JSON_TOKENS:,} are read (split the sweep into several files)")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise ResultsFileError("the file is empty")
    header = _parse_line(lines[0], 1)
    _check_header(header)
    candidates = []
    for number, line in enumerate(lines[1:], start=2):
        entry = _parse_line(line, number)
        if not isinstance(entry, dict):
            raise ResultsFileError(f"line {number}: a candidate line must be a JSON object")
        for key, expected, valid in (
                ("number", f"{len(candidates) + 1} (candidates are numbered in order)",
                 lambda v: _is_int(v) and v == len(candidates) + 1),
                ("params", "an object", lambda v: isinstance(v, dict)),
                ("source", "the candidate's source", lambda v: isinstance(v, str) and bool(v))):
            if not valid(entry.get(key)):
                raise ResultsFileError(f"line {number}: {key!r} must be {expected}")
        problem = source_problem(entry["source"]) or _source_length_problem(entry["source"])
        if problem:
            raise ResultsFileError(f"line {number}: candidate {entry['number']}: its source {problem}")
        problem = _text_problem(entry["params"], "params")
        if problem:
            raise ResultsFileError(f"line {number}: candidate {entry['number']}: {problem}")
        problem = _check_result(entry.get("result"), header)
        if problem:
            raise ResultsFileError(f"line {number}: candidate {entry['number']}: {problem}")
        candidates.append(CandidateLine(entry["number"], entry["params"], entry["source"], entry["result"]))
    if not candidates:
        raise ResultsFileError("the file has a header but no candidate lines")
    if len(candidates) > header["budget"]:
        raise ResultsFileError(
            f"line {len(candidates) + 1}: more candidates ({len(candidates)}) than the header's budget "
            f"({header['budget']})")
    return ResultsFile(header=header, candidates=candidates)
