"""Writes: filing theses, starting sweeps, and recording what the runners found.

Every service takes keyword-only arguments, validates before it writes, runs in one
transaction and enqueues follow-up work only once that transaction has committed, so
bad input never leaves anything half-stored.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import F, Max
from django.utils import timezone

from research.events import event_append
from research.evidence import EvidenceError, parse_evidence
from research.hardware import HARDWARE, KERNEL_DSLS, MODEL_CONTEXTS
from research import proposers, workspace
from research.models import Candidate, Evidence, GuardFinding, Measurement, Sweep, Thesis
from research.provenance import worker_provenance
from reviews.diffs import character_name, hidden_characters
from reviews.live import publish_queue_changed
from runners import python_source
from runners import ops, space
from webhooks import payloads as webhook_payloads
from webhooks.services import webhook_event
from runners.harness.dsl import kernel_dsl

MAX_SWEEP_BUDGET = 500
MAX_SWEEP_TIME_BUDGET_S = 30 * 24 * 3600
MAX_ALLOWED_PATHS = 50
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Upload:
    """An uploaded file, already read: services never see request objects."""

    name: str
    data: bytes


def _op_or_error(op_name: str) -> ops.Op:
    try:
        return ops.get_op(op_name)
    except ops.UnknownOpError as exc:
        raise ValidationError({"op": str(exc)}) from exc


_PATH_CHARACTERS = re.compile(r"[A-Za-z0-9._\-/*\[\]]+")


def _clean_allowed_paths(paths: list[str]) -> list[str]:
    if len(paths) > MAX_ALLOWED_PATHS:
        raise ValidationError({"allowed_paths": f"at most {MAX_ALLOWED_PATHS} paths"})
    cleaned = []
    for path in paths:
        normal = posixpath.normpath(path)
        if path.startswith("/") or normal.startswith("..") or "\x00" in path or "\\" in path:
            raise ValidationError(
                {"allowed_paths": f"{path!r} must be a relative path inside the workspace"}
            )
        # The paths go into an agent's instructions as code: nothing that could close the
        # quoting or start new text there.
        if not _PATH_CHARACTERS.fullmatch(path):
            raise ValidationError({"allowed_paths": f"{path!r}: a path may hold letters, digits and "
                                                    "._-/*[] only"})
        cleaned.append(normal)
    return cleaned


def _parsed_evidence(upload: Upload) -> dict:
    """Parsed before anything is stored: unreadable evidence never reaches the database."""
    try:
        return parse_evidence(upload.data, upload.name, max_bytes=settings.EVIDENCE_MAX_BYTES)
    except EvidenceError as exc:
        raise ValidationError({"evidence": str(exc)}) from exc


def _stored_evidence(*, uploaded_by, upload: Upload, summary: dict) -> Evidence:
    return Evidence.objects.create(
        uploaded_by=uploaded_by,
        filename=posixpath.basename(upload.name.replace("\\", "/"))[:255] or "evidence",
        sha256=hashlib.sha256(upload.data).hexdigest(),
        size_bytes=len(upload.data),
        format=summary["format"],
        summary=summary,
    )


def refuse_hidden_characters(field: str, text: str) -> None:
    """A one-line text shown across the app (a title, a name) holds no character that
    renders as nothing or reorders what follows (a U+202E in a title reversed the page
    text after its link in every breadcrumb), nor a line break or tab."""
    also = dict.fromkeys(re.findall("[\t\n]", text))
    hidden = hidden_characters(text) + [character_name(c) for c in also]
    if hidden:
        raise ValidationError({field: f"holds characters that render as nothing or reorder the text "
                                      f"around them: {', '.join(hidden)}"})


def _thesis_text_problems(title: str, idea: str) -> dict[str, list[str]]:
    """What is wrong with a thesis's title and idea, by field (empty when nothing is)."""
    problems: dict[str, list[str]] = {}
    if not title.strip():
        problems["title"] = ["a thesis needs a title"]
    try:
        refuse_hidden_characters("title", title)
    except ValidationError as error:
        problems.setdefault("title", []).extend(error.message_dict["title"])
    if not idea.strip():
        problems["idea"] = ["say what the idea is"]
    return problems


