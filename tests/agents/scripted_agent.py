"""A coding agent that edits the kernel deterministically, for the agent-sweep tests.

    scripted_agent.py MODE[,MODE...]

It runs in the scratch checkout an agent sweep gives it (its working directory) and
reads what a real agent reads: KERNEL_LAB_CONTEXT (the context file), KERNEL_LAB_KERNEL
(the kernel to edit, relative) and KERNEL_LAB_PROPOSAL (1, 2, …), which picks the mode
for this proposal from the list, cycling. Modes:

    improve    a valid change: PARAMS["block_rows"] set to 1024 (a comment otherwise)
    outside    the same valid change, plus an edit of README.md (not an allowed path)
    wrong-dsl  replaces the kernel with plain torch code (refused when a DSL is required)
    hack       loosens the op's tolerance from the kernel (refused: protected settings)
    env-hack   sets an environment variable from the kernel (refused: protected settings)
    syntax     leaves the kernel not valid Python
    symlink    replaces the kernel by a link to a file of the machine it runs on
    nothing    changes nothing
    fail       exits with status 3
    hang       never finishes, with a child process that never does either (their pids
               go to the file SCRIPTED_AGENT_PIDS names, when set)

It refuses to work (exit 4) without its context, and (exit 5) when it was handed the
app's database or broker: an agent gets neither.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

TORCH_RMSNORM = '''"""RMSNorm in plain torch (a scripted agent ignoring the required DSL)."""

import torch


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
'''

LOOSEN_TOLERANCE = '''
from runners.ops import get_op as _get_op

type(_get_op("rmsnorm")).tolerances[torch.float32] = (1e-2, 1e-2)
'''

SET_ENVIRONMENT = '''
import os as _os

_os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "1"
'''


def improve(kernel: Path) -> None:
    source = kernel.read_text()
    tuned, count = re.subn(r'"block_rows":\s*\d+', '"block_rows": 1024', source, count=1)
    if not count or tuned == source:
        tuned = source.rstrip("\n") + "\n\n# Tuned by the scripted agent.\n"
    kernel.write_text(tuned)


def main() -> int:
    modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["improve"]
    context = Path(os.environ.get("KERNEL_LAB_CONTEXT", ""))
    if not context.is_file() or "## Forbidden tricks" not in context.read_text():
        print("no context file", file=sys.stderr)
        return 4
    if os.environ.get("DATABASE_URL") or os.environ.get("REDIS_URL"):
        print("the app's servers leaked into the agent's environment", file=sys.stderr)
        return 5
    proposal = int(os.environ.get("KERNEL_LAB_PROPOSAL", "1"))
    mode = modes[(proposal - 1) % len(modes)]
    kernel = Path(os.environ["KERNEL_LAB_KERNEL"])
    print(f"scripted agent: proposal {proposal}, mode {mode}")
    if mode == "improve":
        improve(kernel)
    elif mode == "outside":
        improve(kernel)
        with open("README.md", "a") as readme:
            readme.write("\nThe scripted agent was here.\n")
    elif mode == "wrong-dsl":
        kernel.write_text(TORCH_RMSNORM)
    elif mode == "hack":
        source = kernel.read_text()
        kernel.write_text(source.replace("import torch\n", "import torch\n" + LOOSEN_TOLERANCE, 1))
    elif mode == "env-hack":
        kernel.write_text(kernel.read_text().rstrip("\n") + "\n" + SET_ENVIRONMENT)
    elif mode == "syntax":
        kernel.write_text(kernel.read_text() + "\ndef broken(:\n")
    elif mode == "symlink":
        kernel.unlink()
        kernel.symlink_to("/etc/hostname")
    elif mode == "nothing":
        pass
    elif mode == "fail":
        print("the scripted agent gives up", file=sys.stderr)
        return 3
    elif mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        if os.environ.get("SCRIPTED_AGENT_PIDS"):  # for the test to check both were stopped
            Path(os.environ["SCRIPTED_AGENT_PIDS"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(3600)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
