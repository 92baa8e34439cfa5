"""Reads for the review queue, the review page, the keep/revert path and the leaderboard.

A decision counts only for the revision it was made on: everywhere here a candidate is
"decided" when a review exists for its current revision, so a new commit puts it back.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable

import pygments
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

import workspace
from research.hardware import HARDWARE
from research.models import Candidate, GuardFinding, Sweep, Thesis
from reviews import diffs
from reviews.diffs import FileDiff, hidden_characters, render_diff
from reviews.models import Review
from reviews.retiming import stale_filter
from runners import ops
from runners.harness.dispatch import size_axis
from runners.harness.stats import P_THRESHOLD

LEADERBOARD_PERIODS = {"7": 7, "30": 30, "90": 90, "all": None}
PATH_LIMIT = 2000
THESIS_CHOICES = 200
RECORDED = [Candidate.Status.DONE, Candidate.Status.FAILED]
# A VERIFY sweep measures an imported candidate again: it is that candidate's evidence
# (its review page shows it), not a new candidate to review, chart or count.
VERIFICATION_RUNS = Q(sweep__strategy=Sweep.Strategy.VERIFY)
# A HEAD_TO_HEAD sweep times one waiting win against another, not against the kept kernel:
# its speedup is over a kernel main never ran, so it is not reviewed, charted or counted either.
RUNS_ABOUT_OTHERS = VERIFICATION_RUNS | Q(sweep__strategy=Sweep.Strategy.HEAD_TO_HEAD)


def _decided_now() -> Exists:
    return Exists(Review.objects.filter(candidate=OuterRef("pk"), revision=OuterRef("revision")))


def _speed_not_decided_here() -> Q:
    """CPU wins of ops served on GPUs: a CPU run decides only that such a kernel is right
    (reviews.services.speed_not_decided_here), so they wait for no keep."""
    cpu_classes = [key for key, hw in HARDWARE.items() if hw.device == "cpu"]
    gpu_served = [name for name in ops.list_ops() if not ops.get_op(name).cpu_served]
    return Q(sweep__hardware__in=cpu_classes, sweep__thesis__op__in=gpu_served)


def review_queue(*, op: str = "", hardware: str = "", author: int | None = None,
                 thesis: int | None = None, reviewable_by=None, stale: bool = False) -> QuerySet[Candidate]:
    """Wins not yet decided for their current revision that can be kept, oldest result
    first; with `reviewable_by`, only those that person may decide (neither filed nor
    produced). With `stale`, instead, the undecided wins timed against a kernel that is
    no longer kept (reviews.retiming): they wait for a re-time, not a decision."""
    finished_runs = Candidate.objects.filter(VERIFICATION_RUNS, sweep__verifies=OuterRef("pk"),
                                             status=Candidate.Status.DONE)
    queue = (
        Candidate.objects.filter(verdict="win", status=Candidate.Status.DONE)
        .exclude(_decided_now())
        .exclude(RUNS_ABOUT_OTHERS)
        .exclude(_speed_not_decided_here())
        # An imported win a worker found a win too, and none found otherwise (the badge;
        # reviews.verification decides, with the details).
        .annotate(verified_here=Exists(finished_runs.filter(verdict="win"))
                  & ~Exists(finished_runs.exclude(verdict="win")))
        # A result too good to be true (the plausibility guard): shown first on its page,
        # marked in the queue.
        .annotate(needs_scrutiny=Exists(GuardFinding.objects.filter(
            candidate=OuterRef("pk"), name="plausibility").exclude(status=GuardFinding.Status.PASS)))
        .select_related("sweep__thesis__author", "sweep__started_by")
        .order_by("finished_at", "id")
    )
    if stale:
        # Once a re-time has its result, that result is what waits (or was refused).
        queue = queue.filter(stale_filter()).exclude(retimings__candidates__status=Candidate.Status.DONE)
    else:
        queue = queue.exclude(stale_filter())
    if reviewable_by is not None:
        queue = queue.exclude(sweep__thesis__author=reviewable_by).exclude(sweep__started_by=reviewable_by)
    if op:
        queue = queue.filter(sweep__thesis__op=op)
    if hardware:
        queue = queue.filter(sweep__hardware=hardware)
    if author:
        queue = queue.filter(sweep__thesis__author_id=author)
    if thesis:
        queue = queue.filter(sweep__thesis_id=thesis)
    return queue


def review_queue_count() -> int:
    return review_queue().count()


def review_queue_filter_choices() -> dict[str, list[tuple[Any, str]]]:
    """What the filters offer. Every author and recent thesis, not only those waiting now,
    so a filter stays valid (and shows an empty list) once its last win is decided."""
    theses = Thesis.objects.order_by("-created_at", "-id").values_list("pk", "title")[:THESIS_CHOICES]
    authors = (get_user_model().objects.filter(theses__isnull=False).distinct()
               .order_by("username").values_list("pk", "username"))
    return {
        "op": [(name, name) for name in ops.list_ops()],
        "hardware": [(key, hw.label) for key, hw in HARDWARE.items()],
        "author": list(authors),
        "thesis": [(pk, f"#{pk} {title}") for pk, title in theses],
    }


def candidate_decision(candidate: Candidate) -> Review | None:
    """The latest decision on the candidate's current revision, if any: an undo, once
    its keep was undone (the keep is the undo's `undoes`)."""
    return (candidate.reviews.select_related("reviewer", "undoes__reviewer")
            .filter(revision=candidate.revision).first())


def candidate_reviews(candidate: Candidate) -> list[Review]:
    return list(candidate.reviews.select_related("reviewer").order_by("-revision", "-created_at"))


def _kept_now() -> Q:
    """Keeps no later decision undid."""
    return Q(decision=Review.Decision.KEEP, undone_by__isnull=True)


def op_kept_history(op: str) -> list[Review]:
    """Kept kernels of an op, newest first (the shipped baseline is below them all); an
    undone keep is no longer one."""
    return list(
        Review.objects.filter(_kept_now(), candidate__sweep__thesis__op=op)
        .select_related("candidate__sweep__thesis", "reviewer", "author")
        .order_by("-created_at", "-id")
    )


def latest_kept(op: str, hardware: str, *, other_than: Candidate) -> Candidate | None:
    """The candidate whose keep made the newest kept kernel of `op` on `hardware`, other
    than `other_than`: what a candidate of that class is compared with."""
    review = (Review.objects.filter(_kept_now(), candidate__sweep__thesis__op=op,
                                    candidate__sweep__hardware=hardware)
              .exclude(candidate=other_than).select_related("candidate").order_by("-created_at", "-id").first())
    return review.candidate if review else None


# -- what the review page shows ------------------------------------------------------

@dataclass(frozen=True)
class CandidateDiffs:
    against_kept: list[FileDiff]
    # The candidate's own commit against its parent, when that parent is not the kept
    # kernel: a sweep point's changed PARAMS values, or what a revision changed.
    own_commit: list[FileDiff] | None
    error: str = ""

    @property
    def hidden(self) -> list[tuple[str, str]]:
        """(file, character name) of every hidden character the change holds."""
        return [(file.path, name) for file in self.against_kept for name in file.hidden]


def candidate_hidden_characters(candidate: Candidate, *, from_cache: bool = False) -> list[str]:
    """The hidden characters (reviews.diffs) anywhere in the candidate's diff against the
    kept kernel it was timed against: what a keep asks the reviewer to have read. Raises
    workspace.WorkspaceError when the diff cannot be made. `from_cache`: as the page
    shows it (the keep itself asks git again)."""
    base, commit = candidate.sweep.base_commit, candidate.commit
    if not base or not commit:
        return []
    made = lambda: hidden_characters(workspace.diff(base, commit))  # noqa: E731
    return _of_commits("hidden-characters", base, commit, made) if from_cache else made()


def commit_diff(old: str, new: str, *, files: tuple[str, ...] = ()) -> list[FileDiff]:
    """Two workspace commits' diff as the review page shows it (highlighted, hidden
    characters revealed); with `files`, of those only. Raises workspace.WorkspaceError."""
    return render_diff(workspace.diff(old, new, files=files),
                       old_file=lambda file: workspace.read_file(old, file),
                       new_file=lambda file: workspace.read_file(new, file))


_FULL_SHA = re.compile(r"[0-9a-f]{40}")
# Two commits named by their full hashes always have the same diff, so what the review
# page makes of it (most of the page's own time: git calls and the highlighting) is kept
# in the cache, shared by every web process. The key names what renders it too (the
# source of reviews.diffs, Pygments' version): a new way of rendering never reads an old one.
_DIFF_RENDERING = hashlib.sha256(
    Path(diffs.__file__).read_bytes() + pygments.__version__.encode()).hexdigest()[:16]
DIFF_CACHE_S = 7 * 24 * 3600


def _of_commits(what: str, base: str, commit: str, make: Callable[[], Any]) -> Any:
    """make(), a function of the two commits' contents alone: from the cache when both
    are full hashes, kept there once made. What raises is never kept."""
    if not (_FULL_SHA.fullmatch(base) and _FULL_SHA.fullmatch(commit)):
        return make()
    key = f"{what}:{_DIFF_RENDERING}:{base}:{commit}"
    if (kept := cache.get(key)) is not None:
        return kept
    made = make()
    cache.set(key, made, DIFF_CACHE_S)
    return made


def candidate_diffs(candidate: Candidate) -> CandidateDiffs:
    """The git diffs of the review: against the kept kernel the candidate was timed against."""
    base, commit = candidate.sweep.base_commit, candidate.commit
    if not base or not commit:
        return CandidateDiffs([], None, "this candidate has no commit in the kernel workspace")

    def made() -> CandidateDiffs:
        against_kept = commit_diff(base, commit)
        parents = workspace.commit_info(commit)["parents"]
        return CandidateDiffs(against_kept, commit_diff(parents[0], commit) if parents and parents[0] != base else None)

    try:
        return _of_commits("review-diffs", base, commit, made)
    except workspace.WorkspaceError as error:
        return CandidateDiffs([], None, str(error))


@dataclass(frozen=True)
class WorkloadRow:
    """One workload of a result, placed on the op's size axis and in its group."""

    name: str
    size: int | None
    group: str
    baseline_ms: float | None
    baseline_ci: tuple[float, float] | None
    candidate_ms: float | None
    candidate_ci: tuple[float, float] | None
    speedup: float | None
    speedup_ci: tuple[float, float] | None
    significant: bool
    p_value: float | None
    roofline_fraction: float | None
    noise_floor: float | None
    # The first call at an unseen size beside this workload, candidate and kept kernel
    # (runners.harness.new_shapes): what a serving engine pays at every new size.
    first_call_shape: str | None = None
    first_call_ms: float | None = None
    first_call_baseline_ms: float | None = None
    # Why the harness did not call it significant (None when it did): the first of its
    # conditions that failed (runners.harness.stats.compare, evaluate._workload_results).
    why_not: str | None = None


def why_not_significant(workload: dict, *, timing_meaningful: bool = True) -> str | None:
    """The reason a workload's speedup is not significant, in the order the harness tests."""
    if workload.get("significant"):
        return None
    speedup, floor, p = workload.get("speedup"), workload.get("noise_floor"), workload.get("p_value")
    ci = _pair(workload.get("speedup_ci"))
    if speedup is None:
        return "not timed"
    if not timing_meaningful:
        return "times here say nothing about the GPU (a CPU interpreter ran the kernel)"
    if p is not None and p >= P_THRESHOLD:
        return f"p = {p:.2g}, not under {P_THRESHOLD:g}"
    if ci is not None and ci[0] <= 1 <= ci[1]:
        return f"its interval [{ci[0]:.3f}, {ci[1]:.3f}] holds 1×"
    if floor is not None and abs(math.log(speedup)) <= math.log1p(floor):
        return (f"inside this run's noise floor of ±{floor:.0%} (what two processes of the same kernel "
                "differ by here)")
    return ("not beyond the noise floor once the most the clock check could have missed is added back "
            "to each call")


def _pair(value: Any) -> tuple[float, float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return float(value[0]), float(value[1])
    return None


def workload_layout(candidate: Candidate) -> tuple[str | None, dict[str, tuple[int | None, str]]]:
    """The op's size axis and, per workload name, its size and group.

    The group is the workload parameters that vary besides the size (dtype for
    rmsnorm, batch for the indexer): one curve each.
    """
    thesis = candidate.sweep.thesis
    device = HARDWARE[candidate.sweep.hardware].device
    try:
        op = ops.get_op(thesis.op)
        workloads = op.workloads(device, thesis.context_lengths, thesis.batch_sizes)
    except (ops.UnknownOpError, ops.WorkloadError):
        return None, {}
    return workload_groups(op, workloads)


def workload_groups(op: ops.Op, workloads: list[ops.Workload],
                    ) -> tuple[str | None, dict[str, tuple[int | None, str]]]:
    """The size axis of `workloads` and each one's size and group (see workload_layout)."""
    axis = size_axis(dict(workloads[0].params)) if workloads else None
    varying = sorted(key for key in {k for w in workloads for k in w.params}
                     if key != axis and key not in op.sized_params
                     and len({repr(w.params.get(key)) for w in workloads}) > 1)
    layout = {
        w.name: (w.params.get(axis) if axis else None,
                 ",".join(f"{key}={w.params.get(key)}" for key in varying) or "all")
        for w in workloads
    }
    return axis, layout


def candidate_workload_rows(candidate: Candidate) -> tuple[str | None, list[WorkloadRow]]:
    axis, layout = workload_layout(candidate)
    rows = []
    for w in (candidate.result or {}).get("workloads") or []:
        size, group = layout.get(w.get("name"), (None, "all"))
        rows.append(WorkloadRow(
            name=w.get("name", "?"), size=size, group=group,
            baseline_ms=w.get("baseline_ms"), baseline_ci=_pair(w.get("baseline_ci_ms")),
            candidate_ms=w.get("candidate_ms"), candidate_ci=_pair(w.get("candidate_ci_ms")),
            speedup=w.get("speedup"), speedup_ci=_pair(w.get("speedup_ci")),
            significant=bool(w.get("significant")), p_value=w.get("p_value"),
            roofline_fraction=w.get("roofline_fraction"), noise_floor=w.get("noise_floor"),
            first_call_shape=w.get("first_call_shape"), first_call_ms=w.get("first_call_ms"),
            first_call_baseline_ms=w.get("first_call_baseline_ms"),
            why_not=why_not_significant(w, timing_meaningful=(candidate.result or {}).get("timing_meaningful", True)),
        ))
    return axis, rows


_GUARD_ORDER = {"fail": 0, "warn": 1, "pass": 2}


def candidate_warnings(guards: list) -> list:
    """What the summary at the top of the review page names: every guard that did not
    pass, the "needs scrutiny" flag first (candidate_guards' order)."""
    return [guard for guard in guards if guard.status != GuardFinding.Status.PASS]


def candidate_guards(candidate: Candidate) -> list:
    """A "needs scrutiny" flag first, then failures, warnings and passes; in the
    harness's order within each."""
    def order(guard: GuardFinding) -> tuple[int, int, int]:
        scrutiny = guard.name == "plausibility" and guard.status != GuardFinding.Status.PASS
        return (0 if scrutiny else 1, _GUARD_ORDER.get(guard.status, 3), guard.id)
    return sorted(candidate.guards.all(), key=order)


@dataclass(frozen=True)
class EndToEnd:
    baseline_ms: float | None
    candidate_ms: float | None
    delta_pct: float | None

    @property
    def speedup(self) -> float | None:
        if self.baseline_ms and self.candidate_ms:
            return self.baseline_ms / self.candidate_ms
        return None

    @property
    def direction(self) -> str | None:
        """"faster" or "slower" per decode step (a bare "+70.53 %" read as a gain)."""
        if self.delta_pct is None or self.delta_pct == 0:
            return None
        return "slower" if self.delta_pct > 0 else "faster"


def end_to_end(result: dict | None) -> EndToEnd | None:
    """The end-to-end check of a result; None when it was not measured."""
    e2e = (result or {}).get("e2e")
    if not isinstance(e2e, dict):
        return None
    base, cand = e2e.get("baseline_ms"), e2e.get("candidate_ms")
    delta = e2e.get("delta_pct")
    if delta is None and base and cand:
        delta = 100 * (cand - base) / base
    return EndToEnd(baseline_ms=base, candidate_ms=cand, delta_pct=delta)


# -- the keep/revert path ------------------------------------------------------------

def _state(candidate: Candidate, decision: str | None) -> str:
    if decision == Review.Decision.KEEP:
        return "kept"
    if decision == Review.Decision.UNDO:
        return "undone"
    if decision == Review.Decision.REVERT:
        return "reverted"
    if candidate.verdict == "win":
        return "waiting"
    if candidate.verdict == "no-gain":
        return "no-gain"
    return "rejected"


def path_points(*, thesis_id: int | None = None, op: str = "") -> list[dict]:
    """Every evaluated candidate in the order its result came in, for the path chart,
    and every undo of a keep among them as a point of its own ("undo", half a step after
    the last result that came in before it, naming the kept point it undoes in `undoes`).

    y is the geomean speedup over the op's shipped baseline: a candidate is timed
    against the kernel kept when its sweep started, so its own speedup is compounded
    with the kept wins before that, and kept wins accumulate along the path; a keep
    undone before the sweep started is no longer part of that kernel.
    """
    candidates = (Candidate.objects.filter(status__in=RECORDED).exclude(RUNS_ABOUT_OTHERS)
                  .select_related("sweep__thesis"))
    if thesis_id:
        candidates = candidates.filter(sweep__thesis_id=thesis_id)
    if op:
        candidates = candidates.filter(sweep__thesis__op=op)
    candidates = list(candidates.order_by("finished_at", "id")[:PATH_LIMIT])
    decisions: dict[tuple[int, int], Review] = {}
    undos: list[Review] = []
    # Oldest first, so an undo's row (after its keep's) is the one a candidate shows.
    for review in (Review.objects.filter(candidate__in=[c.pk for c in candidates])
                   .select_related("undoes").order_by("created_at", "id")):
        decisions[(review.candidate_id, review.revision)] = review
        if review.is_undo:
            undos.append(review)
    # Kept wins compound per op and hardware class: each class keeps its own kernels,
    # each keep from its time until its undo, if any.
    keeps: dict[tuple[str, str], list[tuple[datetime, datetime | None, float]]] = {}
    for review in (Review.objects.filter(decision=Review.Decision.KEEP)
                   .select_related("candidate__sweep__thesis", "undone_by").order_by("created_at")):
        if review.candidate.geomean_speedup:
            sweep = review.candidate.sweep
            undone = getattr(review, "undone_by", None)
            keeps.setdefault((sweep.thesis.op, sweep.hardware), []).append(
                (review.created_at, undone.created_at if undone else None, review.candidate.geomean_speedup))

    points = []
    for x, candidate in enumerate(candidates, start=1):
        sweep, thesis = candidate.sweep, candidate.sweep.thesis
        review = decisions.get((candidate.pk, candidate.revision))
        base = math.prod(speedup for kept, undone, speedup in keeps.get((thesis.op, sweep.hardware), [])
                         if kept < sweep.created_at and (undone is None or undone >= sweep.created_at))
        y = candidate.geomean_speedup * base if candidate.geomean_speedup else None
        unverified = review.undoes if review and review.is_undo else review
        points.append({
            "x": x,
            "y": y,
            "op": thesis.op,
            "hardware": sweep.hardware,
            "state": _state(candidate, review.decision if review else None),
            "unverified": bool(unverified and unverified.unverified_request_id),
            "label": f"{sweep.kernel} {_short_params(candidate.params)}".strip(),
            "candidate": candidate.label,
            "thesis": thesis.title,
            "speedup": candidate.geomean_speedup,
            "when": candidate.finished_at.isoformat(timespec="seconds") if candidate.finished_at else "",
            "url": candidate.get_absolute_url(),
        })
    by_candidate = {(c.pk, c.revision): point for c, point in zip(candidates, points)}
    for undo in undos:
        undone = by_candidate.get((undo.candidate_id, undo.revision))
        if undone is None:
            continue  # a decision of an earlier revision: dismissed, like its keep
        points.append({
            **undone,
            "x": sum(1 for c in candidates if c.finished_at and c.finished_at <= undo.created_at) + 0.5,
            "state": "undo",
            "undoes": undone["x"],
            "label": f"undo of the keep of {undone['label']}",
            "when": undo.created_at.isoformat(timespec="seconds"),
        })
    return points


def _short_params(params: dict) -> str:
    # Sorted: PostgreSQL's jsonb does not keep the order the keys were written in.
    return " ".join(f"{key}={value}" for key, value in sorted((params or {}).items()))


# -- the leaderboard -----------------------------------------------------------------

@dataclass
class EndToEndContributed:
    hardware: str  # the hardware class's label
    measured: int = 0
    factor: float = 1.0  # the kept wins' end-to-end speedups, multiplied together


@dataclass
class Standing:
    key: str
    label: str
    tried: int = 0
    kept: int = 0
    # Per hardware class: a CPU step's speedup and an H200 step's do not multiply.
    e2e: dict[str, EndToEndContributed] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float | None:
        return self.kept / self.tried if self.tried else None

    @property
    def e2e_per_hardware(self) -> list[EndToEndContributed]:
        return [self.e2e[key] for key in HARDWARE if key in self.e2e]

    @property
    def best_e2e_speedup(self) -> float:
        """The largest class's product (1 when none was measured): what ranks ties."""
        return max((c.factor for c in self.e2e.values()), default=1.0)


def leaderboard(*, days: int | None, now: datetime | None = None) -> dict[str, list[Standing]]:
    """Per engineer (the thesis author) and per op, over candidates evaluated in the period.

    Kept counts the candidates of the period that were kept (on their current
    revision) and not undone, so the hit rate, kept / tried, is over the same candidates. The
    end-to-end speedup contributed is kept per hardware class.
    """
    candidates = Candidate.objects.filter(status__in=RECORDED).exclude(RUNS_ABOUT_OTHERS).annotate(
        kept_now=Exists(Review.objects.filter(_kept_now(), candidate=OuterRef("pk"),
                                              revision=OuterRef("revision"))))
    if days is not None:
        candidates = candidates.filter(finished_at__gte=(now or timezone.now()) - timedelta(days=days))
    rows = candidates.values_list("sweep__thesis__author_id", "sweep__thesis__op", "sweep__hardware",
                                  "kept_now", "result")
    names = dict(get_user_model().objects.values_list("pk", "username"))
    engineers: dict[Any, Standing] = {}
    by_op: dict[Any, Standing] = {}
    for author_id, op, hardware, kept, result in rows.iterator():
        e2e = end_to_end(result) if kept else None
        for table, key, label in ((engineers, author_id, names.get(author_id, "?")), (by_op, op, op)):
            standing = table.setdefault(key, Standing(key=str(key), label=label))
            standing.tried += 1
            if kept:
                standing.kept += 1
                if e2e and e2e.speedup:
                    label_of = HARDWARE[hardware].label if hardware in HARDWARE else hardware
                    contributed = standing.e2e.setdefault(hardware, EndToEndContributed(label_of))
                    contributed.measured += 1
                    contributed.factor *= e2e.speedup

    def ranked(table: dict[Any, Standing]) -> list[Standing]:
        return sorted(table.values(), key=lambda s: (-s.kept, -s.best_e2e_speedup, -(s.hit_rate or 0), s.label))

    return {"engineers": ranked(engineers), "ops": ranked(by_op)}
