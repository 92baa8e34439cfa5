"""Several Daphne processes (config.serve) behind one address.

One Daphne process renders every synchronous view under one interpreter lock, so on one
core at most: 20 users of the sweep page queued for it. Here the socket is bound once,
by the caller, and every process accepts from it; a process busy rendering accepts less,
so the next connection goes to one that is free (and while one is still starting, the
others take every connection). Websockets need nothing more: the
channel layer delivers through Redis to whichever process holds a page's socket, and
the cache (rate limits, fragments) is Redis too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LISTEN_BACKLOG = 1024  # connections the kernel queues while every process is busy


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, for the server processes to inherit. Raises
    OSError (the port in use, an address not of this machine) before any process starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds at once
        listener.bind((host, port))
        listener.listen(LISTEN_BACKLOG)
    except OSError:
        listener.close()
        raise
    return listener


def start(listener: socket.socket, count: int, **popen) -> list[subprocess.Popen]:
    """`count` processes serving config.asgi:application from `listener`; `popen`: the
    rest of subprocess.Popen's arguments (environment, output, session)."""
    if count < 1:
        raise ValueError(f"at least one web process is needed, not {count}")
    command = [sys.executable, "-m", "config.serve", "--fd", str(listener.fileno()), "config.asgi:application"]
    return [subprocess.Popen(command, cwd=ROOT, pass_fds=(listener.fileno(),), **popen) for _ in range(count)]
