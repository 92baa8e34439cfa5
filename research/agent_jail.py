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
- a network namespace of its own, with only its own loopback; an agent whose
  declaration names `hosts` (a model's API) reaches those and nothing else, through
  `research/agent_egress.py` (HTTPS_PROXY): never the worker's loopback, where the
  database and Redis listen;
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
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from research.agent_egress import PROXY_PORT

BWRAP = "bwrap"
SETPRIV = "setpriv"
# Read-only in every jail; missing ones are skipped (--ro-bind-try).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Passed on from the worker's environment when set; everything else only by declaration.
ENV_ALLOWED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ")
NOBODY = 65534
# A networked agent's way out (research/agent_egress.py): the forwarder, run first in
# its jail by the system's python3, and the proxy's socket, where the jail sees them.
FORWARDER = Path(__file__).with_name("agent_forward.py")
FORWARDER_PYTHON = "/usr/bin/python3"
JAIL_EGRESS = "/kernel-lab/egress.sock"
JAIL_FORWARDER = "/kernel-lab/forward.py"
# The jail's own /tmp, a fresh tmpfs of its own, and its HOME: not the machine's.
JAIL_TMP = "/tmp"  # nosec B108


class JailError(Exception):
    """The jail cannot be built here, or a declaration is not one."""


@dataclass(frozen=True)
class Declaration:
    """An agent command as an administrator declared it (AGENT_COMMANDS_FILE)."""

    command: str
    hosts: tuple[str, ...] = ()  # "host:port" it may reach through the egress proxy
    read: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


# host:port, the host a name or an address (IPv6 in brackets).
_HOST_PORT = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")


def declaration(name: str, value: object) -> Declaration:
    """`name = "command"`, or a table with `command` and optionally `hosts` ("host:port"
    it may reach), `read` (absolute paths) and `env` (variable names)."""
    if isinstance(value, str):
        return Declaration(command=value)
    if not isinstance(value, Mapping):
        raise JailError(f"agent {name!r}: a command line or a table, not {type(value).__name__}")
    if value.get("network", False) is not False:
        raise JailError(f"agent {name!r}: `network = true` gave the agent the worker's own network, its "
                        "loopback included (the database, Redis): name what it may reach instead, "
                        'hosts = ["api.example.com:443"]')
    unknown = set(value) - {"command", "network", "hosts", "read", "env"}
    if unknown:
        raise JailError(f"agent {name!r}: unknown keys {', '.join(sorted(unknown))} "
                        "(allowed: command, hosts, read, env)")
    command, hosts = value.get("command"), value.get("hosts", [])
    read, env = value.get("read", []), value.get("env", [])
    if not isinstance(command, str) or not command.strip():
        raise JailError(f"agent {name!r}: `command` must be a non-empty string")
    if not isinstance(hosts, list) or not all(isinstance(host, str) and _HOST_PORT.fullmatch(host)
                                              and 0 < int(host.rsplit(":", 1)[1]) < 65536 for host in hosts):
        raise JailError(f"agent {name!r}: `hosts` must be a list of \"host:port\"")
    if not isinstance(read, list) or not all(isinstance(path, str) and os.path.isabs(path) for path in read):
        raise JailError(f"agent {name!r}: `read` must be a list of absolute paths")
    if not isinstance(env, list) or not all(isinstance(key, str) and key.isidentifier() for key in env):
        raise JailError(f"agent {name!r}: `env` must be a list of variable names")
    return Declaration(command=command, hosts=tuple(hosts), read=tuple(read), env=tuple(env))


def missing() -> str | None:
    """Why no jail can be built on this machine (None when one can)."""
    if shutil.which(BWRAP) is None:
        return ("bubblewrap is not installed, and an agent never runs outside its jail: "
                "install it (Debian and Ubuntu: apt install bubblewrap)")
    if os.geteuid() == 0 and shutil.which(SETPRIV) is None:
        return "setpriv (util-linux) is not installed: an agent never runs as root"
    return None


def missing_for(declared: Declaration) -> str | None:
    """Why this declaration's jail cannot be built here (None when it can)."""
    problem = missing()
    if problem is None and declared.hosts and not os.path.exists(FORWARDER_PYTHON):
        problem = (f"{FORWARDER_PYTHON} is not installed: an agent that names hosts reaches them through a "
                   "forwarder it runs (Debian and Ubuntu: apt install python3)")
    return problem


def environment(declared: Declaration, extra: Mapping[str, str]) -> dict[str, str]:
    """The agent's whole environment: the allow-list, the declared names, `extra`."""
    env = {key: os.environ[key] for key in (*ENV_ALLOWED, *declared.env) if key in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(HOME=JAIL_TMP, TMPDIR=JAIL_TMP, **extra)
    if declared.hosts:  # the forwarder, inside the jail: the only way out
        proxy = f"http://127.0.0.1:{PROXY_PORT}"
        env.update(HTTPS_PROXY=proxy, https_proxy=proxy, HTTP_PROXY=proxy, http_proxy=proxy,
                   ALL_PROXY=proxy, NO_PROXY="", no_proxy="")
    return env


def prepare(checkout: Path) -> None:
    """Hands the clone to the agent's user, where that is not the worker's."""
    if os.geteuid() != 0:
        return
    for folder, directories, files in os.walk(checkout):
        for name in [folder, *(os.path.join(folder, entry) for entry in (*directories, *files))]:
            os.lchown(name, NOBODY, NOBODY)


def command(argv: list[str], *, checkout: Path, declared: Declaration, env: Mapping[str, str],
            egress: Path | None = None) -> list[str]:
    """The command line that runs `argv` jailed, in `checkout`, with exactly `env`; with
    `egress` (the proxy's socket, for a declaration that names hosts) behind the
    forwarder that is its only way out."""
    problem = missing_for(declared)
    if problem is not None:
        raise JailError(problem)
    if bool(declared.hosts) != (egress is not None):
        raise JailError("an agent that names hosts runs with its egress proxy, and only such an agent")
    checkout = checkout.resolve()
    # A network namespace of its own, always: with the worker's, it reached the worker's
    # loopback (research/agent_egress.py).
    jail = [shutil.which(BWRAP) or BWRAP, "--die-with-parent", "--new-session",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--unshare-net",
            "--hostname", "kernel-lab-agent"]
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
    if egress is not None:
        jail += _folders_above(JAIL_EGRESS, made)
        jail += ["--bind", str(egress), JAIL_EGRESS, "--ro-bind", str(FORWARDER), JAIL_FORWARDER]
        argv = [FORWARDER_PYTHON, JAIL_FORWARDER, JAIL_EGRESS, str(PROXY_PORT), "--", *argv]
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
