"""The user's own end-to-end command: their program, run with the kept kernel and with the candidate.

The built-in end-to-end check (endtoend.py) times a synthetic decode step. This one runs
whatever program the user declared for the op (a serving benchmark, a training step)
and compares the one number it prints. The contract with that program:

- The declared string is split like a shell would (`shlex.split`) and run as that argv,
  with no shell, in the harness's working directory, with the harness's environment plus
  KERNEL_FILE (absolute path of the kernel file to load: the kept kernel or the
  candidate), KERNEL_OP (the op's name) and KERNEL_ROLE (`baseline` or `candidate`).
- It exits 0, and the last non-blank line of its stdout is one JSON object:

      {"metric": "tokens_per_s", "value": 1234.5, "higher_is_better": true}

  `metric`: a non-empty string, the same on every run; `value`: a positive finite
  number (the comparison is relative); `higher_is_better`: optional, default false (the
  value is a time or a cost). Other keys are ignored; earlier lines are the program's own.

Runs alternate, kept kernel first: A B A B …, ROUNDS rounds, so drift (clocks, heat,
other load) hits both sides alike. After the first round, a round starts only while it
fits in the time budget (judged by the slowest round so far). Each run is killed after
the per-run timeout, and whatever it started is killed when it ends, so no leftover
process weighs on the next run.

The `e2e-command` guard fails when the candidate is significantly worse on the metric
(stats.compare: p < 0.01, a CI that excludes no change, an effect over 0.5%), or when a
run with it breaks (exits non-zero, prints no usable number, times out) once the kept
kernel's run of the same round went through. It warns when the command cannot run at
all (not found, breaks with the kept kernel, changes its metric), and passes otherwise.

The candidate runs inside the user's program with no sandbox: this check guards against
a kernel that slows down the user's real workload, and is only as trustworthy as that
program. Correctness and the kernel timing, judged in isolated processes, come first.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from runners.harness.children import BASELINE, CANDIDATE
from runners.harness.result import Guard
from runners.harness.seeds import derive_seed
from runners.harness.stats import MIN_EFFECT, P_THRESHOLD, compare

GUARD = "e2e-command"
# The fewest runs a side with which Mann–Whitney can reach p < P_THRESHOLD: fewer can
# never be called significant, more cost whole program runs.
ROUNDS = 6
BUDGET_S = 120.0
RUN_TIMEOUT_S = 300.0
# Enough of stderr to show the error a program died with, not its whole log.
STDERR_TAIL_CHARS = 1500
STDOUT_TAIL_BYTES = 64 * 1024
_ROLE_LABELS = {BASELINE: "with the kept kernel", CANDIDATE: "with the candidate"}


class CommandFailed(Exception):
    """One run of the command gave no usable number; `role` is the side it ran for
    (None: the command itself is unusable, whichever kernel it gets)."""

    def __init__(self, detail: str, role: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.role = role


@dataclass(frozen=True)
class Reading:
    """What one run printed."""

    metric: str
    value: float
    higher_is_better: bool


def check(
    command: str,
    *,
    op: str,
    candidate: Path,
    baseline: Path,
    secret_seed: int,
    budget_s: float = BUDGET_S,
    run_timeout_s: float = RUN_TIMEOUT_S,
    say: Callable[[str], None] = lambda message: None,
) -> tuple[dict[str, Any], Guard]:
    """Runs the command for both kernels; returns the `e2e.command` JSON and the guard.

    Whatever the command does, this returns: a command that cannot run is a warning,
    one that breaks only with the candidate (after running with the kept kernel) a failure.
    """
    try:
        argv = _argv(command)
        readings = _run_rounds(argv, op=op, files={BASELINE: baseline, CANDIDATE: candidate},
                               budget_s=budget_s, run_timeout_s=run_timeout_s, say=say)
    except CommandFailed as failure:
        guard = _failure_guard(failure)
        return {"command": command, "error": guard.detail}, guard
    report = _report(command, readings, rng=np.random.default_rng(derive_seed(secret_seed, GUARD)))
    return report, _guard(report, budget_s=budget_s)


def _failure_guard(failure: CommandFailed) -> Guard:
    if failure.role == CANDIDATE:  # the kept kernel's run of the same round went through
        return Guard(GUARD, "fail", f"the end-to-end command breaks with the candidate: {failure.detail}")
    return Guard(GUARD, "warn", f"the end-to-end command could not run: {failure.detail}")


def _argv(command: str) -> list[str]:
    try:
        argv = shlex.split(command)
    except ValueError as error:
        raise CommandFailed(f"cannot split {command!r} into arguments: {error}") from None
    if not argv:
        raise CommandFailed("the declared command is empty")
    return argv


def _run_rounds(argv: list[str], *, op: str, files: dict[str, Path], budget_s: float,
                run_timeout_s: float, say: Callable[[str], None]) -> dict[str, list[Reading]]:
    readings: dict[str, list[Reading]] = {BASELINE: [], CANDIDATE: []}
    started = time.monotonic()
    slowest_round = 0.0
    for number in range(1, ROUNDS + 1):
        if number > 1 and time.monotonic() - started + slowest_round > budget_s:
            break
        round_started = time.monotonic()
        for role in (BASELINE, CANDIDATE):
            env = {**os.environ, "KERNEL_FILE": str(files[role].resolve()), "KERNEL_OP": op,
                   "KERNEL_ROLE": role}
            reading = _run_once(argv, env=env, timeout_s=run_timeout_s, role=role, number=number)
            if readings[BASELINE]:
                _same_metric(readings[BASELINE][0], reading, role=role)
            readings[role].append(reading)
            say(f"end-to-end command, run {number} {_ROLE_LABELS[role]}: "
                f"{reading.metric} = {reading.value:.4g}")
        slowest_round = max(slowest_round, time.monotonic() - round_started)
    return readings


def _run_once(argv: list[str], *, env: dict[str, str], timeout_s: float, role: str,
              number: int) -> Reading:
    where = f"run {number} {_ROLE_LABELS[role]}"
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        try:
            # A session of its own, so a timeout or the end of the run takes down
            # everything the program started, not just its first process.
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                       env=env, start_new_session=True)
        except OSError as error:
            raise CommandFailed(_not_started(argv[0], error)) from None
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(process)
            raise CommandFailed(f"{where} ran past its timeout of {timeout_s:g} s and was killed",
                                role) from None
        _kill_session(process)
        if status != 0:
            raise CommandFailed(f"{where} {_exit_reason(status)}: {_stderr_tail(stderr)}", role)
        try:
            return _reading(_last_line(stdout))
        except ValueError as problem:
            raise CommandFailed(f"{where} {problem}", role) from None


def _not_started(program: str, error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return f"command not found: {program!r} (neither a file nor on PATH)"
    return f"cannot start {program!r}: {error.strerror or error}"


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the program left nothing running
    process.wait()


def _exit_reason(status: int) -> str:
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"was killed by {signal.Signals(-status).name}"
    except ValueError:  # a signal Python has no name for
        return f"was killed by signal {-status}"


def _stderr_tail(stderr: BinaryIO) -> str:
    text = _tail(stderr, STDERR_TAIL_CHARS * 4).decode("utf-8", errors="replace").strip()
    if not text:
        return "nothing on stderr"
    return ("…" if len(text) > STDERR_TAIL_CHARS else "") + text[-STDERR_TAIL_CHARS:]


def _last_line(stdout: BinaryIO) -> str:
    lines = _tail(stdout, STDOUT_TAIL_BYTES).decode("utf-8", errors="replace").splitlines()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _tail(file: BinaryIO, size: int) -> bytes:
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - size))
    return file.read()


def _reading(line: str) -> Reading:
    """The reading on a run's last stdout line; ValueError says what is wrong with it."""
    if not line:
        raise ValueError('printed nothing on stdout; its last line must be one JSON object such as '
                         '{"metric": "step_ms", "value": 12.5}')
    try:
        found = json.loads(line)
    except json.JSONDecodeError:
        raise ValueError(f"printed no JSON on its last stdout line: {_shown(line)}") from None
    if not isinstance(found, dict):
        raise ValueError(f"printed JSON that is not an object on its last stdout line: {_shown(line)}")
    metric, value = found.get("metric"), found.get("value")
    higher_is_better = found.get("higher_is_better", False)
    if not isinstance(metric, str) or not metric.strip():
        raise ValueError(f'printed "metric": {_shown(metric)}, not a non-empty string')
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f'printed "value": {_shown(value)}, not a number')
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f'printed "value": {value}, not a positive finite number')
    if not isinstance(higher_is_better, bool):
        raise ValueError(f'printed "higher_is_better": {_shown(higher_is_better)}, not true or false')
    return Reading(metric=metric, value=float(value), higher_is_better=higher_is_better)


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "…"