def thesis_submit(
    *,
    author,
    title: str,
    idea: str,
    op: str,
    hardware: str,
    model_context: str = "none",
    required_dsl: str,
    allowed_paths: list[str] | None = None,
    forbidden_changes: str = "",
    context_lengths: list[int] | None = None,
    batch_sizes: list[int] | None = None,
    evidence: Upload | None = None,
) -> Thesis:
    # Every problem at once: a form that named one per submit took as many submits.
    problems: dict[str, list[str]] = {}

    def checked(check: Callable[[], Any]) -> Any:
        try:
            return check()
        except ValidationError as error:
            for field, messages in error.message_dict.items():
                problems.setdefault(field, []).extend(messages)
            return None

    def refuse(field: str, message: str) -> None:
        problems.setdefault(field, []).append(message)

    title = title.strip()
    for field, messages in _thesis_text_problems(title, idea).items():
        problems.setdefault(field, []).extend(messages)
    if hardware not in HARDWARE:
        refuse("hardware", f"unknown hardware {hardware!r}")
    if required_dsl not in dict(KERNEL_DSLS):
        refuse("required_dsl", f"unknown kernel DSL {required_dsl!r}")
    if model_context not in dict(MODEL_CONTEXTS):
        refuse("model_context", f"unknown model context {model_context!r}")
    target = checked(lambda: _op_or_error(op))
    if target is not None and hardware in HARDWARE:
        device = HARDWARE[hardware].device
        context_lengths = context_lengths or target.default_context_lengths(device)
        batch_sizes = batch_sizes or target.default_batch_sizes(device)
        try:
            target.workloads(device, context_lengths, batch_sizes)
        except ops.WorkloadError as exc:
            refuse("context_lengths", str(exc))
    paths = checked(lambda: _clean_allowed_paths(allowed_paths or []))
    summary = checked(lambda: _parsed_evidence(evidence)) if evidence else None
    if problems:
        raise ValidationError(problems)

    with transaction.atomic():
        stored_evidence = (
            _stored_evidence(uploaded_by=author, upload=evidence, summary=summary) if evidence else None
        )
        thesis = Thesis.objects.create(
            author=author,
            title=title,
            idea=idea,
            op=target.name,
            hardware=hardware,
            model_context=model_context,
            evidence=stored_evidence,
            required_dsl=required_dsl,
            allowed_paths=paths,
            forbidden_changes=forbidden_changes.strip(),
            context_lengths=list(context_lengths),
            batch_sizes=list(batch_sizes),
        )
        webhook_event(type="thesis.created", payload=webhook_payloads.thesis_created(thesis))
    return thesis


def thesis_edit_check(*, thesis: Thesis, edited_by) -> None:
    """Raises unless `edited_by` may edit the thesis now: its author, before its first
    sweep (from then on it is what its candidates were produced and judged under)."""
    if edited_by.pk != thesis.author_id:
        raise PermissionDenied("only the thesis's author may edit it")
    if thesis.sweeps.exists():
        raise ValidationError("a sweep has started from this thesis: it is what its candidates were "
                              "judged under, so it stays as it is (file a new thesis instead)", code="started")


def thesis_edit(*, thesis: Thesis, edited_by, title: str, idea: str, forbidden_changes: str = "") -> Thesis:
    """Its author rewrites the title, idea and forbidden changes (thesis_edit_check)."""
    thesis_edit_check(thesis=thesis, edited_by=edited_by)
    title, idea = title.strip(), idea.strip()
    problems = _thesis_text_problems(title, idea)
    if problems:
        raise ValidationError(problems)
    thesis.title, thesis.idea, thesis.forbidden_changes = title, idea, forbidden_changes.strip()
    thesis.save(update_fields=["title", "idea", "forbidden_changes"])
    return thesis


def thesis_archive(*, thesis: Thesis, by, archived: bool = True) -> Thesis:
    """Off the dashboard and closed to new sweeps (or back again); by its author or staff.
    Nothing of its sweeps, candidates or decisions changes."""
    if by.pk != thesis.author_id and not by.is_staff:
        raise PermissionDenied("only the thesis's author or staff may archive it")
    unfinished = [Sweep.Status.QUEUED, Sweep.Status.RUNNING, Sweep.Status.PAUSED]
    if archived and thesis.sweeps.filter(status__in=unfinished).exists():
        raise ValidationError("a sweep of this thesis has not finished: cancel it or let it end first",
                              code="running")
    thesis.archived_at, thesis.archived_by = (timezone.now(), by) if archived else (None, None)
    thesis.save(update_fields=["archived_at", "archived_by"])
    return thesis


