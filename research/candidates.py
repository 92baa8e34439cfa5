"""A candidate's life: committed and queued, claimed by a worker, recorded, revised.

A recorded result and a revision are announced (research.signals): the sweep moves on
(research.sweeps) and the review queue's count changes (reviews.live) without this
module knowing either.
"""

from __future__ import annotations

import math

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import F, Max
from django.utils import timezone

from research import queueing, signals
import workspace
from research.events import event_append
from research.models import Candidate, GuardFinding, Measurement, Sweep
from research.provenance import worker_provenance
from runners import python_source, space

MAX_ATTEMPTS = 3


def describe_params(params: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in params.items()) or "as shipped"


def candidates_add(*, sweep: Sweep, kernel_source: str, fork: str | None, points: list[dict],
                    sources: list[str] | None = None, proposed_by: str | None = None,
                    results: list[dict] | None = None, provenance: dict | None = None,
                    lib_changes: dict[str, str | None] | None = None) -> None:
    """Commit and store a candidate per point: the one way candidates join a sweep.

    They are queued for evaluation, or, when `results` come with them (a remote host's
    results file), recorded the way a worker records its evaluations. Runs under the
    workspace lock inside the caller's transaction, and publishes the branches as its
    last step, so a failure anywhere leaves neither rows nor branches.

    `lib_changes`: modules of the shared kernel code (workspace path -> text, None to
    delete) that each candidate's commit changes beside its kernel, as an agent's may.
    """
    first = (sweep.candidates.aggregate(last=Max("number"))["last"] or 0) + 1
    sources = sources or [space.materialize(kernel_source, point) for point in points]
    commits = _candidate_commits(sweep=sweep, kernel_source=kernel_source, fork=fork,
                                 points=points, sources=sources, first_number=first,
                                 lib_changes=lib_changes or {})
    candidates = Candidate.objects.bulk_create(
        Candidate(sweep=sweep, number=n, params=point, source=text, commit=commit,
                  branch=workspace.candidate_branch(sweep.pk, n),
                  proposed_by=proposed_by or sweep.strategy)
        for n, (point, text, commit) in enumerate(zip(points, sources, commits, strict=True), start=first)
    )
    if results is None:
        candidate_ids = [c.pk for c in candidates]
        transaction.on_commit(lambda: queueing.evaluations_enqueue(candidate_ids, sweep.queue))
    else:
        for candidate, result in zip(candidates, results, strict=True):
            candidate_claim(candidate_id=candidate.pk)
            candidate_record_result(candidate_id=candidate.pk, result=result, provenance=provenance)
    # A reused id (SQLite after a rollback) may have left a branch: overwrite it.
    workspace.publish([workspace.RefUpdate(c.branch, c.commit, check=False) for c in candidates])


def _candidate_commits(*, sweep: Sweep, kernel_source: str, fork: str | None, points: list[dict],
                       sources: list[str], first_number: int, lib_changes: dict[str, str | None]) -> list[str]:
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
            parents=[parent], files={kept_file: text, **lib_changes}, author=producer,
            message=f"Candidate {sweep.pk}-{number}: {sweep.kernel} {describe_params(point)}\n\n{about}"))
    built = workspace.build(commits)
    return built[len(built) - len(points):]


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
        tally = verdict_tally(sweep)
        event_append(
            sweep_id=sweep.pk,
            type="candidate.result",
            payload={**_result_payload(candidate, workloads), "done": sweep.done, "total": sweep.total, **tally},
        )
        # The sweep finishes or goes on (research.sweeps); a win now waits for a reviewer.
        signals.candidate_recorded.send(sender=Candidate, candidate=candidate, sweep=sweep)
    return True


def verdict_tally(sweep: Sweep) -> dict[str, int]:
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
        transaction.on_commit(lambda: queueing.evaluations_enqueue([candidate.pk], sweep.queue))
        signals.candidate_revised.send(sender=Candidate, candidate=candidate)
        workspace.publish([workspace.RefUpdate(workspace.candidate_branch(sweep.pk, candidate.number),
                                               commit, check=False)])
    candidate.refresh_from_db()
    return candidate
