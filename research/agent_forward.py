"""Runs inside a networked agent's jail, as its first process (research/agent_egress.py):
listens on 127.0.0.1:PORT of the jail's own network namespace, hands every connection to
the egress proxy's Unix socket, runs the agent, and exits with its status.

    python3 agent_forward.py SOCKET PORT -- AGENT ARGV...

Only the standard library: it runs with the system's python3, not the app's.
"""

import socket
import subprocess
import sys
import threading


def _copy(source, sink):
    try:
        while True:
            chunk = source.recv(65536)
            if not chunk:
                break
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def pipe_both_ways(one, other):
    """Bytes from each socket to the other until both have ended (the egress proxy's
    pipe too: research/agent_egress.py)."""
    back = threading.Thread(target=_copy, args=(other, one), daemon=True)
    back.start()
    _copy(one, other)
    back.join()


def _forward(client, path):
    with client:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError:
            upstream.close()
            return
        with upstream:
            pipe_both_ways(client, upstream)


def _serve(listener, path):
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_forward, args=(client, path), daemon=True).start()


def main():
    path, port, separator, *argv = sys.argv[1:]
    if separator != "--" or not argv:
        print("usage: agent_forward.py SOCKET PORT -- AGENT ARGV...", file=sys.stderr)
        return 2
    listener = socket.create_server(("127.0.0.1", int(port)))
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    return subprocess.call(argv)


if __name__ == "__main__":
    sys.exit(main())
