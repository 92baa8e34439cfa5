"""A coding agent that edits the kernel deterministically, for the agent-sweep tests.

    scripted_agent.py MODE[,MODE...]

It runs in the scratch checkout an agent sweep gives it (its working directory) and
reads what a real agent reads: KERNEL_LAB_CONTEXT (the context file), KERNEL_LAB_KERNEL
(the kernel to edit, relative) and KERNEL_LAB_PROPOSAL (1, 2, …), which picks the mode
for this proposal from the list, cycling. Modes:

    improve    a valid change: PARAMS["block_rows"] set to 1024 (a comment otherwise)
    outside    the same valid change, plus an edit of README.md (not an allowed path)
    lib        the same valid change, plus one of the shared kernel code the indexers
               import, kernels/lib/topk_torch.py: a comment, so it runs as before
    lib-wrong  the same, but the shared head sum's fused path returns the negated sum:
               every kernel that imports it then selects the lowest scores
    wrong-dsl  replaces the kernel with plain torch code (refused when a DSL is required)
    hack       loosens the op's tolerance from the kernel (refused: protected settings)
    env-hack   sets an environment variable from the kernel (refused: protected settings)
    syntax     leaves the kernel not valid Python
    symlink    replaces the kernel by a link to a file of the machine it runs on
    nothing    changes nothing
    fail       exits with status 3
    hang:TOKEN never finishes, with a child process that never does either (TOKEN is on
               both command lines, for the test to look for them)
    probe:PORT:DIR
               tries what a hostile agent would, aimed at the folder DIR outside its
               checkout (which holds a file `app.sqlite3`): read the app's secrets from
               its environment and from every process's /proc/<pid>/environ, read
               DIR/app.sqlite3, connect to the app's broker (127.0.0.1:PORT), write
               DIR/written-by-agent, leave a helper running in a
               session of its own (TOKEN: DIR's name, on its command line), plant a
               core.fsmonitor in the checkout's .git/config that touches
               DIR/fsmonitor-ran; it writes what it managed into the kernel, as a comment
    link:DIR   replaces the kernel's folder by a link to DIR (a folder of the machine
               the agent knows of, with a kept.py in it)
    whoami     writes its uid, pid and environment's names into the kernel, as a comment

It refuses to work (exit 4) without its context, and (exit 5) when it was handed the
app's database or broker: an agent gets neither.
"""

from __future__ import annotations

import os
import re
import socket
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


SHARED_SCORES = Path("kernels/lib/topk_torch.py")
FUSED_SUM = "return torch.bmm(weights.unsqueeze(1), logits.relu_()).squeeze(1)"


def change_shared_code(wrong: bool) -> None:
    source = SHARED_SCORES.read_text()
    if wrong:
        source = source.replace(FUSED_SUM, "return -" + FUSED_SUM[len("return "):], 1)
    SHARED_SCORES.write_text(source.rstrip("\n") + "\n\n# Shared code changed by the scripted agent.\n")


def probe(kernel: Path, port: int, target: Path) -> None:
    found = []
    if "SECRET_KEY" in os.environ:
        found.append("secret in its environment")
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if b"SECRET_KEY=" in environ.read_bytes():
                found.append(f"secret in {environ}")
        except OSError:
            pass
    try:
        found.append(f"read the database ({len((target / 'app.sqlite3').read_bytes())} bytes)")
    except OSError:
        pass
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        found.append("reached the broker")
    except OSError:
        pass
    try:
        (target / "written-by-agent").write_text("the agent was here")
        found.append("wrote outside its checkout")
    except OSError:
        pass
    helper = f"import os, time; os.setsid(); time.sleep(3600)  # {target.name}"
    if os.fork() == 0:  # double fork: the helper is nobody's child
        if os.fork() == 0:
            quiet = os.open(os.devnull, os.O_RDWR)
            for descriptor in (0, 1, 2):  # holds none of the agent's pipes open
                os.dup2(quiet, descriptor)
            os.execv(sys.executable, [sys.executable, "-c", helper])
        os._exit(0)
    os.wait()
    config = Path(".git/config")
    try:
        with open(config, "a") as handle:
            handle.write(f"[core]\n\tfsmonitor = touch {target}/fsmonitor-ran\n")
        found.append("planted core.fsmonitor")
    except OSError:
        pass
    kernel.write_text(kernel.read_text().rstrip("\n") + f"\n\n# probe: {'; '.join(found) or 'nothing'}\n")


def _through_proxy(host_port: str, payload: bytes) -> str:
    """CONNECT through HTTPS_PROXY as an HTTPS client would, then send `payload`."""
    proxy = os.environ.get("HTTPS_PROXY", "")
    if not proxy.startswith("http://"):
        return "no proxy"
    address, port = proxy[len("http://"):].rstrip("/").rsplit(":", 1)
    try:
        with socket.create_connection((address, int(port)), timeout=5) as tunnel:
            tunnel.sendall(f"CONNECT {host_port} HTTP/1.1\r\nHost: {host_port}\r\n\r\n".encode())
            answer = tunnel.recv(4096).decode("latin-1")
            status = answer.split(" ", 2)[1] if answer.startswith("HTTP/") else "no answer"
            if status != "200":
                return status
            tunnel.sendall(payload)
            return "200, then " + tunnel.recv(4096).decode("latin-1", "replace")
    except OSError as error:
        return f"failed ({type(error).__name__})"


def egress(kernel: Path, broker: int, declared: int) -> None:
    """What a networked agent reaches: the broker on the worker's loopback, directly and
    through the proxy, and the host its declaration names."""
    try:
        socket.create_connection(("127.0.0.1", broker), timeout=2).close()
        direct = "reached"
    except OSError:
        direct = "refused"
    found = [f"broker directly: {direct}", f"broker through the proxy: {_through_proxy(f'127.0.0.1:{broker}', b'')}",
             f"declared host: {_through_proxy(f'127.0.0.1:{declared}', b'ping')}"]
    kernel.write_text(kernel.read_text().rstrip("\n") + f"\n\n# egress: {'; '.join(found)}\n")


def link(kernel: Path, target: Path) -> None:
    folder = kernel.parent
    os.rename(folder, f"{folder}.moved")
    folder.symlink_to(target)


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
    elif mode in ("lib", "lib-wrong"):
        improve(kernel)
        change_shared_code(wrong=mode == "lib-wrong")
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
    elif mode.startswith("hang:"):
        subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(3600)  # {mode[5:]}"])
        time.sleep(3600)
    elif mode.startswith("probe:"):
        port, target = mode[6:].split(":", 1)
        probe(kernel, int(port), Path(target))
    elif mode.startswith("link:"):
        link(kernel, Path(mode[5:]))
    elif mode.startswith("egress:"):
        broker, declared = mode[7:].split(":")
        egress(kernel, int(broker), int(declared))
    elif mode.startswith("fill:"):
        # Fills the worker's disk through its clone, a MiB at a time.
        with open(kernel.parent / "filler.bin", "wb") as filler:
            for _ in range(int(mode[5:])):
                filler.write(b"\0" * 2**20)
                filler.flush()
    elif mode == "whoami":
        kernel.write_text(kernel.read_text().rstrip("\n") + f"\n\n# whoami: uid={os.getuid()} "
                          f"pid={os.getpid()} env={','.join(sorted(os.environ))}\n")
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
