"""The kernel workspace: the git repository that is the source of truth for kernel code.

Every git call of the app is in this module. The repository is bare (nobody works in a
checkout of it; `git clone` it to look around) and laid out as:

    main                                  the kept kernels; every change is the seed, a keep
                                          or the undo of one
      README.md                           what is here
      dispatch.json                       per op and hardware class, its kept kernels newest
                                          first, with the size range each one serves
      kernels/<op>/<hardware>/kept.py     the op's current kept kernel on that hardware class
      kernels/lib/<module>.py             the shared kernel code: what a kernel imports as
                                          runners.kernel_lib.<module>, seeded with the shipped
                                          runners/kernel_lib
    candidate/<sweep>-<number>            one candidate: commits that replace
                                          kernels/<op>/<hardware>/kept.py, forked from main's head when
                                          its sweep started, so `git diff main...<branch>` is
                                          exactly its change against the kept kernel
    archive/<sweep>-<number>-r<revision>  a reverted revision: its branch renamed, so the
                                          live names show only what still waits or was kept

A sweep whose kernel is not the kept one gets one commit that swaps the kernel in (at
its shipped PARAMS); each candidate forks from it with a commit that rewrites only the
PARAMS literal, so a parameter-only candidate's own commit shows just the changed values.

Writes build objects first (git fast-import, which takes author and committer in its
stream, so no git identity is ever read from or written to any config) and then move
refs in one compare-and-swap `update-ref` transaction; that move is the only change
anyone sees. Writers across processes are serialised by a file lock, taken before any
database transaction that moves refs, always in that order.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from research.hardware import HARDWARE
from runners import ops
from runners.harness.imports import SHIPPED_LIB

MAIN = "main"
DISPATCH_PATH = "dispatch.json"
# The shared kernel code: the lib folder (runners.harness.imports) of every commit.
LIB_DIR = "kernels/lib"
LOCK_NAME = "kernel-lab.lock"
GIT_TIMEOUT_S = 60

README = """\
# Kernel workspace

Kept kernels of Kernel Lab. Written only by the app; clone it to read it.

- `kernels/<op>/<hardware>/kept.py`: the op's current kept kernel on a hardware class
  (`cpu`, `h100`, `h200`, `b200`): a win on one class never becomes another's kernel. The
  harness times every new candidate against its class's file as it was on `main` when the
  candidate's sweep started.
