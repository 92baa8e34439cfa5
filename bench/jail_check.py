"""Does the harness's jail hold on this host, and can a jailed child still use the GPU?

    python3 bench/jail_check.py [--device cuda] [--dsl triton]

Starts one child in the jail a candidate gets (runners.jail, with the plan the harness
would make), which reports what it sees from inside: its PID, user, root folder, /proc,
and on CUDA a tensor on the GPU. Then prints every call the jail's supervisor refused
and every program it let start. Exit 0 when the child ran to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runners.harness.children import child_environment  # noqa: E402
from runners.harness.dsl import child_environment as dsl_environment  # noqa: E402
from runners.jail.plan import make_plan  # noqa: E402

INSIDE = """
import json, os, sys
seen = {"pid": os.getpid(), "uid": os.getuid(), "root": sorted(os.listdir("/")),
        "proc": sorted(name for name in os.listdir("/proc") if name.isdigit())}
import torch
if sys.argv[1] == "cuda":
    torch.cuda.init()
    seen["gpu"] = str(torch.ones(4, device="cuda").sum().item())
    seen["device"] = torch.cuda.get_device_name()
if sys.argv[2] == "triton":
    import triton, triton.language as tl
    @triton.jit
    def _double(x, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)
    x = torch.ones(100, device=sys.argv[1])
    _double[(1,)](x, 100, BLOCK=128)
    seen["triton"] = float(x.sum())
print(json.dumps(seen))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dsl", choices=["torch", "triton"], default="torch")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kernel-lab-child-"))
    root = Path(tempfile.mkdtemp(prefix="kernel-lab-root-"))
    env = child_environment(scratch, threads=1, extra=dsl_environment(args.dsl, args.device, scratch))
    probe = scratch / "probe.py"  # a file of its own: Triton reads a kernel's source
    probe.write_text(INSIDE)
    plan = make_plan(scratch=scratch, root=root,
                     argv=[sys.executable, str(probe), args.device, args.dsl], files=[],
                     dsl=args.dsl, device=args.device, environment=env,
                     cpus=sorted(os.sched_getaffinity(0))[-1:], cpu_seconds=300, file_bytes=2**30)
    report_read, report_write = os.pipe()
    child = subprocess.run([sys.executable, "-s", "-m", "runners.jail", plan.to_json(),
                            str(report_write), str(os.getpid())],
                           pass_fds=(report_write,), cwd=scratch, env=env, capture_output=True,
                           text=True, timeout=600)
    os.close(report_write)
    with os.fdopen(report_read) as report:
        said = [json.loads(line) for line in report if line.strip()]
    print(f"exit status: {child.returncode}")
    print(f"inside: {child.stdout.strip() or '(nothing)'}")
    if child.returncode:
        print(child.stderr.strip()[-3000:])
    for entry in said:
        for key in ("refused", "ran", "jail_error"):
            if key in entry:
                print(f"{key}: {entry[key]}")
    return 0 if child.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