def sweep_start(
    *,
    thesis: Thesis,
    started_by,
    kernel: str,
    strategy: str,
    budget: int,
    hardware: str | None = None,
    time_budget_s: int | None = None,
    patience: int | None = None,
    agent_command: str = "",
) -> Sweep:
    """Queue the sweep's first candidates: every point for grid and random, a few for TPE,
    or, for an agent sweep, ask its declared `agent_command` for the first proposal.

    `budget` caps the candidates, `time_budget_s` the wall time from the start and
    `patience` the candidates in a row without a better geomean speedup than the best
    so far; reaching any of them ends the sweep (see `sweep_continue`).
    """
    if thesis.archived_at is not None:
        raise ValidationError("this thesis is archived: restore it to start a sweep", code="archived")
    target = _op_or_error(thesis.op)
    kernels = target.kernels()
    if kernel not in kernels:
        raise ValidationError({"kernel": f"op {target.name} has no kernel {kernel!r}"})
    if kernel_dsl(kernels[kernel]) != thesis.required_dsl:
        raise ValidationError({"kernel": (
            f"kernel {kernel!r} is written in {kernel_dsl(kernels[kernel])}; "
            f"the thesis requires {thesis.required_dsl}"
        )})
    if strategy not in (*proposers.STRATEGIES, Sweep.Strategy.AGENT):
        raise ValidationError({"strategy": f"unknown strategy {strategy!r}"})
    if not 1 <= budget <= MAX_SWEEP_BUDGET:
        raise ValidationError({"budget": f"budget must be 1 to {MAX_SWEEP_BUDGET} candidates"})
    if time_budget_s is not None and not 1 <= time_budget_s <= MAX_SWEEP_TIME_BUDGET_S:
        raise ValidationError({"time_budget_s": f"a time budget is 1 to {MAX_SWEEP_TIME_BUDGET_S} s"})
    if patience is not None and patience < 1:
        raise ValidationError({"patience": "patience is at least 1 candidate"})
    hardware = hardware or thesis.hardware
    if hardware not in HARDWARE:
        raise ValidationError({"hardware": f"unknown hardware {hardware!r}"})
    # The thesis's workloads were checked against its own hardware when it was filed; on
    # another queue they may not exist (an H200 thesis's 256K context is beyond the CPU's
    # limit), and a sweep started anyway could neither be evaluated nor shown.
    try:
        target.workloads(HARDWARE[hardware].device, thesis.context_lengths, thesis.batch_sizes)
    except ops.WorkloadError as exc:
        raise ValidationError({"hardware": (
            f"this thesis's workloads cannot run on {HARDWARE[hardware].label}: {exc}; "
            "choose its own hardware, or file a thesis with workloads this hardware runs"
        )}) from exc
    if strategy == Sweep.Strategy.AGENT:
        from research.agents import agent_sweep_start

        return agent_sweep_start(thesis=thesis, started_by=started_by, kernel=kernel, budget=budget,
                                 hardware=hardware, time_budget_s=time_budget_s, patience=patience,
                                 agent_command=agent_command)

    source = kernels[kernel].read_text()
    _, parameter_space = space.read_literals(source)
    if not parameter_space:
        raise ValidationError({"kernel": f"kernel {kernel!r} declares no SPACE to sweep"})
    seed = secrets.randbits(32)
    total = min(budget, proposers.space_size(parameter_space))
    points = proposers.propose(strategy, parameter_space, history=[], seed=seed,
                               count=min(total, proposers.batch_size(strategy, budget)))
    kept = workspace.kept_kernel(target.name, hardware)

    # The workspace lock comes first, then the transaction: the branches are published
    # as its last step, so a failure anywhere leaves neither rows nor branches.
    with workspace.lock(), transaction.atomic():
        sweep = Sweep.objects.create(
            thesis=thesis,
            started_by=started_by,
            kernel=kernel,
            strategy=strategy,
            budget=budget,
            time_budget_s=time_budget_s,
            patience=patience,
            seed=seed,
            hardware=hardware,
            queue=HARDWARE[hardware].queue,
            total=total,
            base_commit=kept.commit,
            baseline_source=kept.source,
            baseline_kernel=kept.name,
        )
        event_append(
            sweep_id=sweep.pk,
            type="sweep.created",
            payload={"kernel": kernel, "strategy": strategy, "total": sweep.total, "done": 0},
        )
        candidates_add(sweep=sweep, kernel_source=source, fork=None, points=points)
    return sweep