- `kernels/lib/<module>.py`: the shared kernel code, which a kernel imports as
  `runners.kernel_lib.<module>`. A candidate is evaluated with its own commit's modules
  (the kept kernel it is timed against, with those of its sweep's base), so a change to
  one is part of the candidate, in its diff and, once kept, on `main`.
- `dispatch.json`: per op and hardware class, the kept kernels newest first. Each entry
  names the commit whose kept file is that kernel and the size range (`axis`, `min`,
  `max`, inclusive; null for every size) it was kept for. For a size, the first entry
  whose range holds it serves; the last entry, the shipped baseline, holds every size.
- `candidate/<sweep>-<number>`: one branch per candidate; `git diff main...<branch>` is
  its change against the kept kernel.
- `archive/<sweep>-<number>-r<revision>`: reverted candidates.
- Merges into `main` are authored by the thesis author and carry a `Reviewed-by:`
  trailer naming the person who kept the kernel.
- An undone keep is a commit of its own on `main`, authored by the reviewer who undid
  it: the kernel from before that keep is back and its dispatch entry is gone.
"""


class WorkspaceError(RuntimeError):
    """A git call failed, or the workspace is not in the shape this module writes."""


class WorkspaceConflict(WorkspaceError):
    """The main line changed a file a candidate changes since the candidate's base."""


@dataclass(frozen=True)
class Identity:
    name: str
    email: str


KERNEL_LAB = Identity("Kernel Lab", "kernel-lab@kernel-lab.invalid")


def identity_of(user) -> Identity:
    # Users without an email get an address in .invalid (RFC 2606): clearly not real.
    name = (user.get_full_name() or "").strip() or user.get_username()
    return Identity(name, (user.email or "").strip() or f"{user.get_username()}@kernel-lab.invalid")


@dataclass(frozen=True)
class NewCommit:
    """A commit to build. Parents are commit ids, or ":<n>" for the n-th commit built in
    the same batch (1-based). A file mapped to None is deleted."""

    parents: list[str]
    files: dict[str, str | None]
    message: str
    author: Identity
    committer: Identity = KERNEL_LAB


@dataclass(frozen=True)
class RefUpdate:
    """Move `ref` to `new` (None: delete it) if it is still at `old` (None: must not exist;
    omit the check with `check=False`)."""

    ref: str
    new: str | None
    old: str | None = None
    check: bool = True


@dataclass(frozen=True)
class Merge:
    commit: str
    previous_main: str
    files: list[str] = field(default_factory=list)


def path() -> Path:
    return Path(settings.KERNEL_WORKSPACE)


def kept_path(op: str, hardware: str) -> str:
    if hardware not in HARDWARE:
        raise WorkspaceError(f"unknown hardware class {hardware!r}")
    return f"kernels/{op}/{hardware}/kept.py"


# Before kept kernels were per hardware class: one file per op, shared by every class.
def _shared_kept_path(op: str) -> str:
    return f"kernels/{op}/kept.py"


def candidate_branch(sweep_id: int, number: int) -> str:
    return f"candidate/{sweep_id}-{number}"


def archive_branch(sweep_id: int, number: int, revision: int) -> str:
    return f"archive/{sweep_id}-{number}-r{revision}"


def _heads(branch: str) -> str:
    return branch if branch.startswith("refs/") else f"refs/heads/{branch}"


# -- running git ---------------------------------------------------------------------

def _git(*args: str, stdin: bytes | None = None, in_workspace: bool = True) -> str:
    return _git_bytes(*args, stdin=stdin, in_workspace=in_workspace).decode(errors="replace")


def _git_bytes(*args: str, stdin: bytes | None = None, in_workspace: bool = True) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Never read the machine's or the user's git config: no hooks, no aliases, no
    # identity from elsewhere; what this module passes is all git sees.
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0",
               LC_ALL="C")
    command = [
        "git", "-c", f"user.name={KERNEL_LAB.name}", "-c", f"user.email={KERNEL_LAB.email}",
        "-c", "core.hooksPath=/dev/null", *(["--git-dir", str(path())] if in_workspace else []), *args,
    ]
    try:
        done = subprocess.run(command, input=stdin, capture_output=True, env=env,
                              timeout=GIT_TIMEOUT_S, check=False)
    except FileNotFoundError as error:
        raise WorkspaceError("git is not installed: the kernel workspace needs it") from error
    except subprocess.TimeoutExpired as error:
        raise WorkspaceError(f"git {args[0]} took longer than {GIT_TIMEOUT_S} s in {path()}") from error
    if done.returncode != 0:
        reason = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise WorkspaceError(f"git {args[0]} failed in {path()}: {reason}")
    return done.stdout


_held = threading.local()


@contextmanager
def lock() -> Iterator[None]:
    """Exclusive use of the workspace for a write; re-entrant within one thread."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    folder = path()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- reading -------------------------------------------------------------------------

def resolve(rev: str) -> str | None:
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip() or None
    except WorkspaceError:
        return None


def main_head() -> str:
    head = resolve(_heads(MAIN))
    if head is None:
        raise WorkspaceError(f"the workspace at {path()} has no {MAIN} branch")
    return head


def read_file(rev: str, file: str) -> str | None:
    """A file's text at a commit; None when the commit does not have it."""
    try:
        return _git("cat-file", "blob", f"{rev}:{file}")
    except WorkspaceError:
        if resolve(rev) is None:
            raise
        return None


def dispatch_table(rev: str = MAIN) -> dict[str, dict[str, list[dict]]]:
    """op -> hardware class -> its kept kernels, newest first."""
    text = read_file(_heads(rev) if rev == MAIN else rev, DISPATCH_PATH)
    if text is None:
        raise WorkspaceError(f"{DISPATCH_PATH} is missing at {rev}")
    return json.loads(text)


def dispatch_entries(op: str, hardware: str, rev: str = MAIN) -> list[dict]:
    return (dispatch_table(rev).get(op) or {}).get(hardware) or []


@dataclass(frozen=True)
class KeptKernel:
    commit: str  # main's head
    source: str
    name: str  # as in dispatch.json: "baseline", or the kept candidate's kernel


