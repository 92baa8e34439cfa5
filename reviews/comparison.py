"""Two candidates of one op and hardware class side by side, and a head-to-head of two wins.

A reviewer weighing wins of the same op on the same hardware class reads them next to
each other: verdicts, where each was measured, each workload's speedup with its interval
on one row, end-to-end deltas, the guards that did not pass, and the source diff between
the two. Candidates of different ops or classes are not compared: their speedups are
over different kept kernels, on different workloads or machines.

Two waiting wins whose dispatch ranges overlap cannot both be the best kernel in the
overlap, and their speedups, each over the kept kernel, do not say which is. A
head-to-head settles it: a HEAD_TO_HEAD sweep of one candidate times the challenger's
source against the challenged win's source in place of the kept kernel, queued like a
re-time (reviews.retiming). Its result is never kept (reviews.services refuses it and
the queue never lists it): it was timed against a kernel main never ran, and says only
which of the two is faster where.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from research import provenance, sweeps
import workspace
from research.models import Candidate, GuardFinding, Sweep
from reviews import retiming
from reviews.diffs import FileDiff
from reviews.models import Review
from reviews.selectors import (
    RUNS_ABOUT_OTHERS,
    EndToEnd,
    WorkloadRow,
    candidate_decision,
    candidate_guards,
    candidate_warnings,
    candidate_workload_rows,
    commit_diff,
    end_to_end,
)
from reviews.services import speed_not_decided_here
from reviews.verification import proposed_dispatch, verification
from runners.harness.dispatch import axis_name

PENDING = (Candidate.Status.QUEUED, Candidate.Status.RUNNING)
# How many candidates the review page's picker offers, newest first.
CHOICES = 100
CHOICE_FIELDS = ("id", "number", "status", "verdict", "geomean_speedup", "revision", "finished_at",
                 "sweep__id", "sweep__kernel", "sweep__strategy", "sweep__hardware",
                 "sweep__thesis__id", "sweep__thesis__title", "sweep__thesis__op")


def comparable(left: Candidate, right: Candidate) -> None:
    """Refuses (ValidationError) two candidates whose figures do not compare."""
    if left.pk == right.pk:
        raise ValidationError(f"candidate {left.label} compared with itself: pick another candidate", code="same")
    left_op, right_op = left.sweep.thesis.op, right.sweep.thesis.op
    if left_op != right_op:
        raise ValidationError(
            f"candidate {left.label} is a {left_op} kernel and {right.label} a {right_op} one: "
            "only kernels of one op compare", code="other-op")
    if left.sweep.hardware != right.sweep.hardware:
        raise ValidationError(
            f"candidate {left.label} was measured on {left.sweep.get_hardware_display()} and {right.label} on "
            f"{right.sweep.get_hardware_display()}: kernels are kept per hardware class, so only candidates "
            "of one class compare", code="other-hardware")


def choices(candidate: Candidate) -> list[tuple[Candidate, str]]:
    """What the review page offers to compare `candidate` with: the other wins of its op
    and hardware class (waiting, stale, kept or decided otherwise), newest first, each
    with where it stands."""
    sweep = candidate.sweep
    others = list(
        Candidate.objects.filter(sweep__thesis__op=sweep.thesis.op, sweep__hardware=sweep.hardware,
                                 status=Candidate.Status.DONE, verdict="win")
        .exclude(RUNS_ABOUT_OTHERS).exclude(pk=candidate.pk)
        .select_related("sweep__thesis").order_by("-finished_at", "-id")
        # What an option names and its state reads; a win's result, source and sweep
        # context are most of its row, and a hundred of them were most of the page's time.
        .only(*CHOICE_FIELDS)[:CHOICES])
    decisions = {(review.candidate_id, review.revision): review.decision for review in
                 Review.objects.filter(candidate__in=others).order_by("created_at", "id")}
    stale = set(Candidate.objects.filter(retiming.stale_filter(), pk__in=[c.pk for c in others])
                .values_list("pk", flat=True))
    return [(other, _state(other, decisions.get((other.pk, other.revision)), other.pk in stale))
            for other in others]


def _state(candidate: Candidate, decision: str | None, stale: bool) -> str:
    if decision:
        return {Review.Decision.KEEP: "kept", Review.Decision.REVERT: "reverted",
                Review.Decision.UNDO: "undone"}[decision]
    if candidate.sweep.strategy == Sweep.Strategy.HEAD_TO_HEAD:
        return "head-to-head"
    if candidate.status == Candidate.Status.DONE and candidate.verdict == "win":
        return "stale" if stale else "waiting"
    return candidate.verdict or candidate.status


@dataclass(frozen=True)
class Side:
    """One candidate as the comparison shows it."""

    candidate: Candidate
    state: str  # waiting, stale, kept, reverted, undone, head-to-head, or its verdict
    decision: Review | None
    provenance: str
    imported: bool
    dispatch: dict  # the range its figures propose ({} for none)
    e2e: EndToEnd | None
    warnings: list[GuardFinding]

    @property
    def dispatch_text(self) -> str:
        if self.decision is not None and self.decision.is_keep:
            return f"kept for {self.decision.dispatch_text}"
        if self.decision is not None and self.decision.is_undo:
            return f"none: the keep for {self.decision.dispatch_text} was undone"
        return self.dispatch.get("summary") or "none proposed"


def _side(candidate: Candidate) -> Side:
    decision = candidate_decision(candidate)
    imported = provenance.is_imported(candidate)
    stale = decision is None and retiming.stale_reason(candidate) is not None
    return Side(
        candidate=candidate, state=_state(candidate, decision.decision if decision else None, stale),
        decision=decision, provenance=provenance.describe(candidate), imported=imported,
        dispatch=proposed_dispatch(candidate, verification(candidate) if imported else None),
        e2e=end_to_end(candidate.result), warnings=candidate_warnings(candidate_guards(candidate)),
    )


@dataclass(frozen=True)
class AlignedRow:
    """One workload, with each side's figures (None where that side did not measure it)."""

    name: str
    size: int | None
    group: str
    left: WorkloadRow | None
    right: WorkloadRow | None