def sweep_of_one(*, thesis: Thesis, started_by, kernel: str, strategy: str, hardware: str, base_commit: str,
                 baseline_source: str, baseline_kernel: str, context: str, source: str, params: dict,
                 fork: str, **link: Candidate) -> Candidate:
    """A sweep of one candidate, `source` forked from `fork`, queued on the hardware's
    queue: a worker measures it again (a VERIFY sweep of an import, a RETIME of a stale
    win, a HEAD_TO_HEAD of two wins; `link` names the candidates it is about). Runs under
    the caller's workspace lock and transaction."""
    sweep = Sweep.objects.create(
        thesis=thesis, started_by=started_by, kernel=kernel, strategy=strategy, budget=1,
        seed=secrets.randbits(32), hardware=hardware, queue=HARDWARE[hardware].queue, total=1,
        base_commit=base_commit, baseline_source=baseline_source, baseline_kernel=baseline_kernel,
        context=context, **link,
    )
    event_append(sweep_id=sweep.pk, type="sweep.created", payload={
        "kernel": sweep.kernel, "strategy": sweep.strategy, "total": 1, "done": 0})
    candidates_add(sweep=sweep, kernel_source=source, fork=fork, points=[params], sources=[source],
                   proposed_by=strategy)
    return sweep.candidates.get()


def candidates_add(*, sweep: Sweep, kernel_source: str, fork: str | None, points: list[dict],
                    sources: list[str] | None = None, proposed_by: str | None = None,
                    results: list[dict] | None = None, provenance: dict | None = None) -> None:
    """Commit and store a candidate per point: the one way candidates join a sweep.

    They are queued for evaluation, or, when `results` come with them (a remote host's
    results file), recorded the way a worker records its evaluations. Runs under the
    workspace lock inside the caller's transaction, and publishes the branches as its
    last step, so a failure anywhere leaves neither rows nor branches.
    """
    first = (sweep.candidates.aggregate(last=Max("number"))["last"] or 0) + 1
    sources = sources or [space.materialize(kernel_source, point) for point in points]
    commits = _candidate_commits(sweep=sweep, kernel_source=kernel_source, fork=fork,
                                 points=points, sources=sources, first_number=first)
    candidates = Candidate.objects.bulk_create(
        Candidate(sweep=sweep, number=n, params=point, source=text, commit=commit,
                  branch=workspace.candidate_branch(sweep.pk, n),
                  proposed_by=proposed_by or sweep.strategy)
        for n, (point, text, commit) in enumerate(zip(points, sources, commits, strict=True), start=first)
    )
    if results is None:
        candidate_ids = [c.pk for c in candidates]
        transaction.on_commit(lambda: _enqueue_evaluations(candidate_ids, sweep.queue))
    else:
        for candidate, result in zip(candidates, results, strict=True):
            candidate_claim(candidate_id=candidate.pk)
            candidate_record_result(candidate_id=candidate.pk, result=result, provenance=provenance)
    # A reused id (SQLite after a rollback) may have left a branch: overwrite it.
    workspace.publish([workspace.RefUpdate(c.branch, c.commit, check=False) for c in candidates])


def sweep_continue(*, sweep_id: int) -> Sweep:
    """The next step of a queued or running sweep, after each result and on resume.

    Either a stop rule ends it (its time budget is spent, or `patience` candidates in a
    row did not beat the best), or its proposer tops up the candidates in flight (TPE
    keeps a few going until its budget is planned; grid and random planned everything
    at the start). The workspace lock and the sweep's row lock make concurrent calls
    take turns, so two results arriving together never propose the same point twice
    nor more candidates than the budget.
    """
    sweep = Sweep.objects.get(pk=sweep_id)
    if not _sweep_may_continue(sweep):
        return sweep
    with workspace.lock(), transaction.atomic():
        # Queued candidates before their sweep: the lock order of every other writer
        # (research.sweep_control), so cancelling them here cannot deadlock a claim.
        list(Candidate.objects.select_for_update().filter(sweep_id=sweep_id, status=Candidate.Status.QUEUED)
             .order_by("pk").values_list("pk", flat=True))
        sweep = Sweep.objects.select_for_update(of=("self",)).select_related(
            "thesis", "started_by").get(pk=sweep_id)
        if not _sweep_may_continue(sweep):
            return sweep
        if reason := _sweep_stop_reason(sweep):
            _sweep_stop(sweep, reason)
            return sweep
        planned = sweep.candidates.exclude(status=Candidate.Status.CANCELLED)
        in_flight = planned.filter(status__in=[Candidate.Status.QUEUED, Candidate.Status.RUNNING]).count()
        if sweep.strategy == Sweep.Strategy.AGENT:
            # One proposal at a time: the agent is asked again once the last one's result is in.
            from research import agents

            if agents.proposal_wanted(sweep):
                transaction.on_commit(lambda: agents.proposal_enqueue(sweep_id))
            return sweep
        wanted = min(proposers.batch_size(sweep.strategy, sweep.budget) - in_flight,
                     sweep.total - planned.count())
        if wanted <= 0 or sweep.strategy not in proposers.STRATEGIES:
            return sweep
        fork, kernel_source = _sweep_fork(sweep)
        _, parameter_space = space.read_literals(kernel_source)
        points = proposers.propose(sweep.strategy, parameter_space or {}, history=_sweep_trials(sweep),
                                   count=wanted, seed=sweep.seed)
        if points:
            candidates_add(sweep=sweep, kernel_source=kernel_source, fork=fork, points=points)
        elif not in_flight:
            _sweep_stop(sweep, "no untried point of the space is left")
    return sweep