def kept_kernel(op: str, hardware: str) -> KeptKernel:
    """The op's kept kernel on `hardware` at main's head, seeding the workspace when needed."""
    ensure()
    head = main_head()
    source = read_file(head, kept_path(op, hardware))
    entries = dispatch_entries(op, hardware, head)
    if source is None or not entries:
        raise WorkspaceError(f"{kept_path(op, hardware)} or its dispatch entry is missing on {MAIN} "
                             f"at {head[:12]}")
    return KeptKernel(commit=head, source=source, name=entries[0].get("kernel") or "kept")


# Main's head and every kept file there, so that the pages that ask on every request
# (the queue's count is on every page) read git once per keep, not once per view.
_kept_at: dict[str, dict[tuple[str, str], str]] = {}


def kept_sources() -> dict[tuple[str, str], str]:
    """The kept kernel's source of every (op, hardware class) with one, at main's head;
    none before the workspace exists (nothing was timed against anything yet)."""
    head = resolve(_heads(MAIN)) if (path() / "HEAD").exists() else None
    if head is None:
        return {}
    if head not in _kept_at:
        found = {}
        for op, per_class in dispatch_table(head).items():
            for hardware in per_class:
                source = read_file(head, kept_path(op, hardware))
                if source is not None:
                    found[(op, hardware)] = source
        _kept_at.clear()
        _kept_at[head] = found
    return _kept_at[head]


def _lib_blobs(rev: str) -> dict[str, str]:
    """Each regular file under kernels/lib/ at `rev`, by its path below it: its blob id.
    Regular files only: the app writes nothing else, and a link could lead anywhere on the
    worker that reads it."""
    listing = _git("ls-tree", "-r", "-z", "--full-tree", rev, "--", f"{LIB_DIR}/")
    blobs = {}
    for entry in filter(None, listing.split("\x00")):
        mode_kind_blob, name = entry.split("\t", 1)
        mode, kind, blob = mode_kind_blob.split()
        if kind == "blob" and mode in ("100644", "100755"):
            blobs[name[len(LIB_DIR) + 1:]] = blob
    return blobs


def lib_files(rev: str) -> dict[str, bytes] | None:
    """The shared kernel code at `rev`: each file under kernels/lib/, by its path below it,
    as the bytes git holds. None when `rev` has no kernels/lib/ (a commit from before the
    workspace held shared code: its kernels import the shipped runners/kernel_lib)."""
    blobs = _lib_blobs(rev)
    return {name: _git_bytes("cat-file", "blob", blob) for name, blob in blobs.items()} or None


def changed_files(base: str, head: str) -> list[str]:
    return _git("diff", "--name-only", "--no-renames", base, head, "--").split()


def diff(base: str, head: str, *, context: int = 5, files: tuple[str, ...] = ()) -> str:
    """The unified diff between two commits, as git prints it (no colour, no drivers);
    with `files`, of those files only."""
    return _git("diff", "--no-color", "--no-ext-diff", "--no-textconv", f"-U{context}",
                base, head, "--", *files)


def is_ancestor(commit: str, of: str) -> bool:
    try:
        _git("merge-base", "--is-ancestor", commit, of)
    except WorkspaceError:
        return False
    return True


def commit_info(rev: str) -> dict[str, str]:
    fields = _git("log", "-1", "--format=%H%x00%an%x00%ae%x00%cn%x00%ce%x00%P%x00%B", rev)
    sha, author, author_email, committer, committer_email, parents, body = fields.split("\x00", 6)
    return {"sha": sha, "author": author, "author_email": author_email, "committer": committer,
            "committer_email": committer_email, "parents": parents.split(), "message": body}


def main_line(files: list[str], rev: str = MAIN) -> list[tuple[str, str]]:
    """(commit, subject) of every commit on main's first-parent line (up to `rev`, one of
    its commits) that changed one of `files`, oldest first: the seed, then each keep and
    undo that touched them."""
    ensure()
    out = _git("log", "--first-parent", "--reverse", "--format=%H%x00%s",
               _heads(rev) if rev == MAIN else rev, "--", *files)
    return [tuple(line.split("\x00", 1)) for line in out.splitlines() if line]


def branches(prefix: str = "") -> dict[str, str]:
    out = _git("for-each-ref", "--format=%(refname:short) %(objectname)", f"refs/heads/{prefix}")
    return dict(line.split(" ", 1) for line in out.splitlines() if line)


