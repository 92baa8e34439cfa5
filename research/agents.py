"""An agent sweep: an external coding agent proposes each candidate by editing the kernel.

One proposal at a time: a private clone of the kernel workspace at the sweep's base
(with the sweep's kernel in `kernels/<op>/<hardware>/kept.py`) gets the context file
(`research.agent_context`), the sweep's agent command runs in it under a time limit,
and its diff against the base is checked before anything is evaluated. A change
outside the thesis's allowed paths, a kernel that is not Python, is not written in the
required DSL or changes what the harness holds fixed (`runners.harness.protected`) is
refused with its reason; anything else becomes a candidate through
`candidates.candidates_add`: the kernel, and the modules of the shared kernel code
(`kernels/lib/`) it changed, which the candidate is evaluated with. Refused proposals
count toward the budget, and the next proposal is asked for once the last one's result
is in (`sweeps.sweep_continue`).

Only commands an administrator declared (`AGENT_COMMANDS`, a TOML file of
name = "command line", or of tables that also say what the jail lets it reach) can run:
a sweep names one, never free text. Every run is jailed (`research.agent_jail`), and
its change is read with a git directory the agent never saw (`workspace.scratch_changes`).
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shlex
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Max
from django.utils import timezone

from research import agent_egress, agent_jail, candidates, queueing, sweeps
import workspace
from research.agent_context import CONTEXT_FILE, agent_context
from research.events import event_append
from research.hardware import HARDWARE
from research.models import Candidate, Event, Sweep, Thesis
from runners import python_source
from runners.harness import protected
from runners.harness.dsl import static_check

AGENT = Sweep.Strategy.AGENT
# Events of a proposal: started, then exactly one of the others.
STARTED, PROPOSED, REFUSED, DISCARDED = "agent.started", "agent.proposed", "candidate.refused", "agent.discarded"
# A started proposal with no outcome this long after its time limit died with its worker.
STALE_MARGIN_S = 300
# A kernel file larger than this is not read.
MAX_KERNEL_BYTES = 1_000_000
# What the agent printed, kept for a refusal that needs it (the last characters).
LOG_TAIL_CHARS = 2000


def agent_declarations() -> dict[str, agent_jail.Declaration]:
    """Declared agents, by name (settings.AGENT_COMMANDS). Raises JailError for one
    that is not a declaration."""
    declared = getattr(settings, "AGENT_COMMANDS", {}) or {}
    return {name: agent_jail.declaration(name, value) for name, value in declared.items()}


def agent_commands() -> dict[str, str]:
    """Declared agent commands, name -> command line."""
    try:
        return {name: declared.command for name, declared in agent_declarations().items()}
    except agent_jail.JailError as error:
        raise ValidationError({"agent_command": str(error)}) from error


def agent_command_resolve(name_or_command: str) -> tuple[str, str]:
    """(name, command line) of a declared command, given its name or its exact line."""
    commands = agent_commands()
    if name_or_command in commands:
        return name_or_command, commands[name_or_command]
    for name, command in commands.items():
        if command == name_or_command:
            return name, command
    if not commands:
        raise ValidationError({"agent_command": "no agent command is declared (AGENT_COMMANDS_FILE)"})
    raise ValidationError({"agent_command": f"{name_or_command[:80]!r} is not a declared agent command"})


def _agent_name(command: str) -> str:
    return next((name for name, line in agent_commands().items() if line == command), "")


def agent_sweep_start(*, thesis: Thesis, started_by, kernel: str, budget: int, hardware: str,
                      time_budget_s: int | None, patience: int | None, agent_command: str) -> Sweep:
    """Create an agent sweep (every other argument already checked by `sweep_start`) and
    ask for its first proposal once it is committed."""
    _, command = agent_command_resolve(agent_command or "")
    try:
        if not shlex.split(command):
            raise ValueError("empty")
    except ValueError as error:
        raise ValidationError({"agent_command": f"the declared command cannot be split: {error}"}) from error
    kept = workspace.kept_kernel(thesis.op, hardware)
    with transaction.atomic():
        sweep = Sweep.objects.create(
            thesis=thesis, started_by=started_by, kernel=kernel, strategy=AGENT, budget=budget,
            time_budget_s=time_budget_s, patience=patience, agent_command=command,
            seed=secrets.randbits(32), hardware=hardware, queue=HARDWARE[hardware].queue, total=budget,
            base_commit=kept.commit, baseline_source=kept.source, baseline_kernel=kept.name,
        )
        Sweep.objects.filter(pk=sweep.pk).update(context=agent_context(sweep=sweep, proposal=1))
        sweep.refresh_from_db()
        event_append(sweep_id=sweep.pk, type="sweep.created",
                     payload={"kernel": kernel, "strategy": AGENT, "total": sweep.total, "done": 0})
        transaction.on_commit(lambda: queueing.proposal_enqueue(sweep.pk))
    return sweep


def proposal_in_flight(sweep: Sweep) -> Event | None:
    """The `agent.started` event of a proposal still running, if there is one."""
    last = sweep.events.filter(type__in=[STARTED, PROPOSED, REFUSED, DISCARDED]).order_by("-seq").first()
    limit = timedelta(seconds=settings.AGENT_TIME_LIMIT_S + STALE_MARGIN_S)
    if last is not None and last.type == STARTED and last.created_at > timezone.now() - limit:
        return last
    return None


def proposal_wanted(sweep: Sweep) -> bool:
    """Whether the sweep should ask its agent for the next proposal now: nothing of it is
    queued, being evaluated or being proposed, and its budget is not planned yet."""
    planned = sweep.candidates.exclude(status=Candidate.Status.CANCELLED)
    return (not planned.filter(status__in=[Candidate.Status.QUEUED, Candidate.Status.RUNNING]).exists()
            and planned.count() < sweep.total and proposal_in_flight(sweep) is None)


@dataclass
class Proposal:
    """What came out of one run of the agent: a kernel source, or why it is refused."""

    source: str = ""
    refusal: str = ""
    files: list[str] = field(default_factory=list)
    # The changed modules of the shared kernel code (kernels/lib/), by workspace path:
    # their text, or None for one deleted. Committed beside the kernel.
    lib: dict[str, str | None] = field(default_factory=dict)


def proposal_make(*, sweep_id: int, task_id: str = "") -> None:
    """Claim the sweep's next proposal, run the agent, record a candidate or a refusal."""
    claimed = _proposal_claim(sweep_id=sweep_id, task_id=task_id)
    if claimed is None:
        return
    sweep, proposal_number = claimed
    try:
        proposal = proposal_run(sweep=sweep, proposal_number=proposal_number)
    except Exception as error:  # noqa: BLE001 — recorded, so the sweep goes on and says why
        proposal = Proposal(refusal=f"the agent could not be run: {error}")
    _proposal_record(sweep_id=sweep_id, proposal=proposal)