def _sweep_may_continue(sweep: Sweep) -> bool:
    """Whether a result can still change anything: a stop rule to check or points to plan."""
    if sweep.status not in {Sweep.Status.QUEUED, Sweep.Status.RUNNING} or sweep.stop_reason:
        return False
    return bool(sweep.patience or sweep.time_budget_s) or (
        sweep.candidates.exclude(status=Candidate.Status.CANCELLED).count() < sweep.total)


def _sweep_stop_reason(sweep: Sweep) -> str:
    if sweep.time_budget_s is not None and (
        timezone.now() - sweep.created_at >= timedelta(seconds=sweep.time_budget_s)
    ):
        return f"time budget of {sweep.time_budget_s} s spent"
    if sweep.patience:
        recorded = sweep.candidates.filter(
            status__in=[Candidate.Status.DONE, Candidate.Status.FAILED, Candidate.Status.REFUSED]
        ).order_by("finished_at", "number").values_list("verdict", "geomean_speedup")
        best, since_best = -math.inf, 0
        for verdict, geomean in recorded:
            value = proposers.objective(verdict=verdict, geomean_speedup=geomean)
            best, since_best = (value, 0) if value > best else (best, since_best + 1)
        if since_best >= sweep.patience:
            return f"stopped early: {since_best} candidate{'' if since_best == 1 else 's'} without improvement"
    return ""


def _sweep_stop(sweep: Sweep, reason: str) -> None:
    """End the sweep before its budget: queued candidates are cancelled, and it finishes
    with the last result of those being evaluated (now, when none is)."""
    sweep.candidates.filter(status=Candidate.Status.QUEUED).update(
        status=Candidate.Status.CANCELLED, error=reason)
    running = sweep.candidates.filter(status=Candidate.Status.RUNNING).count()
    Sweep.objects.filter(pk=sweep.pk).update(total=F("done") + running, stop_reason=reason)
    sweep.refresh_from_db()
    _sweep_finish_if_done(sweep)


def _sweep_finish_if_done(sweep: Sweep) -> None:
    """Finish a sweep whose every planned candidate is recorded, announcing it once."""
    # A cancelled sweep stays cancelled when a late result completes its count.
    if sweep.done == sweep.total and Sweep.objects.filter(pk=sweep.pk).exclude(
        status__in=[Sweep.Status.FINISHED, Sweep.Status.CANCELLED]
    ).update(status=Sweep.Status.FINISHED, finished_at=timezone.now()):
        tally = _verdict_tally(sweep)
        event_append(
            sweep_id=sweep.pk,
            type="sweep.finished",
            payload={"done": sweep.done, "total": sweep.total, **tally, "stop_reason": sweep.stop_reason},
        )
        webhook_event(type="sweep.finished", payload=webhook_payloads.sweep_finished(sweep, **tally))


def _sweep_fork(sweep: Sweep) -> tuple[str | None, str]:
    """Where the sweep's candidates fork, and the kernel source there.

    Later candidates fork from the same commit as the first ones (the kept kernel, or
    the commit swapping the sweep's kernel in), so the sweep keeps one base however
    many batches it proposes. Without a first-revision candidate to read it from, a new
    fork is made from the kernel as shipped.
    """
    first = sweep.candidates.filter(revision=1).exclude(commit="").order_by("number").first()
    if first is not None:
        fork = workspace.commit_info(first.commit)["parents"][0]
        source = workspace.read_file(fork, workspace.kept_path(sweep.thesis.op, sweep.hardware))
        if source is not None:
            return fork, source
    return None, ops.get_op(sweep.thesis.op).kernels()[sweep.kernel].read_text()