def _same_metric(first: Reading, reading: Reading, *, role: str) -> None:
    """Two runs are comparable only if they measured the same thing the same way."""
    if (first.metric, first.higher_is_better) != (reading.metric, reading.higher_is_better):
        # Not blamed on a side: the program decides what it prints.
        raise CommandFailed(f"the metric changed between runs: {_described(first)} at first, "
                            f"then {_described(reading)} {_ROLE_LABELS[role]}")


def _described(reading: Reading) -> str:
    return f"{reading.metric!r} ({'higher' if reading.higher_is_better else 'lower'} is better)"


def _report(command: str, readings: dict[str, list[Reading]], *,
            rng: np.random.Generator) -> dict[str, Any]:
    baseline = [reading.value for reading in readings[BASELINE]]
    candidate = [reading.value for reading in readings[CANDIDATE]]
    first = readings[BASELINE][0]
    # Every sample is a fresh process, so process-to-process luck is already in the
    # spread Mann–Whitney sees: no A/A floor is needed as in the kernel timing, where a
    # side's samples all share one process. Only the smallest effect worth calling is set.
    found = compare(baseline, candidate, rng=rng, noise=MIN_EFFECT)
    # compare() speaks of times: its "_ms" medians are the metric's, in its own unit, and
    # its speedup CI is of baseline / candidate, so the delta's bounds come swapped.
    low, high = found.speedup_ci
    delta_pct = 100 * (found.candidate_ms / found.baseline_ms - 1)
    worse = delta_pct < 0 if first.higher_is_better else delta_pct > 0
    return {
        "command": command, "metric": first.metric, "higher_is_better": first.higher_is_better,
        "baseline": found.baseline_ms, "candidate": found.candidate_ms,
        "delta_pct": delta_pct, "delta_ci_pct": [100 * (1 / high - 1), 100 * (1 / low - 1)],
        "p_value": found.p_value, "significant": found.significant,
        "worse": found.significant and worse, "runs": len(candidate),
        "baseline_values": baseline, "candidate_values": candidate,
    }


def _guard(report: dict[str, Any], *, budget_s: float) -> Guard:
    low, high = report["delta_ci_pct"]
    better = "higher" if report["higher_is_better"] else "lower"
    numbers = (f"{report['metric']} {report['candidate']:.4g} with the candidate vs "
               f"{report['baseline']:.4g} with the kept kernel ({report['delta_pct']:+.1f}%, 95% CI "
               f"[{low:+.1f}%, {high:+.1f}%], p={report['p_value']:.2g}; median of "
               f"{_runs(report['runs'])} each, {better} is better)")
    if report["worse"]:
        return Guard(GUARD, "fail", f"significantly worse end to end: {numbers}")
    if report["significant"]:
        return Guard(GUARD, "pass", f"significantly better end to end: {numbers}")
    verdict = f"no significant change: {numbers}"
    if report["runs"] < ROUNDS:
        verdict += (f"; only {_runs(report['runs'])} a side fit in the budget of {budget_s:g} s, "
                    f"and {ROUNDS} are needed before a difference can reach p < {P_THRESHOLD}")
    return Guard(GUARD, "pass", verdict)


def _runs(count: int) -> str:
    return f"{count} run" + ("" if count == 1 else "s")
