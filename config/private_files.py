"""Files that hold a secret (a password, a URL with one) under the data directory."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """`text` as the whole of a file of its owner's alone, written to a fresh file beside
    it and renamed over `path`: a link planted at the name is replaced, never followed
    (written through, it carried the secret to the file it named and made that file 0600)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(staging, path)


# The SQLite database and the files SQLite keeps beside it (it gives its WAL and shared
# memory files the database file's mode).
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


class NotOurs(PermissionError):
    """The data directory or its database belongs to another user, who could read it."""


def _ours(descriptor: int, what: Path) -> None:
    owner = os.fstat(descriptor).st_uid
    if owner != os.geteuid():
        raise NotOurs(f"{what} belongs to uid {owner}, not to this user ({os.geteuid()}): whoever made it "
                      "can read the database there; set DATA_DIR to a folder of your own")


def private_data_dir(folder: Path, database: Path | None = None) -> None:
    """The data directory and the SQLite database in it, their owner's alone.

    Created under the usual umask 022, `db.sqlite3` was world-readable: any local user
    read the live session keys from it (and used them), the password hashes and the
    webhook secrets. The folder is made 0700; the database is created 0600 before SQLite
    opens it, and an earlier install's files are made 0600, through descriptors opened
    without following a link planted at their names. A folder or database another user
    made is refused (NotOurs): its maker keeps every right to it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        # Made first by another user (in /tmp, say), it stays theirs whatever its mode.
        _ours(descriptor, folder)
        os.fchmod(descriptor, 0o700)
    finally:
        os.close(descriptor)
    if database is None:
        return
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        pass
    for suffix in SQLITE_SUFFIXES:
        try:
            descriptor = os.open(f"{database}{suffix}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, OSError):
            continue
        try:
            _ours(descriptor, Path(f"{database}{suffix}"))
            os.fchmod(descriptor, 0o600)
        finally:
            os.close(descriptor)