def _proposal_claim(*, sweep_id: int, task_id: str) -> tuple[Sweep, int] | None:
    """Mark a proposal as started, under the sweep's row lock: one at a time per sweep.

    A redelivered task (its worker died) may take over the proposal it had started.
    """
    with transaction.atomic():
        sweep = Sweep.objects.select_for_update(of=("self",)).select_related(
            "thesis", "thesis__author", "thesis__evidence", "started_by").get(pk=sweep_id)
        if sweep.strategy != AGENT or sweep.status not in {Sweep.Status.QUEUED, Sweep.Status.RUNNING} \
                or sweep.stop_reason:
            return None
        started = proposal_in_flight(sweep)
        if started is not None and not (task_id and started.payload.get("task") == task_id):
            return None
        planned = sweep.candidates.exclude(status=Candidate.Status.CANCELLED)
        if planned.filter(status__in=[Candidate.Status.QUEUED, Candidate.Status.RUNNING]).exists() \
                or planned.count() >= sweep.total:
            return None
        if sweep.agent_command not in agent_commands().values():
            sweeps.sweep_stop(sweep, "its agent command is no longer declared (AGENT_COMMANDS_FILE)")
            return None
        if Sweep.objects.filter(pk=sweep.pk, status=Sweep.Status.QUEUED).update(status=Sweep.Status.RUNNING):
            event_append(sweep_id=sweep.pk, type="sweep.started", payload={"total": sweep.total})
        proposal_number = planned.count() + 1
        context = agent_context(sweep=sweep, proposal=proposal_number)
        Sweep.objects.filter(pk=sweep.pk).update(context=context)
        sweep.context = context
        number = (sweep.candidates.aggregate(last=Max("number"))["last"] or 0) + 1
        event_append(sweep_id=sweep.pk, type=STARTED,
                     payload={"number": number, "proposal": proposal_number, "task": task_id})
    return sweep, proposal_number


