"""A sweep's state machine: started, topped up after each result, stopped, finished.

A sweep plans its candidates (research.proposers), adds them (research.candidates)
and, after each recorded result (research.signals.candidate_recorded), finishes or
asks for more. Pause, resume and cancel are research.sweep_control; an agent sweep's
proposals are research.agents.
"""

from __future__ import annotations

import math
import secrets
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from research import proposers, queueing
import workspace
from research.candidates import candidates_add, verdict_tally
from research.events import event_append
from research.hardware import HARDWARE
from research.models import Candidate, Sweep, Thesis
from research.theses import op_or_error
from runners import ops, space
from runners.harness.dsl import kernel_dsl
from webhooks import payloads as webhook_payloads
from webhooks.services import webhook_event

MAX_SWEEP_BUDGET = 500
MAX_SWEEP_TIME_BUDGET_S = 30 * 24 * 3600


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
    target = op_or_error(thesis.op)
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
        # research.agents builds on this module (it stops, forks and continues sweeps): it
        # is imported when an agent sweep needs it, never while this one loads.
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


def sweep_after_result(sender, *, sweep: Sweep, **signal) -> None:
    """After each recorded result (research.signals.candidate_recorded, connected in
    research.apps): the sweep finishes with its last candidate, or goes on once the
    result has committed."""
    sweep_finish_if_done(sweep)
    if sweep.done < sweep.total:
        transaction.on_commit(lambda: sweep_continue(sweep_id=sweep.pk))


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
            sweep_stop(sweep, reason)
            return sweep
        planned = sweep.candidates.exclude(status=Candidate.Status.CANCELLED)
        in_flight = planned.filter(status__in=[Candidate.Status.QUEUED, Candidate.Status.RUNNING]).count()
        if sweep.strategy == Sweep.Strategy.AGENT:
            # One proposal at a time: the agent is asked again once the last one's result is in.
            from research import agents  # at call time, as in sweep_start

            if agents.proposal_wanted(sweep):
                transaction.on_commit(lambda: queueing.proposal_enqueue(sweep_id))
            return sweep
        wanted = min(proposers.batch_size(sweep.strategy, sweep.budget) - in_flight,
                     sweep.total - planned.count())
        if wanted <= 0 or sweep.strategy not in proposers.STRATEGIES:
            return sweep
        fork, kernel_source = sweep_fork(sweep)
        _, parameter_space = space.read_literals(kernel_source)
        points = proposers.propose(sweep.strategy, parameter_space or {}, history=_sweep_trials(sweep),
                                   count=wanted, seed=sweep.seed)
        if points:
            candidates_add(sweep=sweep, kernel_source=kernel_source, fork=fork, points=points)
        elif not in_flight:
            sweep_stop(sweep, "no untried point of the space is left")
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


def sweep_stop(sweep: Sweep, reason: str) -> None:
    """End the sweep before its budget: queued candidates are cancelled, and it finishes
    with the last result of those being evaluated (now, when none is)."""
    sweep.candidates.filter(status=Candidate.Status.QUEUED).update(
        status=Candidate.Status.CANCELLED, error=reason)
    running = sweep.candidates.filter(status=Candidate.Status.RUNNING).count()
    Sweep.objects.filter(pk=sweep.pk).update(total=F("done") + running, stop_reason=reason)
    sweep.refresh_from_db()
    sweep_finish_if_done(sweep)


def sweep_finish_if_done(sweep: Sweep) -> None:
    """Finish a sweep whose every planned candidate is recorded, announcing it once."""
    # A cancelled sweep stays cancelled when a late result completes its count.
    if sweep.done == sweep.total and Sweep.objects.filter(pk=sweep.pk).exclude(
        status__in=[Sweep.Status.FINISHED, Sweep.Status.CANCELLED]
    ).update(status=Sweep.Status.FINISHED, finished_at=timezone.now()):
        tally = verdict_tally(sweep)
        event_append(
            sweep_id=sweep.pk,
            type="sweep.finished",
            payload={"done": sweep.done, "total": sweep.total, **tally, "stop_reason": sweep.stop_reason},
        )
        webhook_event(type="sweep.finished", payload=webhook_payloads.sweep_finished(sweep, **tally))


def sweep_fork(sweep: Sweep) -> tuple[str | None, str]:
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