def _sweep_trials(sweep: Sweep) -> list[proposers.Trial]:
    """The sweep's points so far, as its proposer sees them: the persisted study."""
    return [
        proposers.Trial(params=params, value=None if status in {Candidate.Status.QUEUED, Candidate.Status.RUNNING}
                        else proposers.objective(verdict=verdict, geomean_speedup=geomean))
        for params, status, verdict, geomean in sweep.candidates.exclude(status=Candidate.Status.CANCELLED)
        .order_by("number").values_list("params", "status", "verdict", "geomean_speedup")
    ]


def describe_params(params: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in params.items()) or "as shipped"


def _candidate_commits(*, sweep: Sweep, kernel_source: str, fork: str | None, points: list[dict],
                       sources: list[str], first_number: int) -> list[str]:
    """One commit per candidate, replacing the op's kept kernel, forked from `fork`.

    Without a fork (a sweep's first candidates), they fork from the sweep's base, or,
    when the sweep's kernel is not the kept one, from a first commit that swaps it in at
    its shipped PARAMS, so each candidate's own commit changes only the values of its point.
    """
    thesis = sweep.thesis
    producer = workspace.identity_of(sweep.started_by)
    kept_file = workspace.kept_path(thesis.op, sweep.hardware)
    about = f"Thesis #{thesis.pk}: {thesis.title}\nSweep {sweep.pk} ({sweep.strategy}) started by {producer.name}"
    commits: list[workspace.NewCommit] = []
    parent = fork or sweep.base_commit
    if fork is None and kernel_source != sweep.baseline_source:
        commits.append(workspace.NewCommit(
            parents=[parent], files={kept_file: kernel_source}, author=producer,
            message=f"Sweep {sweep.pk}: {thesis.op} kernel {sweep.kernel} at its shipped PARAMS\n\n{about}"))
        parent = ":1"
    for number, (point, text) in enumerate(zip(points, sources), start=first_number):
        commits.append(workspace.NewCommit(
            parents=[parent], files={kept_file: text}, author=producer,
            message=f"Candidate {sweep.pk}-{number}: {sweep.kernel} {describe_params(point)}\n\n{about}"))
    built = workspace.build(commits)
    return built[len(built) - len(points):]


def _enqueue_evaluations(candidate_ids: list[int], queue: str) -> None:
    """Send each still-queued candidate's evaluation, under a fresh dispatch token.

    Only the message that carries a candidate's current token may claim it, so when a
    message is sent again (on resume, or because it was lost: research.recovery) any
    older copy that still turns up is dropped instead of evaluating the candidate twice.
    """
    for candidate_id in candidate_ids:
        dispatch = secrets.token_hex(8)
        if Candidate.objects.filter(pk=candidate_id, status=Candidate.Status.QUEUED).update(
            dispatch=dispatch, dispatched_at=timezone.now()
        ):
            _send_evaluation(candidate_id, dispatch, queue)


def _send_evaluation(candidate_id: int, dispatch: str, queue: str) -> None:
    from research.tasks import evaluate_candidate

    evaluate_candidate.apply_async(args=[candidate_id, dispatch], queue=queue)


def candidate_claim(*, candidate_id: int, dispatch: str | None = None) -> Candidate | None:
    """Claim a candidate for evaluation by a conditional update.

    A queued candidate, or a running one whose worker died before recording (the
    broker delivers the same message again), can be claimed; one already recorded
    cannot. A worker passes its message's `dispatch` token, and a message whose token
    was replaced claims nothing; None is for callers that own the candidate outright
    (an import recording a remote host's results). No new candidate of a paused or
    cancelled sweep is started: it stays queued and is queued again on resume
    (research.sweep_control); one already started still finishes.
    """
    with transaction.atomic():
        # A plain read, no lock: a pause committing just after it lets this one candidate
        # run, as if it had been claimed just before the pause.
        if Candidate.objects.filter(
            pk=candidate_id, status=Candidate.Status.QUEUED,
            sweep__status__in=[Sweep.Status.PAUSED, Sweep.Status.CANCELLED],
        ).exists():
            return None
        claimable = Candidate.objects.filter(
            pk=candidate_id,
            status__in=[Candidate.Status.QUEUED, Candidate.Status.RUNNING],
            attempts__lt=MAX_ATTEMPTS,
        )
        if dispatch is not None:
            claimable = claimable.filter(dispatch=dispatch)
        claimed = claimable.update(status=Candidate.Status.RUNNING, started_at=timezone.now(), attempts=F("attempts") + 1)
        if not claimed:
            candidate_fail_if_out_of_attempts(candidate_id, dispatch)
            return None
        candidate = Candidate.objects.select_related("sweep__thesis").get(pk=candidate_id)
        sweep = candidate.sweep
        if Sweep.objects.filter(pk=sweep.pk, status=Sweep.Status.QUEUED).update(
            status=Sweep.Status.RUNNING
        ):
            event_append(sweep_id=sweep.pk, type="sweep.started", payload={"total": sweep.total})
        event_append(
            sweep_id=sweep.pk,
            type="candidate.started",
            payload={"number": candidate.number, "params": candidate.params, "attempt": candidate.attempts},
        )
    return candidate