# -- writing -------------------------------------------------------------------------

def _clean(text: str, banned: str) -> str:
    return "".join(" " if ch in banned or ch in "\r\n" else ch for ch in text).strip() or "unknown"


def _who(identity: Identity, when: int) -> str:
    return f"{_clean(identity.name, '<>')} <{_clean(identity.email, '<> ')}> {when} +0000"


def _data(text: str) -> bytes:
    raw = text.encode()
    return f"data {len(raw)}\n".encode() + raw + b"\n"


def build(commits: list[NewCommit]) -> list[str]:
    """Write commit objects (one fast-import run for the whole batch); no ref moves.

    fast-import needs a ref per commit, so each goes to a scratch ref that is deleted
    as soon as the ids are known; the objects stay until published or collected.
    """
    if not commits:
        return []
    scratch = f"refs/kernel-lab/build/{os.getpid()}-{time.monotonic_ns()}"
    when = int(time.time())
    stream = bytearray()
    for number, commit in enumerate(commits, start=1):
        stream += f"commit {scratch}/{number}\nmark :{number}\n".encode()
        stream += f"author {_who(commit.author, when)}\n".encode()
        stream += f"committer {_who(commit.committer, when)}\n".encode()
        stream += _data(commit.message.rstrip() + "\n")
        for position, parent in enumerate(commit.parents):
            stream += f"{'from' if position == 0 else 'merge'} {parent}\n".encode()
        for file, content in commit.files.items():
            stream += f"D {file}\n".encode() if content is None else (
                f"M 100644 inline {file}\n".encode() + _data(content))
        stream += b"\n"
    stream += b"done\n"
    with tempfile.TemporaryDirectory(prefix="workspace-") as scratch_dir:
        marks = Path(scratch_dir) / "marks"
        _git("fast-import", "--quiet", "--done", f"--export-marks={marks}", stdin=bytes(stream))
        ids = dict(line.split() for line in marks.read_text().splitlines() if line)
    _git("update-ref", "--stdin", stdin="".join(
        f"delete {scratch}/{number}\n" for number in range(1, len(commits) + 1)).encode())
    return [ids[f":{number}"] for number in range(1, len(commits) + 1)]


def publish(updates: list[RefUpdate]) -> None:
    """Move refs all together or not at all; a ref not where it was expected fails it."""
    lines = []
    for update in updates:
        ref = _heads(update.ref)
        if update.new is None:
            lines.append(f"delete {ref} {update.old or ''}".rstrip() if update.check else f"delete {ref}")
        elif not update.check:
            lines.append(f"update {ref} {update.new}")
        elif update.old is None:
            lines.append(f"create {ref} {update.new}")
        else:
            lines.append(f"update {ref} {update.new} {update.old}")
    if lines:
        _git("update-ref", "--stdin", stdin=("\n".join(lines) + "\n").encode())


def _baseline_entry(op: str, hardware: str) -> dict:
    return {"kernel": "baseline", "commit": None, "path": kept_path(op, hardware),
            "source": f"runners/ops/{op}/baseline.py", "axis": None, "min": None, "max": None}


def _per_hardware(head: str, table: dict) -> tuple[dict, dict[str, str | None]]:
    """A table of the shared layout (op -> entries, one kernels/<op>/kept.py for every
    class) in the per-hardware one: each class keeps the newest kernel kept on it, read
    from that keep's commit; a class nothing was kept on gets the shipped baseline. The
    files to write (and the shared ones to delete)."""
    files: dict[str, str | None] = {}
    for name, entries in list(table.items()):
        if not isinstance(entries, list):
            continue
        op = ops.get_op(name) if name in ops.list_ops() else None
        shared = _shared_kept_path(name)
        per_class = {}
        for hardware in HARDWARE:
            # Each entry keeps its path: where its commit holds that kernel.
            kept = [entry for entry in entries if entry.get("hardware") == hardware and entry.get("commit")]
            newest = kept[0] if kept else None
            source = read_file(newest["commit"], shared) if newest else (
                op.baseline_path.read_text(encoding="utf-8") if op else read_file(head, shared))
            per_class[hardware] = [*kept, _baseline_entry(name, hardware)]
            files[kept_path(name, hardware)] = source
        table[name] = per_class
        files[shared] = None
    return table, files