def _allowed(path: str, allowed: list[str]) -> bool:
    path = posixpath.normpath(path)
    return any(path == entry or path.startswith(entry.rstrip("/") + "/") for entry in allowed)


def _agent_env(*, checkout: Path, context_file: Path, kernel_file: str, sweep: Sweep, proposal_number: int) -> dict:
    """What the agent is told, beside the jail's allow-list (`agent_jail.environment`)."""
    return dict(
        KERNEL_LAB_CONTEXT=str(context_file), KERNEL_LAB_KERNEL=kernel_file, KERNEL_LAB_CHECKOUT=str(checkout),
        KERNEL_LAB_OP=sweep.thesis.op, KERNEL_LAB_DSL=sweep.thesis.required_dsl,
        KERNEL_LAB_SWEEP=str(sweep.pk), KERNEL_LAB_PROPOSAL=str(proposal_number),
    )


def _tail(log: Path) -> str:
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    text = text.strip()
    return ("…" + text[-LOG_TAIL_CHARS:]) if len(text) > LOG_TAIL_CHARS else text


def _run_command(argv: list[str], *, cwd: Path, declared: agent_jail.Declaration, env: dict, log: Path,
                 time_limit_s: float) -> str:
    """Run the agent in its jail, in a process group of its own; '' when it exited 0,
    else why not."""
    egress = (agent_egress.Egress(declared.hosts, allow_private=settings.AGENT_EGRESS_ALLOW_PRIVATE)
              if declared.hosts else None)
    try:
        return _run_jailed(argv, cwd=cwd, declared=declared, env=env, log=log, time_limit_s=time_limit_s,
                           egress=egress)
    finally:
        if egress is not None:
            egress.close()


