"""Writes: a person keeps a candidate (merging it into the workspace's main line),
reverts it (archiving its branch), or undoes a keep (a commit on main that brings back
the kernel kept before it).

Both check the same things before anything is written: the permission to decide, four
eyes (the reviewer neither filed the thesis nor produced the candidate; the database
refuses such a row too), that the candidate is a win still waiting, and that the
decision is about the commit the reviewer saw. The workspace lock is taken before the
transaction, and the refs move as the transaction's last step, so a refused or failed
decision leaves neither a row nor a merge.
"""

from __future__ import annotations

from django.apps import apps
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from research import workers
import workspace
from research.hardware import HARDWARE
from research.models import Candidate, Sweep
from research.provenance import is_imported
from research.candidates import describe_params
from reviews import compounding
from reviews.live import publish_queue_changed
from reviews.models import DECIDE_PERMISSION, Review, UnverifiedKeepRequest
from reviews.selectors import candidate_hidden_characters
from reviews.verification import Verification, lab_measurement, verification

MAX_COMMENT = 10_000


def _locked_candidate(*, candidate: Candidate, reviewer) -> Candidate:
    """The candidate, locked, once the reviewer may decide on it (permission, four eyes)."""
    if not reviewer.has_perm(DECIDE_PERMISSION):
        raise PermissionDenied("you may not keep or revert candidates: ask for the reviewer permission")
    candidate = (Candidate.objects.select_for_update()
                 .select_related("sweep__thesis__author", "sweep__started_by").get(pk=candidate.pk))
    sweep = candidate.sweep
    if reviewer.pk == sweep.thesis.author_id:
        raise PermissionDenied("you filed this candidate's thesis: someone else must review it")
    if reviewer.pk == sweep.started_by_id:
        raise PermissionDenied("you produced this candidate (you started its sweep): someone else must review it")
    return candidate


def _saw_current_revision(candidate: Candidate, commit: str) -> None:
    if commit != candidate.commit:
        raise ValidationError(
            f"the candidate has a new revision (r{candidate.revision}, commit {candidate.commit[:12]}) "
            f"since you opened it at {commit[:12] or 'no commit'}: read the new one first", code="stale")


def _locked_waiting_candidate(*, candidate: Candidate, reviewer, commit: str) -> Candidate:
    candidate = _locked_candidate(candidate=candidate, reviewer=reviewer)
    sweep = candidate.sweep
    if candidate.verdict != "win" or candidate.status != Candidate.Status.DONE:
        raise ValidationError("only an evaluated win waits for a decision", code="not-waiting")
    if sweep.strategy == Sweep.Strategy.VERIFY:
        # Its source is the imported candidate's, its sweep another person's: deciding on it
        # would keep the import past its own gate, produced by whoever asked for the check.
        raise ValidationError(f"this run verifies candidate {sweep.verifies.label}: decide on that one",
                              code="not-waiting")
    if sweep.strategy == Sweep.Strategy.HEAD_TO_HEAD:
        # Timed against another waiting win, not the kept kernel: its speedup is over a kernel
        # main never ran, so a keep would serve a figure nobody measured (reviews.comparison).
        raise ValidationError(
            f"a head-to-head is not keepable: it says which of {sweep.challenged.label} and "
            f"{sweep.challenger.label} is faster where; decide on those two", code="not-waiting")
    _saw_current_revision(candidate, commit)
    if candidate.reviews.filter(revision=candidate.revision).exists():
        raise ValidationError("this revision is already decided", code="decided")
    return candidate


def _clean_comment(comment: str) -> str:
    comment = comment.strip()
    if len(comment) > MAX_COMMENT:
        raise ValidationError({"comment": f"at most {MAX_COMMENT:,} characters"})
    return comment


