"""Verifying an imported result: the same candidate measured again by a worker of the lab.

An imported results file may be forged from its first line to its last, and the checks
an import runs again (research.importing) read only the source. So an imported win is
kept only once a trusted worker of its hardware class evaluated the very same commit,
against the very same kept kernel, and also found a win (reviews.services refuses the
keep before that). The run is a VERIFY sweep of one candidate, queued like any other on
the hardware's queue; it is shown on the imported candidate's page, never in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction

from research import sweeps
import workspace
from research.models import Candidate, Sweep
from research.provenance import is_imported
from reviews.models import DECIDE_PERMISSION

PENDING = (Candidate.Status.QUEUED, Candidate.Status.RUNNING)


@dataclass(frozen=True)
class Verification:
    """Where an imported result stands: `state` is "none", "pending", "agrees" or "disagrees"."""

    state: str
    run: Candidate | None
    detail: str

    @property
    def agrees(self) -> bool:
        return self.state == "agrees"


# A run is asked again only when its worker was lost, never after a verdict: noise must
# not be tried until it wins.
MAX_RUNS = 3


def runs(candidate: Candidate) -> list[Candidate]:
    """The candidates of every VERIFY sweep of `candidate`, newest first."""
    return list(Candidate.objects.filter(sweep__verifies=candidate, sweep__strategy=Sweep.Strategy.VERIFY)
                .select_related("sweep").order_by("-sweep__created_at", "-sweep_id"))


def _measured_the_same(run: Candidate, candidate: Candidate) -> bool:
    return (run.source == candidate.source and run.sweep.baseline_source == candidate.sweep.baseline_source
            and run.sweep.hardware == candidate.sweep.hardware)


def _lost_worker(run: Candidate) -> bool:
    """Its worker died under it every attempt (research.candidates records so): infrastructure,
    not a judgement of the kernel."""
    return bool(run.provenance.get("lost_worker"))


def verification(candidate: Candidate) -> Verification:
    """Agrees only when a worker's run found a win and none found anything else, on the
    same source, kept kernel and hardware class as the import: one run that did not
    refutes it for good, and so does one the harness could not finish (a time limit, a
    crash); only a run whose worker was lost counts for neither side."""
    found = runs(candidate)
    if not found:
        return Verification("none", None, "no worker of the lab has measured it")
    for run in found:
        if run.status not in PENDING and not _measured_the_same(run, candidate):
            return Verification("disagrees", run, f"verification {run.label} measured another source, "
                                                  "kept kernel or hardware than this candidate's")
        if run.status == Candidate.Status.DONE and (run.verdict != "win" or candidate.verdict != "win"):
            return Verification("disagrees", run, f"verification {run.label} found {run.verdict or 'nothing'}, "
                                                  f"not a {candidate.verdict}: {run.error or 'see its page'}")
        if run.status == Candidate.Status.FAILED and not _lost_worker(run):
            # A kernel that hangs or crashes the harness only on the lab's worker is no win.
            return Verification("disagrees", run, f"verification {run.label} did not finish: "
                                                  f"{run.error or 'the harness failed'}")
    pending = [run for run in found if run.status in PENDING]
    if pending:
        return Verification("pending", pending[0], f"verification {pending[0].label} is {pending[0].status}")
    agreeing = [run for run in found if run.status == Candidate.Status.DONE]
    if not agreeing:
        return Verification("none", found[0], f"verification {found[0].label} "
                                              f"{'lost its worker' if _lost_worker(found[0]) else 'was cancelled'}: "
                                              "it may be asked again")
    run = agreeing[0]
    return Verification("agrees", run, (
        f"verification {run.label} on {run.provenance.get('host') or 'a worker'} found a win too "
        f"(geomean ×{run.geomean_speedup or 0:.2f}, imported ×{candidate.geomean_speedup or 0:.2f})"))


def lab_measurement(candidate: Candidate, check: Verification | None) -> Candidate:
    """Whose figures the lab stands behind for `candidate` (its `check`, None when it is not
    imported): a verified import's worker run, else the candidate itself."""
    return check.run if check is not None and check.agrees else candidate


def proposed_dispatch(candidate: Candidate, check: Verification | None) -> dict:
    """The dispatch range the lab's figures propose for `candidate` ({} for none): a
    verified import's range is its worker run's, never the file's."""
    return (lab_measurement(candidate, check).result or {}).get("dispatch") or {}


def verification_start(*, candidate: Candidate, requested_by) -> Candidate:
    """Queue a worker's evaluation of an imported candidate's commit; returns its candidate.

    Refused for a candidate that is not imported, is not an evaluated win waiting for a
    decision, or whose verification is queued, running or came to a verdict.
    """
    if not requested_by.has_perm(DECIDE_PERMISSION):
        raise PermissionDenied("verifying a result is a reviewer's step: you may not keep or revert candidates")
    imported = candidate.sweep
    if requested_by.pk in (imported.started_by_id, imported.thesis.author_id):
        raise PermissionDenied("you imported this result or filed its thesis: a colleague asks for its check")
    if not is_imported(candidate):
        raise ValidationError("only an imported result is verified: this one was measured by a worker of the lab")
    if candidate.verdict != "win" or candidate.status != Candidate.Status.DONE or not candidate.commit:
        raise ValidationError("only an imported win with a commit is verified")
    with workspace.lock(), transaction.atomic():
        locked = Candidate.objects.select_for_update().get(pk=candidate.pk)  # one request at a time
        if locked.reviews.filter(revision=locked.revision).exists():
            raise ValidationError("this revision is already decided: nothing waits on its check")
        state = verification(candidate)
        if state.state in ("pending", "agrees", "disagrees"):
            raise ValidationError(f"not measured again: {state.detail}")
        if len(runs(candidate)) >= MAX_RUNS:
            raise ValidationError(f"asked {MAX_RUNS} times already; none came to a verdict")
        # Forked from the imported commit with the same source: the worker evaluates exactly it.
        return sweeps.sweep_of_one(
            thesis=imported.thesis, started_by=requested_by, kernel=imported.kernel,
            strategy=Sweep.Strategy.VERIFY, hardware=imported.hardware, base_commit=imported.base_commit,
            baseline_source=imported.baseline_source, baseline_kernel=imported.baseline_kernel,
            context=f"Verification of imported candidate {candidate.label}", source=candidate.source,
            params=candidate.params, fork=candidate.commit, verifies=candidate)