def candidate_fail_if_out_of_attempts(candidate_id: int, dispatch: str | None) -> bool:
    """A candidate whose evaluation killed its worker every time ends failed, not looping.
    Only its current message says so: a replaced one may arrive while the last attempt runs."""
    running_out = Candidate.objects.filter(
        pk=candidate_id, status=Candidate.Status.RUNNING, attempts__gte=MAX_ATTEMPTS)
    if dispatch is not None:
        running_out = running_out.filter(dispatch=dispatch)
    if not running_out.exists():
        return False
    queue = Candidate.objects.filter(pk=candidate_id).values_list("sweep__queue", flat=True).first()
    return candidate_record_result(
        candidate_id=candidate_id,
        result=harness_failure(f"the evaluation ended its worker {MAX_ATTEMPTS} times"),
        # The worker was lost, not the kernel judged: a verification counts it for no side.
        provenance={**worker_provenance(queue=queue or ""), "lost_worker": True},
    )


def harness_failure(reason: str) -> dict:
    """A result for an evaluation the harness could not complete: rejected, with why."""
    return {
        "verdict": "rejected",
        "correct": False,
        "harness_failed": True,
        "error": reason,
        "guards": [{"name": "harness", "status": "fail", "detail": reason}],
        "workloads": [],
        "e2e": None,
        "dispatch": None,
    }


def _geomean(values: list[float]) -> float | None:
    positive = [v for v in values if v and v > 0]
    if not positive:
        return None
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def candidate_record_result(*, candidate_id: int, result: dict, provenance: dict | None = None) -> bool:
    """Store one evaluation, once. Returns False when it was already recorded.

    `provenance` says who measured it (research.provenance), as the caller knows it."""
    workloads = result.get("workloads") or []
    speedups = [w["speedup"] for w in workloads if w.get("speedup")]
    with transaction.atomic():
        recorded = Candidate.objects.filter(pk=candidate_id, status=Candidate.Status.RUNNING).update(
            # FAILED: the harness itself did not complete (it crashed or ran out of time).
            status=Candidate.Status.FAILED if result.get("harness_failed") else Candidate.Status.DONE,
            verdict=result.get("verdict") or "rejected",
            correct=result.get("correct"),
            geomean_speedup=_geomean(speedups),
            best_speedup=max(speedups) if speedups else None,
            error=result.get("error") or "",
            result=result,
            provenance=provenance or {},
            finished_at=timezone.now(),
        )
        if not recorded:
            return False
        candidate = Candidate.objects.get(pk=candidate_id)
        Measurement.objects.bulk_create(
            Measurement(
                candidate=candidate,
                position=position,
                workload=w["name"],
                baseline_ms=w.get("baseline_ms"),
                candidate_ms=w.get("candidate_ms"),
                speedup=w.get("speedup"),
                speedup_lo=(w.get("speedup_ci") or [None, None])[0],
                speedup_hi=(w.get("speedup_ci") or [None, None])[1],
                p_value=w.get("p_value"),
                significant=bool(w.get("significant")),
            )
            for position, w in enumerate(workloads)
        )
        GuardFinding.objects.bulk_create(
            GuardFinding(candidate=candidate, name=g["name"], status=g["status"], detail=g.get("detail", ""))
            for g in result.get("guards") or []
        )
        Sweep.objects.filter(pk=candidate.sweep_id).update(done=F("done") + 1)
        sweep = Sweep.objects.get(pk=candidate.sweep_id)
        tally = _verdict_tally(sweep)
        event_append(
            sweep_id=sweep.pk,
            type="candidate.result",
            payload={**_result_payload(candidate, workloads), "done": sweep.done, "total": sweep.total, **tally},
        )
        if candidate.verdict == "win":
            transaction.on_commit(publish_queue_changed)  # it now waits for a reviewer
        _sweep_finish_if_done(sweep)
        if sweep.done < sweep.total:
            transaction.on_commit(lambda: sweep_continue(sweep_id=sweep.pk))
    return True


def _verdict_tally(sweep: Sweep) -> dict[str, int]:
    verdicts = list(sweep.candidates.exclude(verdict="").values_list("verdict", flat=True))
    return {"wins": verdicts.count("win"), "rejected": verdicts.count("rejected")}