def ensure() -> None:
    """Create the workspace on first use; seed any (op, hardware class) that has no kept
    kernel yet, and any module of the shipped runners/kernel_lib that kernels/lib/ lacks;
    move a workspace of the shared layout (one kept kernel per op) to the per-hardware one.

    Ops and lib modules are added by adding files, so a later start seeds the new ones
    too. A lib module main already has is never overwritten: the kept kernels were timed
    with it, and a change to it comes as a candidate.
    """
    with lock():
        folder = path()
        if not (folder / "HEAD").exists():
            _git("init", "--quiet", "--bare", "--initial-branch", MAIN, str(folder), in_workspace=False)
        head = resolve(_heads(MAIN))
        table = dispatch_table(MAIN) if head else {}
        files: dict[str, str | None] = {}
        messages = []
        if any(isinstance(entries, list) for entries in table.values()):
            table, files = _per_hardware(head, table)
            messages.append("Keep kernels per hardware class: each class keeps the newest kernel kept on it")
        missing = [(name, hardware) for name in ops.list_ops() for hardware in HARDWARE
                   if hardware not in (table.get(name) or {})]
        for name, hardware in missing:
            files[kept_path(name, hardware)] = ops.get_op(name).baseline_path.read_text(encoding="utf-8")
            table.setdefault(name, {})[hardware] = [_baseline_entry(name, hardware)]
        if missing:
            seeded = sorted({name for name, _ in missing})
            messages.append("Seed the shipped baseline of " + ", ".join(seeded))
        held = _lib_blobs(head) if head else {}
        lib = {f"{LIB_DIR}/{module.name}": module.read_text(encoding="utf-8")
               for module in sorted(SHIPPED_LIB.glob("*.py")) if module.name not in held}
        if lib:
            files.update(lib)
            messages.append("Seed the shared kernel code: " + ", ".join(lib))
        if not files:
            return
        if head is None:
            files["README.md"] = README
        files[DISPATCH_PATH] = dispatch_json(table)
        (seed,) = build([NewCommit(parents=[head] if head else [], files=files, message="\n\n".join(messages),
                                   author=KERNEL_LAB)])
        publish([RefUpdate(MAIN, seed, old=head)])


def dispatch_json(table: dict[str, dict[str, list[dict]]]) -> str:
    return json.dumps(table, indent=2) + "\n"


def merge_build(*, op: str, hardware: str, commit: str, base: str, entry: dict, message: str,
                author: Identity, reviewer: Identity) -> Merge:
    """The merge commit keeping `commit`, with `entry` first in the op's dispatch list of
    `hardware`.

    Refused when the main line changed, since `base`, a file the candidate changes: the
    candidate was measured against a kernel that is no longer the kept one.
    """
    head = main_head()
    if is_ancestor(commit, head):
        raise WorkspaceConflict(f"{commit[:12]} is already on {MAIN}")
    theirs = changed_files(base, commit)
    clash = sorted(set(theirs) & set(changed_files(base, head)))
    if clash:
        raise WorkspaceConflict(
            f"{', '.join(clash)} changed on {MAIN} since this candidate's base {base[:12]}: it "
            "was measured against a kernel that is no longer kept; revert it or revise it")
    files: dict[str, str | None] = {file: read_file(commit, file) for file in theirs}
    table = dispatch_table(head)
    per_class = table.setdefault(op, {})
    per_class[hardware] = [entry, *per_class.get(hardware, [])]
    files[DISPATCH_PATH] = dispatch_json(table)
    (merge,) = build([NewCommit(parents=[head, commit], files=files, message=message,
                                author=author, committer=reviewer)])
    return Merge(commit=merge, previous_main=head, files=sorted(files))


