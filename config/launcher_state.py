"""What a running quick start tells the other processes of its installation.

`manage.py import_results` run by hand beside `python -m config.launch` must reach the
launcher's embedded Redis (or its events never stream and its webhooks never leave) and
write links to the site's real port. The launcher writes both under DATA_DIR, in a file
that is its owner's alone (the Redis URL holds the password), and removes it when it
stops. config.settings trusts the file only when it is this user's own regular file,
readable by no one else, and the process that wrote it still runs: the same pid with
the same start time, so a launcher killed outright (and its pid reused) leaves nothing
that points commands at a server someone else may now hold.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from config.private_files import write_private

FILE = "launcher.json"


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


def write(data_dir: Path, *, site_url: str, redis_url: str | None) -> Path:
    """Written whole to a fresh file, then renamed over the old one: a link planted at
    the name is replaced, never followed."""
    path = Path(data_dir) / FILE
    write_private(path, json.dumps({"pid": os.getpid(), "started": _started(os.getpid()),
                                    "site_url": site_url, "redis_url": redis_url}))
    return path


def read(data_dir: Path) -> dict:
    """The running launcher's {"site_url", "redis_url"}; {} when none runs for data_dir."""
    path = Path(data_dir) / FILE
    try:
        found = os.lstat(path)
        if (not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid()
                or found.st_mode & 0o077):
            return {}
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict):
        return {}
    pid = state.get("pid")
    if not isinstance(pid, int) or pid <= 0 or state.get("started") is None or _started(pid) != state["started"]:
        return {}
    return {key: state[key] for key in ("site_url", "redis_url") if isinstance(state.get(key), str)}


def remove(data_dir: Path) -> None:
    """Only this process's own file: a second launcher on the same DATA_DIR keeps its."""
    path = Path(data_dir) / FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass
