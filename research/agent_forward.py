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


def _forward(client, path):
    with client:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError:
            upstream.close()
            return
        with upstream:
            back = threading.Thread(target=_copy, args=(upstream, client), daemon=True)
            back.start()
            _copy(client, upstream)
            back.join()


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