def undo_build(*, op: str, hardware: str, merge: str, commit: str, message: str,
               author: Identity) -> Merge:
    """A commit on main undoing the keep that `merge` made of candidate `commit`: every
    file that keep changed back as it was before it (the kept file: the kernel kept
    before, or the baseline), and its entry out of the op's dispatch list of `hardware`
    only.

    Refused unless that keep is still the newest entry of that list and main still holds
    every file as the keep left it: restoring under a later change would leave a kernel
    on main that no dispatch entry names, or throw that change away.
    """
    head = main_head()
    info = commit_info(merge)
    if len(info["parents"]) != 2 or info["parents"][1] != commit or not is_ancestor(merge, head):
        raise WorkspaceConflict(f"{merge[:12]} is not the merge on {MAIN} that kept {commit[:12]}")
    before = info["parents"][0]
    table = dispatch_table(head)
    entries = (table.get(op) or {}).get(hardware) or []
    if not entries or entries[0].get("commit") != commit:
        newest = (entries[0].get("candidate") or entries[0].get("kernel")) if entries else "nothing"
        raise WorkspaceConflict(f"the newest {op} kernel on {hardware} in {DISPATCH_PATH} is {newest}, "
                                f"not {commit[:12]}: undo the newer keep first")
    files: dict[str, str | None] = {}
    for file in changed_files(before, merge):
        if file == DISPATCH_PATH:
            continue
        if read_file(head, file) != read_file(merge, file):
            raise WorkspaceConflict(f"{file} changed on {MAIN} since the keep {merge[:12]}: undoing it "
                                    "would throw that change away")
        files[file] = read_file(before, file)
    table[op][hardware] = entries[1:]
    files[DISPATCH_PATH] = dispatch_json(table)
    (undo,) = build([NewCommit(parents=[head], files=files, message=message, author=author, committer=author)])
    return Merge(commit=undo, previous_main=head, files=sorted(files))


def main_commit_with(file: str, content: str) -> str | None:
    """The newest commit of main's line whose `file` is `content` (None: never was).

    For results measured elsewhere against a kept kernel (an imported sweep): their
    candidates fork from the main-line commit where that kernel was the kept one.
    """
    ensure()
    head = main_head()
    if read_file(head, file) == content:
        return head
    for commit in _git("rev-list", "--first-parent", _heads(MAIN), "--", file).split():
        if read_file(commit, file) == content:
            return commit
    return None


# -- scratch checkouts (an agent sweep's proposals) ----------------------------------

def scratch_checkout(commit: str, folder: Path, *, files: dict[str, str] | None = None) -> str:
    """A private clone of the workspace at `commit`, detached, in the empty `folder`;
    with `files`, written over it and committed there. Returns the checkout's base.

    A clone, not a worktree: what runs in it (an agent's command) cannot move the
    workspace's refs or write into its object store. `--no-hardlinks` so it shares no
    file with the workspace either.
    """
    folder = Path(folder)
    _git("clone", "--quiet", "--no-checkout", "--no-hardlinks", str(path()), str(folder), in_workspace=False)
    _git("-C", str(folder), "checkout", "--quiet", "--detach", commit, in_workspace=False)
    changed = {name: text for name, text in (files or {}).items()
               if not (folder / name).exists() or (folder / name).read_text(encoding="utf-8") != text}
    if not changed:
        return commit
    for name, text in changed.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    _git("-C", str(folder), "add", "--", *changed, in_workspace=False)
    _git("-C", str(folder), "commit", "--quiet", "--no-verify", "-m", "The sweep's kernel", in_workspace=False)
    return _git("-C", str(folder), "rev-parse", "HEAD", in_workspace=False).strip()


def scratch_git_dir(folder: Path, into: Path) -> Path:
    """A copy of the checkout's git directory at `into`, to read its changes with later:
    whatever then runs in the checkout can rewrite the checkout's own `.git` (its
    config names programs git runs: core.fsmonitor, hooks), never this copy."""
    shutil.copytree(Path(folder) / ".git", into, symlinks=True)
    return Path(into)


def scratch_exclude(git_dir: Path, name: str) -> None:
    """Keep `name` (a file the app writes into the checkout) out of its changes."""
    exclude = Path(git_dir) / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a", encoding="utf-8") as handle:
        handle.write(f"\n/{name}\n")


def scratch_changes(folder: Path, base: str, *, git_dir: Path) -> list[str]:
    """Every file that differs from `base` in the checkout: edited, added (untracked
    too), deleted, or changed by commits the command made itself. Read with `git_dir`
    (`scratch_git_dir`), never the checkout's own `.git`, and with no fsmonitor."""
    where = ("--git-dir", str(git_dir), "--work-tree", str(folder), "-c", "core.fsmonitor=false")
    _git(*where, "add", "--all", in_workspace=False)
    out = _git(*where, "diff", "--cached", "--name-only", "--no-renames", "-z", base, "--",
               in_workspace=False)
    return [name for name in out.split("\x00") if name]
