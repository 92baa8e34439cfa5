"""Thin views: the queue, the review page and its decision, the path charts, the leaderboard.

One view serves the full page and, for htmx, its fragment. Refusals keep their
meaning in the status: 403 for who may not decide, 409 for a decision about a
revision or main line that moved on, 422 for input to correct.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from config.ratelimit import rate_limited
from research import provenance
import workspace
from research import selectors as research_selectors
from research.hardware import HARDWARE
from research.markdown import render_markdown
from research.models import Candidate, Sweep
from reviews import charts, comparison, compounding, diffs, retiming, selectors, services
from reviews.forms import DecisionForm, LeaderboardForm, QueueFilterForm
from runners.harness.dispatch import axis_name
from reviews.models import Review
from reviews.verification import proposed_dispatch, verification, verification_start
from runners import ops

QUEUE_PAGE = 200
CONFLICT_CODES = {"stale", "decided", "conflict", "not-waiting", "no-commit", "not-kept", "not-current"}


@login_required
@require_GET
def review_queue(request: HttpRequest) -> HttpResponse:
    form = QueueFilterForm(request.GET, choices=selectors.review_queue_filter_choices())
    filters = form.filters(request.user)
    queue = selectors.review_queue(**filters)
    stale = selectors.review_queue(**filters, stale=True).prefetch_related("retimings__candidates")
    template = "reviews/queue.html#queue-list" if request.htmx else "reviews/queue.html"
    return render(request, template, {
        "form": form, "candidates": queue[:QUEUE_PAGE], "waiting": queue.count(), "stale": stale[:QUEUE_PAGE],
    })


@login_required
@require_GET
def candidate_review(request: HttpRequest, candidate_id: int) -> HttpResponse:
    candidate = research_selectors.candidate_get(candidate_id)
    return render(request, "reviews/candidate.html", _review_context(request, candidate))


@login_required
@require_GET
def candidate_source(request: HttpRequest, candidate_id: int) -> HttpResponse:
    """The candidate's whole kernel file, as the diff shows code (reviews.diffs)."""
    candidate = research_selectors.candidate_get(candidate_id)
    sweep = candidate.sweep
    path = workspace.kept_path(sweep.thesis.op, sweep.hardware)
    return render(request, "reviews/source.html", {
        "candidate": candidate, "file": diffs.render_file(candidate.source, path)})


@login_required
@require_POST
@rate_limited("candidate-decide")
def candidate_decide(request: HttpRequest, candidate_id: int) -> HttpResponse:
    candidate = research_selectors.candidate_get(candidate_id)
    form = DecisionForm(request.POST)
    status = 422
    if form.is_valid():
        data = form.cleaned_data
        try:
            if data["decision"] in ("keep", DecisionForm.CONFIRM_UNVERIFIED):
                services.candidate_keep(
                    candidate=candidate, reviewer=request.user, commit=data["commit"],
                    comment=data["comment"], dispatch_min=data["dispatch_min"],
                    dispatch_max=data["dispatch_max"], saw_hidden_characters=data["saw_hidden_characters"],
                    confirm_unverified=data["decision"] == DecisionForm.CONFIRM_UNVERIFIED)
            elif data["decision"] == DecisionForm.ASK_UNVERIFIED:
                services.candidate_keep_unverified_request(
                    candidate=candidate, reviewer=request.user, commit=data["commit"],
                    comment=data["comment"], dispatch_min=data["dispatch_min"],
                    dispatch_max=data["dispatch_max"])
            elif data["decision"] == Review.Decision.UNDO:
                services.candidate_undo(candidate=candidate, reviewer=request.user,
                                        commit=data["commit"], comment=data["comment"])
            else:
                services.candidate_revert(candidate=candidate, reviewer=request.user,
                                          commit=data["commit"], comment=data["comment"])
        except PermissionDenied as refusal:
            form.add_error(None, str(refusal))
            status = 403
        except ValidationError as error:
            if hasattr(error, "error_dict"):
                for field, field_messages in error.message_dict.items():
                    form.add_error(field if field in form.fields else None, field_messages)
            else:
                form.add_error(None, error.messages)
            status = 409 if getattr(error, "code", None) in CONFLICT_CODES else 422
        else:
            if not request.htmx:
                return redirect(candidate.get_absolute_url())
            candidate = research_selectors.candidate_get(candidate_id)
            return render(request, "reviews/candidate.html#decision", _decision_context(request, candidate))
    if request.htmx:
        return render(request, "reviews/candidate.html#decision",
                      _decision_context(request, candidate, form=form), status=status)
    return render(request, "reviews/candidate.html", _review_context(request, candidate, form=form),
                  status=status)