def aligned_rows(left: list[WorkloadRow], right: list[WorkloadRow]) -> list[AlignedRow]:
    """Both sides' workloads on shared rows, along the size axis; a workload only one side's
    thesis measured keeps a row with a gap on the other side."""
    by_name = {row.name: row for row in left}
    right_by_name = {row.name: row for row in right}
    names = list(dict.fromkeys([*by_name, *right_by_name]))

    def along_the_axis(name: str) -> tuple[bool, int, int]:
        row = by_name.get(name) or right_by_name[name]
        return row.size is None, row.size or 0, names.index(name)

    return [AlignedRow(name=name, size=(by_name.get(name) or right_by_name[name]).size,
                       group=(by_name.get(name) or right_by_name[name]).group,
                       left=by_name.get(name), right=right_by_name.get(name))
            for name in sorted(names, key=along_the_axis)]


@dataclass(frozen=True)
class HeadToHead:
    """One head-to-head run: `run`'s result is the challenger's speedup over the challenged."""

    run: Candidate
    challenger: Candidate
    challenged: Candidate
    rows: list[WorkloadRow]

    @property
    def pending(self) -> bool:
        return self.run.status in PENDING


@dataclass(frozen=True)
class Comparison:
    left: Side
    right: Side
    axis_name: str
    rows: list[AlignedRow]
    diff: list[FileDiff]
    diff_error: str
    # Where both claim to win, as text; or why a head-to-head is not offered.
    overlap: str
    head_to_head_refusal: str
    head_to_heads: list[HeadToHead]

    @property
    def hidden(self) -> list[tuple[str, str]]:
        """(file, character name) of every hidden character the diff holds."""
        return [(file.path, name) for file in self.diff for name in file.hidden]


def _source_diff(left: Candidate, right: Candidate) -> tuple[list[FileDiff], str]:
    """The kept kernel's file from one candidate's commit to the other's: the sources
    alone, whatever else moved on main between their sweeps."""
    if not left.commit or not right.commit:
        return [], "a candidate has no commit in the kernel workspace"
    kept_file = workspace.kept_path(left.sweep.thesis.op, left.sweep.hardware)
    try:
        return commit_diff(left.commit, right.commit, files=(kept_file,)), ""
    except workspace.WorkspaceError as error:
        return [], str(error)


def comparison(left: Candidate, right: Candidate) -> Comparison:
    """`left` and `right` side by side; refused (ValidationError) when they do not compare."""
    comparable(left, right)
    axis, left_rows = candidate_workload_rows(left)
    right_axis, right_rows = candidate_workload_rows(right)
    diff, diff_error = _source_diff(left, right)
    try:
        overlap = _range_text(*shared_range(left, right))
    except ValidationError:
        overlap = ""  # the refusal below names both ranges
    try:
        _may_time_against_each_other(left, right)
        refusal = ""
    except ValidationError as error:
        refusal = " ".join(error.messages)
    return Comparison(
        left=_side(left), right=_side(right), axis_name=axis_name(axis or right_axis),
        rows=aligned_rows(left_rows, right_rows), diff=diff, diff_error=diff_error,
        overlap=overlap, head_to_head_refusal=refusal, head_to_heads=head_to_heads(left, right),
    )


def _range_text(axis: str, low: int, high: int) -> str:
    return f"{axis.replace('_', ' ')} {low:,}–{high:,}"


def _claimed(candidate: Candidate) -> dict:
    return proposed_dispatch(candidate, verification(candidate) if provenance.is_imported(candidate) else None)


def shared_range(left: Candidate, right: Candidate) -> tuple[str, int, int]:
    """The sizes both wins' dispatch ranges claim (axis, low, high); refused when they
    claim none in common, naming each one's range."""
    ranges = [(candidate, _claimed(candidate)) for candidate in (left, right)]
    for candidate, claimed in ranges:
        if claimed.get("min") is None or claimed.get("max") is None:
            raise ValidationError(f"candidate {candidate.label} proposes no dispatch range", code="no-range")
    (_, a), (_, b) = ranges
    low, high = max(a["min"], b["min"]), min(a["max"], b["max"])
    if a.get("axis") != b.get("axis") or low > high:
        raise ValidationError(
            f"their dispatch ranges do not overlap: {left.label} wins for "
            f"{_range_text(a.get('axis') or 'size', a['min'], a['max'])}, {right.label} for "
            f"{_range_text(b.get('axis') or 'size', b['min'], b['max'])}; each can be kept for its own",
            code="apart")
    return a.get("axis") or "size", low, high