def _run_jailed(argv: list[str], *, cwd: Path, declared: agent_jail.Declaration, env: dict, log: Path,
                time_limit_s: float, egress: agent_egress.Egress | None) -> str:
    try:
        jailed = agent_jail.command(argv, checkout=cwd, declared=declared,
                                    env=agent_jail.environment(declared, env),
                                    egress=egress.socket_path if egress else None)
    except agent_jail.JailError as error:
        return f"the agent was not run: {error}"
    with open(log, "wb") as output:
        limit = settings.AGENT_MAX_FILE_BYTES
        # No file it writes grows past the limit (the kernel stops the write with SIGXFSZ),
        # and it dumps no core: the jail and the agent inherit both from prlimit.
        limited = ["prlimit", f"--fsize={limit}", "--core=0", "--", *jailed]
        try:
            process = subprocess.Popen(limited, cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=output,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as error:
            return f"the agent command could not start: {error}"
        try:
            code = process.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            return f"the agent ran past its time limit of {time_limit_s:g} s and was stopped"
        finally:
            _kill_group(process.pid)  # whatever it left running in the background
    if code == 0:
        return ""
    tail = _tail(log)
    # Killed by SIGXFSZ (itself, or its jail reporting it), or the write refused with
    # EFBIG where the agent ignores the signal (Python does).
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in tail:
        return f"the agent wrote a file past the limit of {limit:,} bytes and was stopped"
    return f"the agent exited with status {code}" + (f": {tail}" if tail else "")


def _declared(command: str) -> agent_jail.Declaration:
    """The declaration of the sweep's command line (a command no longer declared runs
    with the defaults: no network, nothing more to read)."""
    return next((declared for declared in agent_declarations().values() if declared.command == command),
                agent_jail.Declaration(command=command))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def proposal_run(*, sweep: Sweep, proposal_number: int) -> Proposal:
    """Run the sweep's agent once in a scratch clone and judge its diff (no evaluation)."""
    thesis = sweep.thesis
    kernel_file = workspace.kept_path(thesis.op, sweep.hardware)
    fork, kernel_source = sweeps.sweep_fork(sweep)
    # Removed whatever happens, even if the agent left files it made read-only.
    with tempfile.TemporaryDirectory(prefix=f"kernel-lab-agent-{sweep.pk}-", ignore_cleanup_errors=True) as scratch:
        checkout = Path(scratch) / "checkout"
        base = workspace.scratch_checkout(fork or sweep.base_commit, checkout, files={kernel_file: kernel_source})
        context_file = checkout / CONTEXT_FILE
        context_file.write_text(sweep.context, encoding="utf-8")
        # The change is read with this copy of the clone's git directory, which the agent
        # never sees: its own may hold config (core.fsmonitor, hooks) that git would run.
        git_dir = workspace.scratch_git_dir(checkout, Path(scratch) / "git")
        workspace.scratch_exclude(git_dir, CONTEXT_FILE)
        try:
            declared = _declared(sweep.agent_command)
            agent_jail.prepare(checkout)
        except agent_jail.JailError as error:
            return Proposal(refusal=f"the agent was not run: {error}")
        failure = _run_command(
            shlex.split(sweep.agent_command), cwd=checkout, log=Path(scratch) / "agent.log", declared=declared,
            env=_agent_env(checkout=checkout, context_file=context_file, kernel_file=kernel_file,
                           sweep=sweep, proposal_number=proposal_number),
            time_limit_s=float(settings.AGENT_TIME_LIMIT_S))
        if failure:
            return Proposal(refusal=failure)
        files = workspace.scratch_changes(checkout, base, git_dir=git_dir)
        lib_changed = [name for name in files if name.startswith(f"{workspace.LIB_DIR}/") and name.endswith(".py")]
        read = {}
        for name in [kernel_file, *lib_changed]:
            unsafe = _unsafe_to_read(checkout, name)
            if unsafe:
                return Proposal(files=files, refusal=unsafe)
            file = checkout / name
            read[name] = file.read_text(encoding="utf-8", errors="replace") if file.is_file() else None
    source = read.pop(kernel_file) or ""
    return Proposal(source=source, files=files, lib=read,
                    refusal=proposal_refusal(thesis=thesis, kernel_file=kernel_file, files=files, source=source,
                                             kept_source=sweep.baseline_source))


def _unsafe_to_read(checkout: Path, name: str) -> str:
    """Why the checkout's file `name` is not read ('' when it may be): only a plain file
    of a kernel's size is, since a link could point anywhere on the worker."""
    file = checkout / name
    if file.is_symlink():
        return f"{name} was replaced by a symbolic link"
    if os.path.realpath(file) != os.path.join(os.path.realpath(checkout), name):
        return f"a folder above {name} was replaced by a symbolic link"
    if file.is_file() and file.stat().st_size > MAX_KERNEL_BYTES:
        return f"{name} is larger than {MAX_KERNEL_BYTES} bytes"
    return ""


def proposal_refusal(*, thesis: Thesis, kernel_file: str, files: list[str], source: str, kept_source: str) -> str:
    """Why a proposal may not be evaluated ('' when it may), in the order a reviewer would ask."""
    allowed = [kernel_file, *thesis.allowed_paths]
    outside = [path for path in files if not _allowed(path, allowed)]
    if outside:
        shown = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
        why = ""
        if any(path.startswith(f"{workspace.LIB_DIR}/") for path in outside):
            why = (f"; {workspace.LIB_DIR}/ is shared kernel code, which every kernel that imports it "
                   "runs: a candidate may change a module of it only where the thesis's allowed paths name it")
        return f"changes outside the allowed paths: {shown} (allowed: {', '.join(allowed)}){why}"
    if kernel_file not in files:
        return f"the agent did not change {kernel_file}"
    if not source.strip():
        return f"the agent deleted or emptied {kernel_file}"
    try:
        python_source.parse(source)
    except SyntaxError as error:
        return f"{kernel_file} is not valid Python: {error.msg} (line {error.lineno})"
    if thesis.required_dsl != "torch":
        status, why = static_check(source, thesis.required_dsl)
        if status != "pass":
            return f"not written in the required DSL ({thesis.required_dsl}): {why}"
    verdict = protected.check(source, kept_source)
    if verdict is not None and verdict[0] == "fail":
        return verdict[1]
    return ""


def _proposal_record(*, sweep_id: int, proposal: Proposal) -> None:
    with workspace.lock(), transaction.atomic():
        sweep = Sweep.objects.select_for_update(of=("self",)).select_related(
            "thesis", "started_by").get(pk=sweep_id)
        planned = sweep.candidates.exclude(status=Candidate.Status.CANCELLED).count()
        if sweep.status not in {Sweep.Status.QUEUED, Sweep.Status.RUNNING, Sweep.Status.PAUSED} \
                or sweep.stop_reason or planned >= sweep.total:
            event_append(sweep_id=sweep.pk, type=DISCARDED,
                         payload={"reason": f"the sweep is {sweep.status}" + (
                             f" ({sweep.stop_reason})" if sweep.stop_reason else "")})
            return
        number = (sweep.candidates.aggregate(last=Max("number"))["last"] or 0) + 1
        params = {"agent": _agent_name(sweep.agent_command) or "agent"}
        if proposal.refusal:
            _candidate_refuse(sweep=sweep, number=number, params=params, proposal=proposal)
            return
        fork, kernel_source = sweeps.sweep_fork(sweep)
        candidates.candidates_add(sweep=sweep, kernel_source=kernel_source, fork=fork, points=[params],
                                  sources=[proposal.source], proposed_by=AGENT, lib_changes=proposal.lib)
        kernel_file = workspace.kept_path(sweep.thesis.op, sweep.hardware)
        event_append(sweep_id=sweep.pk, type=PROPOSED, payload={
            "number": number, "params": params,
            # Changes inside the allowed paths beside the kernel and its shared code are
            # not evaluated: the harness runs one kernel file with the lib it imports.
            "ignored": [path for path in proposal.files if path != kernel_file and path not in proposal.lib],
        })


def _candidate_refuse(*, sweep: Sweep, number: int, params: dict, proposal: Proposal) -> None:
    """Store a refused proposal as a candidate that is never evaluated, counted as done."""
    Candidate.objects.create(
        sweep=sweep, number=number, params=params, source=proposal.source, proposed_by=AGENT,
        status=Candidate.Status.REFUSED, refusal=proposal.refusal, finished_at=timezone.now())
    Sweep.objects.filter(pk=sweep.pk).update(done=F("done") + 1)
    sweep.refresh_from_db()
    event_append(sweep_id=sweep.pk, type=REFUSED, payload={
        "number": number, "params": params, "refusal": proposal.refusal,
        "done": sweep.done, "total": sweep.total, **candidates.verdict_tally(sweep),
    })
    sweeps.sweep_finish_if_done(sweep)
    if sweep.done < sweep.total:
        transaction.on_commit(lambda: sweeps.sweep_continue(sweep_id=sweep.pk))
