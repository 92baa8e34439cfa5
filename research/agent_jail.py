"""The jail a coding agent's command runs in: bubblewrap (Debian's `bubblewrap`).

An agent is a program someone else wrote, driven by text any user of the lab can write
(the thesis), so it is treated as hostile. Inside the jail it sees:

- the machine's programs and libraries, read-only (`/usr`, `/bin`, `/lib*`, `/sbin`,
  `/etc`), the files its command line names (its program and script), and the paths its
  declaration lists under `read`, read-only too;
- its scratch clone, writable, at the path it has outside: nothing else of the machine
  is writable, and the app's data folder, database, project tree and workspace are not
  there at all;
- a private `/tmp` (its HOME), a minimal `/dev`, and a `/proc` of its own PID namespace:
  no other process of the machine exists for it, and every process it starts dies with
  the namespace when its first one ends or is killed at the time limit;
- no network, unless its declaration says `network = true` (a model's API needs it);
- an environment built from an allow-list: `PATH`, the locale, the `KERNEL_LAB_*`
  variables, and the names its declaration lists under `env`;
- a user of its own: `nobody` where the worker runs as root (outside a user namespace
  root would still own every root-owned file it can see), else the worker's own user in
  a user namespace.

Where bubblewrap is missing the agent does not run: the proposal is refused saying how
to install it. There is no unjailed fallback.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

BWRAP = "bwrap"
SETPRIV = "setpriv"
# Read-only in every jail; missing ones are skipped (--ro-bind-try).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Passed on from the worker's environment when set; everything else only by declaration.
ENV_ALLOWED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ")
NOBODY = 65534
# The jail's own /tmp, a fresh tmpfs of its own, and its HOME: not the machine's.
JAIL_TMP = "/tmp"  # nosec B108


class JailError(Exception):
    """The jail cannot be built here, or a declaration is not one."""


@dataclass(frozen=True)
class Declaration:
    """An agent command as an administrator declared it (AGENT_COMMANDS_FILE)."""

    command: str
    network: bool = False
    read: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


def declaration(name: str, value: object) -> Declaration:
    """`name = "command"`, or a table with `command` and optionally `network`, `read`
    (absolute paths) and `env` (variable names)."""
    if isinstance(value, str):
        return Declaration(command=value)
    if not isinstance(value, Mapping):
        raise JailError(f"agent {name!r}: a command line or a table, not {type(value).__name__}")
    unknown = set(value) - {"command", "network", "read", "env"}
    if unknown:
        raise JailError(f"agent {name!r}: unknown keys {', '.join(sorted(unknown))} "
                        "(allowed: command, network, read, env)")
    command, network = value.get("command"), value.get("network", False)
    read, env = value.get("read", []), value.get("env", [])
    if not isinstance(command, str) or not command.strip():
        raise JailError(f"agent {name!r}: `command` must be a non-empty string")
    if not isinstance(network, bool):
        raise JailError(f"agent {name!r}: `network` must be true or false")
    if not isinstance(read, list) or not all(isinstance(path, str) and os.path.isabs(path) for path in read):
        raise JailError(f"agent {name!r}: `read` must be a list of absolute paths")
    if not isinstance(env, list) or not all(isinstance(key, str) and key.isidentifier() for key in env):
        raise JailError(f"agent {name!r}: `env` must be a list of variable names")
    return Declaration(command=command, network=network, read=tuple(read), env=tuple(env))


def missing() -> str | None:
    """Why no jail can be built on this machine (None when one can)."""
    if shutil.which(BWRAP) is None:
        return ("bubblewrap is not installed, and an agent never runs outside its jail: "
                "install it (Debian and Ubuntu: apt install bubblewrap)")
    if os.geteuid() == 0 and shutil.which(SETPRIV) is None:
        return "setpriv (util-linux) is not installed: an agent never runs as root"
    return None


def environment(declared: Declaration, extra: Mapping[str, str]) -> dict[str, str]:
    """The agent's whole environment: the allow-list, the declared names, `extra`."""
    env = {key: os.environ[key] for key in (*ENV_ALLOWED, *declared.env) if key in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(HOME=JAIL_TMP, TMPDIR=JAIL_TMP, **extra)
    return env


def prepare(checkout: Path) -> None:
    """Hands the clone to the agent's user, where that is not the worker's."""
    if os.geteuid() != 0:
        return
    for folder, directories, files in os.walk(checkout):
        for name in [folder, *(os.path.join(folder, entry) for entry in (*directories, *files))]:
            os.lchown(name, NOBODY, NOBODY)


def command(argv: list[str], *, checkout: Path, declared: Declaration, env: Mapping[str, str]) -> list[str]:
    """The command line that runs `argv` jailed, in `checkout`, with exactly `env`."""
    problem = missing()
    if problem is not None:
        raise JailError(problem)
    checkout = checkout.resolve()
    jail = [shutil.which(BWRAP) or BWRAP, "--die-with-parent", "--new-session",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "kernel-lab-agent"]
    if not declared.network:
        jail.append("--unshare-net")
    if os.geteuid() != 0:
        jail.append("--unshare-user")
    for path in SYSTEM_PATHS:
        jail += ["--ro-bind-try", path, path]
    jail += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", JAIL_TMP]
    made: set[str] = set()
    # The program and the files its command line names, and what the declaration lists
    # (what lies under the system's folders is there already).
    named = [part for part in argv if os.path.isabs(part) and os.path.exists(part)]
    for path in dict.fromkeys([*named, *declared.read]):
        if not any(path == system or path.startswith(system + "/") for system in SYSTEM_PATHS):
            jail += _folders_above(path, made) + ["--ro-bind-try", path, path]
    jail += _folders_above(str(checkout), made)
    jail += ["--bind", str(checkout), str(checkout), "--chdir", str(checkout), "--clearenv"]
    for key, value in env.items():
        jail += ["--setenv", key, value]
    if os.geteuid() == 0:
        jail += ["--", shutil.which(SETPRIV) or SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}",
                 "--clear-groups", "--"]
    else:
        jail.append("--")
    return jail + argv


def _folders_above(path: str, made: set[str]) -> list[str]:
    """Folders leading to `path`, made traversable: bubblewrap makes the ones it needs
    for a mount 0700, which the agent's own user could not enter."""
    folders, parent = [], os.path.dirname(path)
    while parent not in ("/", ""):
        folders.append(parent)
        parent = os.path.dirname(parent)
    arguments = []
    for folder in reversed(folders):
        if folder not in made and folder != JAIL_TMP:
            made.add(folder)
            arguments += ["--perms", "0755", "--dir", folder]
    return arguments