def _undecided_win(candidate: Candidate) -> None:
    if candidate.sweep.strategy in (Sweep.Strategy.VERIFY, Sweep.Strategy.HEAD_TO_HEAD):
        raise ValidationError(f"candidate {candidate.label} measures other candidates: it is never kept",
                              code="not-waiting")
    if candidate.status != Candidate.Status.DONE or candidate.verdict != "win":
        raise ValidationError(f"candidate {candidate.label} is not a win: only two waiting wins are timed "
                              "against each other", code="not-waiting")
    if candidate.reviews.filter(revision=candidate.revision).exists():
        raise ValidationError(f"candidate {candidate.label} is already decided", code="decided")
    if candidate.sweep.thesis.archived_at is not None:
        raise ValidationError(f"the thesis of candidate {candidate.label} is archived: restore it first",
                              code="archived")
    why = speed_not_decided_here(candidate)
    if why:
        raise ValidationError(f"candidate {candidate.label}: {why}", code="cpu-decides-correctness")


def _may_time_against_each_other(challenged: Candidate, challenger: Candidate) -> None:
    """Everything a head-to-head needs that the page can say before it is asked for."""
    comparable(challenged, challenger)
    for candidate in (challenged, challenger):
        _undecided_win(candidate)
    if challenged.source == challenger.source:
        raise ValidationError("both have the same source: nothing to time", code="same-source")
    shared_range(challenged, challenger)
    waiting = [duel.run for duel in head_to_heads(challenged, challenger) if duel.pending]
    if waiting:
        raise ValidationError(f"head-to-head {waiting[0].label} of these two is {waiting[0].status} already",
                              code="pending")


def head_to_heads(left: Candidate, right: Candidate) -> list[HeadToHead]:
    """Every head-to-head of the two, whichever was the challenger, newest first."""
    runs = (Candidate.objects.filter(sweep__strategy=Sweep.Strategy.HEAD_TO_HEAD)
            .filter(Q(sweep__challenger=left, sweep__challenged=right)
                    | Q(sweep__challenger=right, sweep__challenged=left))
            .select_related("sweep__thesis", "sweep__challenger", "sweep__challenged")
            .order_by("-sweep__created_at", "-sweep_id"))
    return [HeadToHead(run=run, challenger=run.sweep.challenger, challenged=run.sweep.challenged,
                       rows=candidate_workload_rows(run)[1]) for run in runs]


def head_to_head_start(*, challenged: Candidate, challenger: Candidate, requested_by) -> Candidate:
    """Queue the challenger's source timed against the challenged win's source, in place of
    the kept kernel; returns the new (never keepable) candidate.

    Whoever asks starts the sweep. Refused unless both are undecided wins of one op and
    hardware class, of theses in play, whose dispatch ranges overlap, and while a
    head-to-head of the two waits."""
    _may_time_against_each_other(challenged, challenger)
    with workspace.lock(), transaction.atomic():
        # Both rows, in one order, so two requests for the pair take turns.
        locked = {c.pk: c for c in Candidate.objects.select_for_update().select_related("sweep__thesis")
                  .filter(pk__in=[challenged.pk, challenger.pk]).order_by("pk")}
        challenged, challenger = locked[challenged.pk], locked[challenger.pk]
        _may_time_against_each_other(challenged, challenger)
        if not challenged.commit:
            raise ValidationError(f"candidate {challenged.label} has no commit in the kernel workspace",
                                  code="no-commit")
        axis, low, high = shared_range(challenged, challenger)
        sweep = challenger.sweep
        # Forked from the challenged win's commit: the run's diff on its own page is the
        # change from one to the other, what it was timed against.
        return sweeps.sweep_of_one(
            thesis=sweep.thesis, started_by=requested_by, kernel=sweep.kernel,
            strategy=Sweep.Strategy.HEAD_TO_HEAD, hardware=sweep.hardware, base_commit=challenged.commit,
            baseline_source=challenged.source, baseline_kernel=challenged.sweep.kernel,
            context=(f"Candidate {challenger.label}'s source timed against candidate {challenged.label}'s, "
                     f"where both claim to win ({_range_text(axis, low, high)})"),
            source=challenger.source, params=challenger.params, fork=challenged.commit,
            challenger=challenger, challenged=challenged)


def head_to_head_note(candidate: Candidate) -> str | None:
    """What a head-to-head's own page says instead of a decision; None for any other candidate."""
    sweep = candidate.sweep
    if sweep.strategy != Sweep.Strategy.HEAD_TO_HEAD:
        return None
    return (f"a head-to-head, not keepable: it says which of {sweep.challenged.label} and "
            f"{sweep.challenger.label} is faster where ({sweep.challenger.label}'s source timed against "
            f"{sweep.challenged.label}'s, not against the kept kernel)")