@login_required
@require_POST
@rate_limited("candidate-verify")
def candidate_verify(request: HttpRequest, candidate_id: int) -> HttpResponse:
    """Queue a worker's evaluation of an imported win (reviews.verification)."""
    candidate = research_selectors.candidate_get(candidate_id)
    try:
        verification_start(candidate=candidate, requested_by=request.user)
    except PermissionDenied as refusal:
        return render(request, "reviews/candidate.html",
                      {**_review_context(request, candidate), "verify_error": str(refusal)}, status=403)
    except ValidationError as error:
        return render(request, "reviews/candidate.html",
                      {**_review_context(request, candidate), "verify_error": " ".join(error.messages)},
                      status=422)
    return redirect(candidate.get_absolute_url() + "#provenance")


@login_required
@require_POST
@rate_limited("sweep-start")
def candidate_retime(request: HttpRequest, candidate_id: int) -> HttpResponse:
    """Time a stale win again against today's kept kernel (reviews.retiming)."""
    candidate = research_selectors.candidate_get(candidate_id)
    try:
        run = retiming.retime_start(candidate=candidate, requested_by=request.user)
    except ValidationError as error:
        messages.error(request, "Not re-timed: " + " ".join(error.messages))
        return redirect(candidate.get_absolute_url())
    messages.success(request, f"Candidate {candidate.label} is re-timed as {run.label}, against today's kept kernel.")
    return redirect(run.sweep)


@login_required
@require_GET
def candidate_compare_pick(request: HttpRequest, candidate_id: int) -> HttpResponse:
    """The review page's picker: on to the comparison with the chosen candidate."""
    candidate = research_selectors.candidate_get(candidate_id)
    other = request.GET.get("with", "")
    if not other.isdigit():
        return _compare_refused(request, "pick a candidate to compare with")
    return redirect("candidate_compare", candidate.pk, int(other))


@login_required
@require_GET
def candidate_compare(request: HttpRequest, candidate_id: int, other_id: int) -> HttpResponse:
    """Two candidates of one op and hardware class side by side (reviews.comparison)."""
    left = research_selectors.candidate_get(candidate_id)
    right = research_selectors.candidate_get(other_id)
    try:
        compared = comparison.comparison(left, right)
    except ValidationError as refusal:
        return _compare_refused(request, " ".join(refusal.messages), candidate=left)
    return render(request, "reviews/compare.html", {"compared": compared, "left": left, "right": right})


def _compare_refused(request: HttpRequest, reason: str, candidate: Candidate | None = None) -> HttpResponse:
    return render(request, "reviews/compare.html", {"refusal": reason, "left": candidate}, status=400)


@login_required
@require_POST
@rate_limited("sweep-start")
def candidate_head_to_head(request: HttpRequest, candidate_id: int, other_id: int) -> HttpResponse:
    """Time the right-hand win's source against the left-hand one's (reviews.comparison)."""
    challenged = research_selectors.candidate_get(candidate_id)
    challenger = research_selectors.candidate_get(other_id)
    back = redirect("candidate_compare", challenged.pk, challenger.pk)
    try:
        run = comparison.head_to_head_start(challenged=challenged, challenger=challenger,
                                            requested_by=request.user)
    except ValidationError as error:
        messages.error(request, "Not timed against each other: " + " ".join(error.messages))
        return back
    messages.success(request, f"Candidate {challenger.label} is timed against {challenged.label} as "
                              f"{run.label}: its result appears here once a worker has it.")
    return back


def _may_decide(user, candidate: Candidate, decided: bool) -> tuple[bool, str]:
    sweep = candidate.sweep
    if decided:
        return False, ""
    if candidate.verdict != "win" or candidate.status != Candidate.Status.DONE:
        return False, "Only an evaluated win waits for a decision."
    if sweep.verifies_id:
        return False, "This run verifies an imported candidate: decide on that one."
    if note := comparison.head_to_head_note(candidate):
        return False, note[0].upper() + note[1:] + "."
    return _four_eyes(user, candidate, "review its candidates", "review it")