def _dispatch(candidate: Candidate, low: int | None, high: int | None) -> tuple[str, int | None, int | None]:
    for name, value in (("dispatch_min", low), ("dispatch_max", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValidationError({name: "a size is a positive whole number"})
    if low is not None and high is not None and low > high:
        raise ValidationError({"dispatch_max": "the range ends before it starts"})
    from reviews.selectors import workload_layout

    proposed = (candidate.result or {}).get("dispatch") or {}
    axis = proposed.get("axis") or workload_layout(candidate)[0] or ""
    return axis, low, high


def _details(review: Review, candidate: Candidate, measured: Candidate) -> dict:
    """What a decision adds to the webhook's candidate data (webhooks.payloads); the
    figures are `measured`'s (a verified import's worker run, else the candidate)."""
    sweep, thesis = candidate.sweep, candidate.sweep.thesis
    result = measured.result or {}
    details = {
        "thesis": {"id": thesis.pk, "title": thesis.title},
        "author": thesis.author.get_username(),
        "producer": sweep.started_by.get_username(),
        "hardware": sweep.hardware,
        "kernel": sweep.kernel,
        "commit": candidate.commit,
        "revision": candidate.revision,
        "workload_speedups": [{"name": w.get("name"), "speedup": w.get("speedup"),
                               "significant": bool(w.get("significant"))}
                              for w in result.get("workloads") or []],
        "e2e": result.get("e2e"),
    }
    if review.is_undo:
        keep = review.undoes
        details["revert_commit"] = review.revert_commit
        details["undone_keep"] = {
            "merge_commit": keep.merge_commit, "reviewer": keep.reviewer.get_username(),
            "kept_at": keep.created_at.isoformat(timespec="seconds"),
            "dispatch_range": {"axis": keep.dispatch_axis or None, "min": keep.dispatch_min,
                               "max": keep.dispatch_max},
        }
    elif review.is_keep:
        # False: an import two reviewers kept without a worker's measurement.
        details["verified"] = review.unverified_request_id is None
        details["merge_commit"] = review.merge_commit
        details["dispatch_range"] = {"axis": review.dispatch_axis or None, "min": review.dispatch_min,
                                     "max": review.dispatch_max}
    else:
        details["archived_branch"] = review.archived_branch or None
    return details


def _notify(*, type: str, review: Review, candidate: Candidate, measured: Candidate | None = None) -> None:
    """The webhook outbox rows, written in the decision's own transaction; the figures
    are `measured`'s (default: the candidate's)."""
    if not apps.is_installed("webhooks"):
        return
    measured = measured or candidate
    from webhooks.payloads import candidate_decided
    from webhooks.services import webhook_event

    webhook_event(type=type, payload=candidate_decided(
        candidate, reviewer=review.reviewer, comment=review.comment,
        url=candidate.get_absolute_url(), measured=measured, **_details(review, candidate, measured)))


def _merge_message(candidate: Candidate, review: Review, reviewer_identity: workspace.Identity,
                   measured: Candidate) -> str:
    sweep, thesis = candidate.sweep, candidate.sweep.thesis
    params = describe_params(dict(sorted(candidate.params.items())))  # jsonb reorders keys
    speedup = f"{measured.geomean_speedup:.3f}x" if measured.geomean_speedup else "n/a"
    lines = [
        f"Keep {thesis.op} candidate {candidate.label}: {sweep.kernel} {params}",
        "",
        f"Thesis #{thesis.pk}: {thesis.title}",
        f"Measured on {sweep.hardware}: geomean {speedup} over the kept kernel",
        f"Dispatch: {review.dispatch_text}",
        f"Candidate commit {candidate.commit} (revision {candidate.revision})",
    ]
    if review.comment:
        lines += ["", review.comment]
    lines += ["", f"Reviewed-by: {reviewer_identity.name} <{reviewer_identity.email}>"]
    return "\n".join(lines)


def _unverified_request(candidate: Candidate, check: Verification | None, reviewer,
                        confirm_unverified: bool) -> UnverifiedKeepRequest | None:
    """None for a win that needs no verification (`check` None) or has it; the request a
    second reviewer confirms for an imported one that has none; refused otherwise."""
    if check is None or check.agrees:
        return None
    request = candidate.unverified_requests.filter(revision=candidate.revision).first()
    if not confirm_unverified or request is None:
        raise ValidationError(
            "an imported win is kept only once a worker of the lab measured it again and also "
            f"found a win: {check.detail}" + ("" if request else
                                              " (or, where no worker of its hardware exists, once two "
                                              "reviewers agree to keep it unverified)"), code="unverified")
    _may_keep_unverified(candidate, check)
    if request.requested_by_id == reviewer.pk:
        raise PermissionDenied("you asked to keep it unverified: a second reviewer must confirm it")
    return request


def _may_keep_unverified(candidate: Candidate, check: Verification) -> None:
    """Keeping unverified is for hardware the lab has no worker of, and never for a win a
    worker refuted: refused then, while a verification runs or waits, or while a live
    worker serves the candidate's queue. Asked and confirmed alike."""
    if check.state == "disagrees":
        raise ValidationError(f"a worker of the lab measured it and found no win: {check.detail}",
                              code="refuted")
    if check.state == "pending":
        raise ValidationError(f"a worker is measuring it ({check.detail}): wait for its verdict",
                              code="verifying")
    live = workers.live_queues()
    if live is None:
        # Fail closed: a broker that cannot be asked may hide a worker that could verify it.
        raise ValidationError("the task broker cannot be asked which queues a worker serves: keeping "
                              "unverified waits until it can", code="workers-unknown")
    if candidate.sweep.queue in live:
        raise ValidationError(f"a worker of the lab serves queue {candidate.sweep.queue}: verify it instead",
                              code="verifiable")


def speed_not_decided_here(candidate: Candidate) -> str | None:
    """Why a win of this candidate cannot be kept for speed, or None: a CPU run decides
    only whether a kernel is right, unless CPU engines serve its op (Op.cpu_served)."""
    from runners.ops import get_op

    sweep = candidate.sweep
    hardware = HARDWARE.get(sweep.hardware)
    if hardware is None or hardware.device != "cpu" or get_op(sweep.thesis.op).cpu_served:
        return None
    return (f"{sweep.thesis.op} is served on GPUs: a CPU run decides whether the kernel is right, "
            "never whether it is faster. Time it on its GPU class to keep it.")


def _speed_decided_here(candidate: Candidate) -> None:
    why = speed_not_decided_here(candidate)
    if why:
        raise ValidationError(why, code="cpu-decides-correctness")


def candidate_keep_unverified_request(*, candidate: Candidate, reviewer, commit: str, comment: str = "",
                                      dispatch_min: int | None = None,
                                      dispatch_max: int | None = None) -> UnverifiedKeepRequest:
    """Ask to keep an imported win no worker of the lab verified: a second reviewer's
    confirmation (candidate_keep with confirm_unverified) keeps it, marked unverified.
    Refused for a win that is not imported, is verified, or was refuted by a worker."""
    comment = _clean_comment(comment)
    with transaction.atomic():
        candidate = _locked_waiting_candidate(candidate=candidate, reviewer=reviewer, commit=commit)
        _speed_decided_here(candidate)
        if not is_imported(candidate):
            raise ValidationError("this win was measured by a worker of the lab: keep it as any other",
                                  code="not-imported")
        check = verification(candidate)
        if check.agrees:
            raise ValidationError(f"it is verified ({check.detail}): keep it as any other", code="verified")
        _may_keep_unverified(candidate, check)
        if candidate.unverified_requests.filter(revision=candidate.revision).exists():
            raise ValidationError("keeping this revision unverified was already asked: a second reviewer "
                                  "confirms it", code="decided")
        _, low, high = _dispatch(candidate, dispatch_min, dispatch_max)
        return UnverifiedKeepRequest.objects.create(
            candidate=candidate, revision=candidate.revision, commit=candidate.commit, requested_by=reviewer,
            comment=comment, dispatch_min=low, dispatch_max=high)


def candidate_keep(*, candidate: Candidate, reviewer, commit: str, comment: str = "",
                   dispatch_min: int | None = None, dispatch_max: int | None = None,
                   saw_hidden_characters: bool = False, confirm_unverified: bool = False) -> Review:
    """Keep a win: merge its branch into main with its dispatch range, authored by the
    thesis author, with the reviewer in a `Reviewed-by:` trailer. A change holding
    characters a diff cannot show (reviews.diffs) is kept only by a reviewer who says
    they read them, shown as escapes. An imported win is kept once a worker verified it
    (reviews.verification), or, with `confirm_unverified`, by a second reviewer who
    confirms another's request to keep it unverified (then on the request's range)."""
    comment = _clean_comment(comment)
    with workspace.lock(), transaction.atomic():
        candidate = _locked_waiting_candidate(candidate=candidate, reviewer=reviewer, commit=commit)
        _speed_decided_here(candidate)
        if not candidate.commit:
            raise ValidationError("this candidate has no commit in the kernel workspace to merge",
                                  code="no-commit")
        hidden = candidate_hidden_characters(candidate)
        if hidden and not saw_hidden_characters:
            raise ValidationError({"saw_hidden_characters": (
                f"the change holds characters a diff cannot show ({', '.join(hidden)}): read them "
                "where the diff marks them, then tick that you did")}, code="hidden-characters")
        check = verification(candidate) if is_imported(candidate) else None
        request = _unverified_request(candidate, check, reviewer, confirm_unverified)
        # The figures a keep writes are the lab's own: for a verified import, its worker's run.
        measured = lab_measurement(candidate, check)
        if request is not None:
            dispatch_min, dispatch_max = request.dispatch_min, request.dispatch_max
            comment = "\n\n".join(part for part in (
                f"Kept unverified: asked by {request.requested_by.get_username()}"
                + (f" ({request.comment})" if request.comment else ""), comment) if part)
        axis, low, high = _dispatch(measured, dispatch_min, dispatch_max)
        sweep, thesis = candidate.sweep, candidate.sweep.thesis
        review = Review(
            candidate=candidate, commit=candidate.commit, revision=candidate.revision,
            decision=Review.Decision.KEEP, reviewer=reviewer, author=thesis.author,
            producer=sweep.started_by, comment=comment,
            dispatch_axis=axis, dispatch_min=low, dispatch_max=high, unverified_request=request,
        )
        reviewer_identity = workspace.identity_of(reviewer)
        entry = {
            "kernel": sweep.kernel, "candidate": candidate.label, "revision": candidate.revision,
            "commit": candidate.commit, "path": workspace.kept_path(thesis.op, sweep.hardware),
            "params": candidate.params, "axis": axis or None, "min": low, "max": high,
            "geomean_speedup": measured.geomean_speedup, "hardware": sweep.hardware,
            "thesis": thesis.pk, "author": thesis.author.get_username(),
            "reviewer": reviewer.get_username(), "kept_at": timezone.now().isoformat(timespec="seconds"),
            # False: an imported win kept by two reviewers without a worker's measurement.
            "verified": request is None,
        }
        try:
            merge = workspace.merge_build(
                op=thesis.op, hardware=sweep.hardware, commit=candidate.commit, base=sweep.base_commit,
                entry=entry,
                message=_merge_message(candidate, review, reviewer_identity, measured),
                author=workspace.identity_of(thesis.author), reviewer=reviewer_identity,
            )
        except workspace.WorkspaceConflict as conflict:
            raise ValidationError(str(conflict), code="conflict") from conflict
        review.merge_commit = merge.commit
        review.save()
        _notify(type="candidate.kept", review=review, candidate=candidate, measured=measured)
        transaction.on_commit(publish_queue_changed)
        compounding.request_on_commit(sweep.hardware)
        workspace.publish([workspace.RefUpdate(workspace.MAIN, merge.commit, old=merge.previous_main)])
    return review


def candidate_revert(*, candidate: Candidate, reviewer, commit: str, comment: str = "") -> Review:
    """Revert a win: its branch is renamed into archive/, main is untouched."""
    comment = _clean_comment(comment)
    with workspace.lock(), transaction.atomic():
        candidate = _locked_waiting_candidate(candidate=candidate, reviewer=reviewer, commit=commit)
        sweep = candidate.sweep
        archived = (workspace.archive_branch(sweep.pk, candidate.number, candidate.revision)
                    if candidate.commit else "")
        review = Review.objects.create(
            candidate=candidate, commit=candidate.commit, revision=candidate.revision,
            decision=Review.Decision.REVERT, reviewer=reviewer, author=sweep.thesis.author,
            producer=sweep.started_by, comment=comment, archived_branch=archived,
        )
        _notify(type="candidate.reverted", review=review, candidate=candidate)
        transaction.on_commit(publish_queue_changed)
        if archived:
            Candidate.objects.filter(pk=candidate.pk).update(branch=archived)
            workspace.publish([
                workspace.RefUpdate(archived, candidate.commit, check=False),
                workspace.RefUpdate(workspace.candidate_branch(sweep.pk, candidate.number), None,
                                    old=candidate.commit),
            ])
    return review


def _undo_message(candidate: Candidate, keep: Review, review: Review) -> str:
    sweep, thesis = candidate.sweep, candidate.sweep.thesis
    # The entry below the keep's own in its dispatch list: what the kept file held before.
    below = workspace.dispatch_entries(thesis.op, sweep.hardware, keep.merge_commit)[1:2]
    previous = (f"candidate {below[0].get('candidate')}'s {below[0].get('kernel')}"
                if below and below[0].get("commit") else "the shipped baseline")
    return "\n".join([
        f"Undo the keep of {thesis.op} candidate {candidate.label} on {sweep.hardware}",
        "",
        f"This reverts commit {keep.merge_commit}, the keep of candidate commit {candidate.commit}",
        f"(revision {candidate.revision}) by {keep.reviewer.get_username()} for {keep.dispatch_text}.",
        f"{workspace.kept_path(thesis.op, sweep.hardware)} is {previous} again; its dispatch entry is removed.",
        "",
        review.comment,
    ])


def _newer_keep(keep: Review) -> Review | None:
    """A keep of the same op and hardware class made after `keep` and not undone: the
    kernel main serves there now, which an undo of `keep` would silently replace."""
    sweep = keep.candidate.sweep
    return (Review.objects.filter(decision=Review.Decision.KEEP, candidate__sweep__thesis__op=sweep.thesis.op,
                                  candidate__sweep__hardware=sweep.hardware, undone_by__isnull=True)
            .filter(Q(created_at__gt=keep.created_at) | Q(created_at=keep.created_at, pk__gt=keep.pk))
            .select_related("candidate", "reviewer").order_by("-created_at", "-id").first())


def candidate_undo(*, candidate: Candidate, reviewer, commit: str, comment: str) -> Review:
    """Undo a keep: a new decision (the keep's row stays) and a commit on main, authored by
    the reviewer, that brings back the op's kernel on that hardware class from before the
    keep and removes the keep's dispatch entry; other classes are untouched. The same
    four eyes as a keep; only the class's newest keep can be undone, and a reason is
    required."""
    comment = _clean_comment(comment)
    if not comment:
        raise ValidationError({"comment": [ValidationError("say why the keep is undone", code="required")]})
    with workspace.lock(), transaction.atomic():
        candidate = _locked_candidate(candidate=candidate, reviewer=reviewer)
        _saw_current_revision(candidate, commit)
        keep = (candidate.reviews.filter(revision=candidate.revision, decision=Review.Decision.KEEP)
                .select_related("reviewer", "candidate__sweep__thesis").first())
        if keep is None:
            raise ValidationError("only a kept candidate can be undone", code="not-kept")
        undone = Review.objects.filter(undoes=keep).select_related("reviewer").first()
        if undone is not None:
            raise ValidationError(f"this keep was already undone by {undone.reviewer.get_username()} "
                                  f"on {undone.created_at:%Y-%m-%d %H:%M}", code="decided")
        newer = _newer_keep(keep)
        if newer is not None:
            raise ValidationError(
                f"candidate {newer.candidate.label} was kept after it on {candidate.sweep.hardware} "
                f"(by {newer.reviewer.get_username()}, merge {newer.merge_commit[:12]}) and is the kernel "
                "main serves there now: undo that keep first", code="not-current")
        sweep, thesis = candidate.sweep, candidate.sweep.thesis
        review = Review(
            candidate=candidate, commit=candidate.commit, revision=candidate.revision,
            decision=Review.Decision.UNDO, reviewer=reviewer, author=thesis.author,
            producer=sweep.started_by, comment=comment, undoes=keep,
            dispatch_axis=keep.dispatch_axis, dispatch_min=keep.dispatch_min, dispatch_max=keep.dispatch_max,
        )
        try:
            undo = workspace.undo_build(
                op=thesis.op, hardware=sweep.hardware, merge=keep.merge_commit, commit=candidate.commit,
                message=_undo_message(candidate, keep, review),
                author=workspace.identity_of(reviewer))
        except workspace.WorkspaceConflict as conflict:
            raise ValidationError(str(conflict), code="conflict") from conflict
        review.revert_commit = undo.commit
        review.save()
        _notify(type="candidate.undone", review=review, candidate=candidate)
        transaction.on_commit(publish_queue_changed)
        compounding.request_on_commit(sweep.hardware)
        workspace.publish([workspace.RefUpdate(workspace.MAIN, undo.commit, old=undo.previous_main)])
    return review
