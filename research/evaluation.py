"""Runs the harness on one candidate in a child process and returns its JSON result.

The child is `python -m runners.harness evaluate … --json`, the same command a GPU host
runs by hand: one code path. A crash of the candidate ends the child, not the worker.
The shared kernel code the candidate and the kept kernel import is the kernel
workspace's, as their commits hold it (`--lib`, `--baseline-lib`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from django.conf import settings

import workspace
from research.candidates import harness_failure

PROJECT_ROOT = Path(settings.BASE_DIR)


def evaluate_source(
    *,
    op: str,
    source: str,
    device: str,
    context_lengths: list[int],
    batch_sizes: list[int],
    dsl: str = "torch",
    baseline_source: str = "",
    baseline_kernel: str = "",
    lib_commit: str = "",
    baseline_lib_commit: str = "",
) -> dict:
    """`baseline_source`: the kernel to time against (the workspace's kept kernel when the
    sweep started); empty for the op's shipped baseline. `baseline_kernel` names its file;
    the harness reads its DSL from its source, never from that name. The op's end-to-end
    command, when settings.E2E_COMMANDS declares one, runs with both kernels.

    `lib_commit` and `baseline_lib_commit`: the workspace commits whose kernels/lib/ the
    candidate and the kept kernel import as runners.kernel_lib (the candidate's own commit
    and its sweep's base); the shipped runners/kernel_lib where empty or where the commit
    holds no kernels/lib/."""
    with tempfile.TemporaryDirectory(prefix="candidate-") as scratch:
        try:
            lib = lib_folder(lib_commit, Path(scratch) / "lib")
            baseline_lib = lib_folder(baseline_lib_commit, Path(scratch) / "kept-lib")
        except workspace.WorkspaceError as error:
            return harness_failure(f"the shared kernel code (kernels/lib) could not be read: {error}")
        path = Path(scratch) / "candidate.py"
        path.write_text(source)
        kept = None
        if baseline_source:
            kept = Path(scratch) / kept_file_name(baseline_kernel)
            kept.parent.mkdir()
            kept.write_text(baseline_source)
        # The harness's unprivileged worker reads both through the jail: made under the
        # quick start's umask 077 they were this process's alone.
        for written in (path, kept):
            if written is not None:
                written.chmod(0o644)
        arguments = harness_arguments(
            op=op, candidate=str(path), device=device, dsl=dsl, context_lengths=context_lengths,
            batch_sizes=batch_sizes, baseline=str(kept) if kept else None,
            lib=str(lib) if lib else None, baseline_lib=str(baseline_lib) if baseline_lib else None)
        try:
            result = harness_json(arguments, timeout_s=settings.CANDIDATE_TIME_LIMIT_S, what="the evaluation")
        except HarnessFailed as failure:
            return harness_failure(str(failure))
    if "verdict" not in result:
        return harness_failure("the harness printed JSON without a verdict")
    return result


class HarnessFailed(Exception):
    """The harness command ran past its limit, failed, or printed no JSON object."""


def harness_json(arguments: list[str], *, timeout_s: float, what: str) -> dict:
    """Runs `python -m runners.harness ARGUMENTS` in a child (the interpreter the workers
    are given) and returns the one JSON object it prints; HarnessFailed says why not."""
    command = [settings.HARNESS_PYTHON or sys.executable, *arguments]
    try:
        done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise HarnessFailed(f"{what} ran past its limit of {timeout_s:g} s") from None
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HarnessFailed(f"the harness exited with status {done.returncode}: {last_line}")
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise HarnessFailed("the harness did not print one JSON object") from None
    if not isinstance(result, dict):
        raise HarnessFailed("the harness did not print one JSON object")
    return result


def lib_folder(commit: str, folder: Path) -> Path | None:
    """`commit`'s kernels/lib/ written into `folder` as git holds it (the harness hashes
    these bytes), for --lib; None where the shipped runners/kernel_lib serves. Raises
    workspace.WorkspaceError."""
    files = workspace.lib_files(commit) if commit else None
    if files is None:
        return None
    for name, data in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return folder


def kept_file_name(baseline_kernel: str) -> str:
    """Where the kept kernel a candidate is timed against lies beside it."""
    return f"kept/{re.sub(r'[^A-Za-z0-9_]', '_', baseline_kernel) or 'kept'}.py"


def harness_arguments(*, op: str, candidate: str, device: str, dsl: str, context_lengths: list[int],
                      batch_sizes: list[int], baseline: str | None, seed: int | None = None,
                      lib: str | None = None, baseline_lib: str | None = None) -> list[str]:
    """The harness's command line after the interpreter, as a worker runs it: one place,
    so an exported candidate's REPRODUCE.md names the very run the lab made (`seed`, the
    one its result revealed, repeats its inputs)."""
    return [
        "-m", "runners.harness", "evaluate", op, candidate,
        "--device", device,
        "--dsl", dsl,
        "--json",
        "--ctx", ",".join(map(str, context_lengths)),
        "--batch", ",".join(map(str, batch_sizes)),
        "--time-budget", str(settings.HARNESS_TIME_BUDGET_S),
        *(["--baseline", baseline] if baseline else []),
        *(["--lib", lib] if lib else []),
        *(["--baseline-lib", baseline_lib] if baseline_lib else []),
        *(["--seed", str(seed)] if seed is not None else []),
        *_e2e_command_args(op),
    ]


def _e2e_command_args(op: str) -> list[str]:
    declared = settings.E2E_COMMANDS.get(op)
    # One argument with "=": a command starting with "-" is still the flag's value.
    return [f"--e2e-command={declared}"] if declared else []
