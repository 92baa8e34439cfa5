"""A sweep run by the harness alone, on a host that reaches neither Redis nor the database.

Each point of the kernel's SPACE becomes a candidate file (the kernel with its PARAMS
rewritten, exactly as the app materialises it), evaluated by the same `evaluate` as
`python -m runners.harness evaluate`; its result is appended to the results file
(runners.harness.results_file) and flushed before the next one starts, so a crash, a
lost connection or Ctrl-C leaves every finished candidate on disk. The app imports
the file later (`manage.py import_results`, or `POST /api/theses/{id}/results`).

Every candidate is judged on one secret seed, and what the judge makes from it is kept
for the next (runners.harness.memo): the sources are all written before the first runs.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from runners import space
from runners.harness import dsl as dsls
from runners.harness import imports, memo, results_file
from runners.harness.e2e_command import BUDGET_S as E2E_COMMAND_BUDGET_S
from runners.harness.evaluate import UsageError, evaluate
from runners.harness.machine import machine_state
from runners.harness.seeds import draw_secret_seed
from runners.ops import Op, get_op

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _kernel_file(op: Op, kernel: str) -> Path:
    """A kernel file, or the name of one the op ships (`blocked`)."""
    path = Path(kernel)
    if path.is_file():
        return path.resolve()
    shipped = op.kernels().get(kernel)
    if shipped is not None:
        return shipped
    raise UsageError(f"kernel file not found: {kernel} (the op ships: {', '.join(op.kernels())})")


def _harness_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _harness_version() -> str | None:
    try:
        return metadata.version("kernel-lab")
    except metadata.PackageNotFoundError:
        return None


def _hardware(device: str) -> str | None:
    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()


def _harness_failure(reason: str) -> dict[str, Any]:
    """A candidate whose evaluation could not complete: rejected, with why (the shape the
    app records for a worker's failed evaluation)."""
    return {"verdict": "rejected", "correct": False, "harness_failed": True, "error": reason,
            "guards": [{"name": "harness", "status": "fail", "detail": reason}],
            "workloads": [], "e2e": None, "dispatch": None}


def sweep(
    op_name: str,
    kernel: str,
    *,
    out: str | os.PathLike[str],
    strategy: str = "grid",
    budget: int,
    seed: int | None = None,
    points: list[dict[str, Any]] | None = None,
    device: str = "cpu",
    dsl: str | None = None,
    context_lengths: list[int] | None = None,
    batch_sizes: list[int] | None = None,
    baseline: str | os.PathLike[str] | None = None,
    time_budget_s: float = 1.0,
    e2e_command: str | None = None,
    e2e_command_budget_s: float = E2E_COMMAND_BUDGET_S,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Evaluate up to `budget` points of the kernel's SPACE; returns the candidate lines.

    `points` (with the `listed` strategy) names the points to evaluate, in order.

    Raises UsageError (or UnknownOpError, WorkloadError) before the file is created when
    the request is wrong. `out` must not exist: a finished run is never overwritten.
    """
    say = progress or (lambda message: None)
    op = get_op(op_name)
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: CUDA is not available here (torch {torch.__version__})")
    if device not in results_file.DEVICES:
        raise UsageError(f"unknown device {device!r} (known: {', '.join(results_file.DEVICES)})")
    kernel_path = _kernel_file(op, kernel)
    kernel_name = kernel_path.stem
    if not results_file.KERNEL_NAME.fullmatch(kernel_name):
        raise UsageError(f"kernel file name {kernel_path.name!r}: use letters, digits and _ only")
    dsl = dsl or dsls.kernel_dsl(kernel_path)
    if dsl not in dsls.DSLS:
        raise UsageError(f"unknown DSL {dsl!r} (known: {', '.join(dsls.DSLS)})")
    if not 1 <= budget:
        raise UsageError(f"the budget must be at least 1 candidate, not {budget}")
    source = kernel_path.read_text(encoding="utf-8")
    try:
        _, parameter_space = space.read_literals(source)
    except SyntaxError as error:
        raise UsageError(f"{kernel_path.name} is not Python: {error.msg} (line {error.lineno})") from None
    if not parameter_space:
        raise UsageError(f"{kernel_path.name} declares no SPACE to sweep")
    seed = secrets.randbits(32) if seed is None else seed
    try:
        points = space.sweep_points(parameter_space, strategy, budget, seed, points)
        sources = [space.materialize(source, point) for point in points]
    except ValueError as error:
        raise UsageError(f"{kernel_path.name}: {error}") from None
    baseline_path = op.baseline_path if baseline is None else Path(baseline)
    if not baseline_path.is_file():
        raise UsageError(f"baseline file not found: {baseline_path}")
    contexts = list(context_lengths) if context_lengths else op.default_context_lengths(device)
    batches = list(batch_sizes) if batch_sizes else op.default_batch_sizes(device)
    op.workloads(device, contexts, batches)  # WorkloadError now, not at the first candidate

    header = {
        "format": results_file.FORMAT, "version": results_file.VERSION, "run": uuid.uuid4().hex,
        "op": op.name, "kernel": kernel_name, "kernel_source": source,
        "strategy": strategy, "seed": seed, "budget": budget, "points": len(points),
        "device": device, "hardware": _hardware(device), "dsl": dsl,
        "context_lengths": contexts, "batch_sizes": batches, "time_budget_s": time_budget_s,
        "baseline_kernel": baseline_path.stem,
        "baseline_source": baseline_path.read_text(encoding="utf-8"),
        "lib_files": _lib_files(source, kernel_path.name),
        "harness": {"version": _harness_version(), "commit": _harness_commit(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "machine": machine_state(device),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    lines = []
    # One secret seed for every candidate, and what the judge makes from it kept across
    # them (runners.harness.memo): the sources were all fixed above, before any ran, so
    # no candidate can be written from what an earlier one's result revealed.
    judge_seed, remembered = draw_secret_seed(), memo.Memo(memo.limit_bytes(device))
    # "x": refuse an existing file rather than overwrite a finished run's results.
    with open(out, "x", encoding="utf-8") as handle, \
            tempfile.TemporaryDirectory(prefix="sweep-") as scratch:
        _append(handle, header)
        for number, (point, text) in enumerate(zip(points, sources), start=1):
            say(f"candidate {number}/{len(points)}: {space_description(point)}")
            candidate = Path(scratch) / str(number) / f"{kernel_name}.py"
            candidate.parent.mkdir()
            candidate.write_text(text, encoding="utf-8")
            try:
                result = evaluate(
                    op.name, candidate, device=device, context_lengths=contexts, batch_sizes=batches,
                    time_budget_s=time_budget_s, progress=say, dsl=dsl, baseline=baseline_path,
                    e2e_command=e2e_command, e2e_command_budget_s=e2e_command_budget_s,
                    seed=judge_seed, memo=remembered,
                ).to_dict()
            except UsageError:
                raise
            except Exception as error:  # noqa: BLE001 — one broken evaluation must not end the sweep
                result = _harness_failure(f"the evaluation failed: {type(error).__name__}: {error}")
                result.update(op=op.name, device=device)
            line = {"number": number, "params": point, "source": text, "result": result}
            _append(handle, line)
            lines.append(line)
            say(f"candidate {number}: {result['verdict']} ({remembered.summary()})")
    return lines


def _lib_files(source: str, name: str) -> list[dict[str, str]]:
    """The shared code the kernel imports, for the header: what every candidate ran with
    (a PARAMS point changes the kernel's own file only). A kernel whose imports are
    refused lists none; each evaluation rejects it and says why."""
    try:
        files = imports.resolve(source, name)
    except imports.ImportRefused:
        return []
    return [{**file.provenance(), "source": file.text} for file in files]


def space_description(point: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in point.items()) or "as shipped"


def _append(handle: Any, entry: dict[str, Any]) -> None:
    handle.write(json.dumps(entry, allow_nan=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())