def _four_eyes(user, candidate: Candidate, on_thesis: str, on_candidate: str) -> tuple[bool, str]:
    sweep = candidate.sweep
    if user.pk == sweep.thesis.author_id:
        return False, f"You filed this thesis: a colleague must {on_thesis}."
    if user.pk == sweep.started_by_id:
        return False, f"You started this sweep, so you produced this candidate: a colleague must {on_candidate}."
    if not user.has_perm(services.DECIDE_PERMISSION):
        return False, "You do not have the permission to keep or revert candidates."
    return True, ""


def _may_undo(user, candidate: Candidate, decision: Review | None) -> tuple[bool, str]:
    """Whether the page offers to undo the keep (the service checks it all again, the
    newest-keep rule included, and names the newer keep when it refuses)."""
    if decision is None or not decision.is_keep:
        return False, ""
    return _four_eyes(user, candidate, "undo a keep of its candidates", "undo its keep")


def _hidden_characters(candidate: Candidate) -> list[str]:
    """What the keep will ask about (the service checks it again, failing closed): none
    when the diff cannot be made, which the page reports on its own."""
    try:
        return selectors.candidate_hidden_characters(candidate, from_cache=True)
    except workspace.WorkspaceError:
        return []


def _decision_context(request: HttpRequest, candidate: Candidate, form: DecisionForm | None = None) -> dict:
    decision = selectors.candidate_decision(candidate)
    head_to_head = comparison.head_to_head_note(candidate)
    may_decide, why_not = _may_decide(request.user, candidate, decision is not None)
    may_undo, why_not_undo = _may_undo(request.user, candidate, decision)
    imported = provenance.is_imported(candidate)
    check = verification(candidate) if imported else None
    # A verified import's range is proposed by the worker's run, never by the file.
    proposed = proposed_dispatch(candidate, check)
    axis = proposed.get("axis") or selectors.workload_layout(candidate)[0]
    return {
        "candidate": candidate,
        "decision": decision,
        # An imported win: where its verification stands, and any request to keep it unverified.
        "imported": imported,
        "verification": check,
        "unverified_request": (candidate.unverified_requests.select_related("requested_by")
                               .filter(revision=candidate.revision).first() if imported else None),
        "hidden_characters": _hidden_characters(candidate) if may_decide or form else [],
        # Timed against another waiting win on purpose: never kept, never re-timed.
        "head_to_head": head_to_head,
        # Timed against a kernel no longer kept: re-timed, not kept (reviews.retiming).
        "stale": retiming.stale_reason(candidate) if decision is None and not head_to_head else None,
        "retimings": retiming.retimings(candidate),
        # A CPU win of an op served on GPUs: revertable, never kept for speed.
        "speed_not_decided": services.speed_not_decided_here(candidate),
        # A refused undo comes back to the undo form (the decision stays the keep).
        "may_decide": may_decide or (form is not None and decision is None),
        "why_not": why_not,
        "may_undo": may_undo or (form is not None and decision is not None and decision.is_keep),
        "why_not_undo": why_not_undo,
        "axis_name": axis_name(axis),
        "proposed": proposed,
        "decision_form": form or DecisionForm(initial={
            "commit": candidate.commit, "decision": "keep",
            "dispatch_min": proposed.get("min"), "dispatch_max": proposed.get("max"),
        }),
    }


# Diff lines shown unfolded; an 823-line kernel made the page 18,821 px tall before its
# curves, guards and decision.
DIFF_OPEN_LINES = 150


