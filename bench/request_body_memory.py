"""What a refused large upload costs the server: Daphne's peak memory (VmHWM) around one
POST far over REQUEST_MAX_BYTES, with Daphne's own command and with config.serve.

    .venv/bin/python bench/request_body_memory.py [--mb 300]

No login is needed to send a body: the cost is any client's to impose. Figures:
docs/benchmarks.md, "Request bodies".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import app_environment, daphne, post_mebibytes  # noqa: E402

def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="the body's size in MiB")
    args = parser.parse_args()
    with app_environment() as servers:
        print(servers)
        rows = []
        for capped in (False, True):
            for declared in (True, False):
                with daphne(capped=capped) as server:
                    before = _peak_mb(server.pid)
                    status = post_mebibytes(server.url, args.mb, declared=declared)
                    rows.append(("config.serve" if capped else "daphne", "Content-Length" if declared else "chunked",
                                 status, before, _peak_mb(server.pid)))
        print(f"\n{args.mb} MiB POST, peak RSS of the server process (MiB)")
        print(f"{'server':<14}{'body':<16}{'status':>7}{'before':>9}{'after':>9}{'growth':>9}")
        for name, body, status, before, after in rows:
            print(f"{name:<14}{body:<16}{status:>7}{before:>9.0f}{after:>9.0f}{after - before:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