def _result_payload(candidate: Candidate, workloads: list[dict]) -> dict:
    return {
        "id": candidate.pk,
        "number": candidate.number,
        "params": candidate.params,
        "verdict": candidate.verdict,
        "correct": candidate.correct,
        "geomean_speedup": candidate.geomean_speedup,
        "best_speedup": candidate.best_speedup,
        "error": candidate.error,
        "workloads": [
            {
                "name": w["name"],
                "speedup": w.get("speedup"),
                "significant": bool(w.get("significant")),
                "baseline_ms": w.get("baseline_ms"),
                "candidate_ms": w.get("candidate_ms"),
            }
            for w in workloads
        ],
    }


def candidate_revise(*, candidate: Candidate, source: str, revised_by, message: str = "") -> Candidate:
    """A new revision of a candidate (an agent amending it): a new commit on its branch.

    The revision is evaluated afresh, and decisions on earlier revisions stop counting:
    a reviewer's keep is bound to the commit the reviewer saw. Only the sweep's starter
    or the thesis author may revise, so the four-eyes rule (neither may review) still
    covers whoever wrote the revision.
    """
    try:
        python_source.parse(source)
    except SyntaxError as exc:
        raise ValidationError({"source": f"the revision is not Python: {exc.msg} (line {exc.lineno})"}) from exc
    with workspace.lock(), transaction.atomic():
        candidate = Candidate.objects.select_for_update().select_related(
            "sweep__thesis", "sweep__started_by").get(pk=candidate.pk)
        sweep = candidate.sweep
        if revised_by.pk not in {sweep.started_by_id, sweep.thesis.author_id}:
            raise PermissionDenied("only the sweep's starter or the thesis author may revise its candidates")
        if sweep.strategy in (Sweep.Strategy.IMPORTED, Sweep.Strategy.VERIFY, Sweep.Strategy.HEAD_TO_HEAD):
            # An import is what its file measured, a verification or a head-to-head what a
            # worker measured of other candidates: a new revision would be another roll of the dice.
            raise ValidationError({"source": f"a candidate of an {sweep.strategy} sweep is never revised"})
        if not candidate.commit:
            raise ValidationError({"source": "this candidate has no commit in the kernel workspace"})
        if source == candidate.source:
            raise ValidationError({"source": "the revision changes nothing"})
        if candidate.status in {Candidate.Status.QUEUED, Candidate.Status.RUNNING}:
            raise ValidationError({"source": "it is being evaluated; revise it once its result is in"})
        if sweep.status == Sweep.Status.CANCELLED:
            raise ValidationError({"source": "its sweep was cancelled; start a new sweep instead"})
        if candidate.reviews.filter(revision=candidate.revision, decision="keep").exists():
            raise ValidationError({"source": "it is kept on the main line; start a new sweep instead"})
        revision = candidate.revision + 1
        subject = message.strip().splitlines()[0] if message.strip() else "amended"
        (commit,) = workspace.build([workspace.NewCommit(
            parents=[candidate.commit],
            files={workspace.kept_path(sweep.thesis.op, sweep.hardware): source},
            author=workspace.identity_of(revised_by),
            message=f"Candidate {candidate.label} revision {revision}: {subject}\n\n{message.strip()}")])
        candidate.measurements.all().delete()
        candidate.guards.all().delete()
        Candidate.objects.filter(pk=candidate.pk).update(
            source=source, commit=commit, revision=revision,
            branch=workspace.candidate_branch(sweep.pk, candidate.number),
            status=Candidate.Status.QUEUED, verdict="", correct=None, geomean_speedup=None,
            best_speedup=None, error="", result=None, attempts=0, started_at=None, finished_at=None,
        )
        # Its result no longer counts: the sweep has one more candidate to evaluate.
        Sweep.objects.filter(pk=sweep.pk).update(
            done=F("done") - 1, status=Sweep.Status.RUNNING, finished_at=None)
        sweep.refresh_from_db()
        event_append(sweep_id=sweep.pk, type="candidate.revised", payload={
            "number": candidate.number, "revision": revision, "commit": commit,
            "done": sweep.done, "total": sweep.total,
        })
        transaction.on_commit(lambda: _enqueue_evaluations([candidate.pk], sweep.queue))
        transaction.on_commit(publish_queue_changed)
        workspace.publish([workspace.RefUpdate(workspace.candidate_branch(sweep.pk, candidate.number),
                                               commit, check=False)])
    candidate.refresh_from_db()
    return candidate