def _review_context(request: HttpRequest, candidate: Candidate, form: DecisionForm | None = None) -> dict:
    sweep, thesis = candidate.sweep, candidate.sweep.thesis
    context = _decision_context(request, candidate, form)
    decision = context["decision"]
    axis, rows = selectors.candidate_workload_rows(candidate)
    shaded = context["proposed"] or None
    if decision and decision.is_keep:
        shaded = {"min": decision.dispatch_min, "max": decision.dispatch_max,
                  "summary": f"kept for {decision.dispatch_text}"}
    evidence = thesis.evidence.summary if thesis.evidence else None
    # Kernels are kept per hardware class: the machine to compare with is that class's;
    # a head-to-head was timed against the other win, not the kept kernel.
    against = sweep.challenged if sweep.strategy == Sweep.Strategy.HEAD_TO_HEAD else None
    kept = against or selectors.latest_kept(thesis.op, sweep.hardware, other_than=candidate)
    baseline = f"candidate {against.label}" if against else None
    machines = provenance.machine_rows((candidate.result or {}).get("machine"),
                                       (kept.result or {}).get("machine") if kept else None)
    guards = selectors.candidate_guards(candidate)
    diffs = selectors.candidate_diffs(candidate)
    return {
        **context,
        "provenance": provenance.describe(candidate),
        "kept_candidate": kept,
        "machine_rows": machines,
        "machine_differs": [row.label for row in machines if row.differs],
        "sweep": sweep,
        "thesis": thesis,
        "diffs": diffs,
        # A long change is folded: the summary, curves and guards stay within reach.
        "diff_open": sum(len(f.lines) for f in diffs.against_kept or []) <= DIFF_OPEN_LINES,
        "rows": rows,
        "timed_against": against,
        "latency_figure": charts.latency_figure(rows, axis, baseline or "kept") if rows else None,
        "speedup_figure": (charts.speedup_figure(rows, axis, shaded, baseline or "the kept kernel")
                           if rows else None),
        "guards": guards,
        "warnings": selectors.candidate_warnings(guards),
        "e2e": selectors.end_to_end(candidate.result),
        "any_roofline": any(r.roofline_fraction is not None for r in rows),
        "idea_html": render_markdown(thesis.idea),
        "evidence": evidence,
        "history": selectors.op_kept_history(thesis.op)[:20],
        "compare_choices": comparison.choices(candidate),
        "earlier_reviews": [r for r in selectors.candidate_reviews(candidate) if r.revision != candidate.revision],
    }


@login_required
@require_GET
def thesis_path(request: HttpRequest, thesis_id: int) -> HttpResponse:
    """The thesis page's keep/revert path: a fragment the page asks for as it loads, so
    research's page shows what reviews decided without research importing reviews."""
    thesis = research_selectors.thesis_get(thesis_id)
    return render(request, "reviews/thesis_path.html", {
        "thesis": thesis,
        "path_figure": charts.path_figure(selectors.path_points(thesis_id=thesis.pk)),
    })


@login_required
@require_GET
def op_detail(request: HttpRequest, op: str) -> HttpResponse:
    if op not in ops.list_ops():
        raise Http404(f"no op {op!r}")
    try:
        per_class = workspace.dispatch_table().get(op, {})
        # Each hardware class keeps its own kernels, in the order the classes are listed.
        dispatch = [(HARDWARE[key].label, per_class[key]) for key in HARDWARE if key in per_class]
    except workspace.WorkspaceError:
        dispatch = None  # not created yet: the first sweep or start creates it
    return render(request, "reviews/op.html", {
        "op": ops.get_op(op),
        "path_figure": charts.path_figure(selectors.path_points(op=op)),
        "history": selectors.op_kept_history(op),
        "dispatch": dispatch,
        "waiting": selectors.review_queue(op=op).count(),
    })


@login_required
@require_GET
def path_team(request: HttpRequest) -> HttpResponse:
    return render(request, "reviews/path.html", {
        "path_figure": charts.path_figure(selectors.path_points()),
        "ops": ops.list_ops(),
        "waterfalls": compounding.waterfalls(),
    })


@login_required
@require_GET
def path_compound(request: HttpRequest) -> HttpResponse:
    """The waterfalls alone: the path page asks again while a run waits."""
    return render(request, "reviews/path.html#compound", {"waterfalls": compounding.waterfalls()})


@login_required
@require_GET
def leaderboard(request: HttpRequest) -> HttpResponse:
    form = LeaderboardForm(request.GET or {"period": "30"})
    template = "reviews/leaderboard.html#standings" if request.htmx else "reviews/leaderboard.html"
    return render(request, template, {"form": form, **selectors.leaderboard(days=form.days())})
