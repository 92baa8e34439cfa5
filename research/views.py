"""Thin views: one view serves the full page and, for htmx, its fragment."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import BadRequest, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import HttpResponseClientRedirect

from config.ratelimit import rate_limited
from research import (agent_context, api_tokens, charts, exports, result_rows, selectors, sweep_control, sweeps,
                      theses, workers)
from research.forms import ApiTokenForm, SweepForm, ThesisEditForm, ThesisForm
from research.markdown import render_markdown
from research.models import ApiToken, Candidate, Sweep


def _redirect(request: HttpRequest, url: str) -> HttpResponse:
    return HttpResponseClientRedirect(url) if request.htmx else redirect(url)


def _add_errors(form, error: ValidationError) -> None:
    if not hasattr(error, "error_dict"):  # about the whole request, not one field
        form.add_error(None, error.messages)
        return
    for field, field_messages in error.message_dict.items():
        form.add_error(field if field in form.fields else None, field_messages)


@login_required
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    archived = request.GET.get("archived") == "1"
    return render(request, "research/dashboard.html", {
        "archived": archived,
        "theses": selectors.thesis_list_for_dashboard(archived=archived)[:50],
        "sweeps": selectors.sweep_list_recent(),
    })


@login_required
@require_http_methods(["GET", "POST"])
@rate_limited("thesis-submit")
def thesis_new(request: HttpRequest) -> HttpResponse:
    form = ThesisForm(request.POST or None, request.FILES or None, user_id=request.user.pk)
    if request.method == "POST" and form.is_valid():
        try:
            thesis = theses.thesis_submit(author=request.user, **form.cleaned_data)
        except ValidationError as error:
            _add_errors(form, error)
        else:
            form.release_evidence()
            return _redirect(request, thesis.get_absolute_url())
    if form.errors:
        form.hold_evidence()
    template = "research/thesis_form.html#form" if request.htmx else "research/thesis_form.html"
    status = 422 if form.errors else 200
    return render(request, template, {"form": form}, status=status)


@login_required
@require_GET
def thesis_detail(request: HttpRequest, thesis_id: int) -> HttpResponse:
    thesis = selectors.thesis_get(thesis_id)
    return render(request, "research/thesis_detail.html", _thesis_context(thesis, SweepForm(
        kernels=selectors.thesis_kernels(thesis), initial={"hardware": thesis.hardware}
    )))


@login_required
@require_http_methods(["GET", "POST"])
def thesis_edit(request: HttpRequest, thesis_id: int) -> HttpResponse:
    thesis = selectors.thesis_get(thesis_id)
    if request.method == "GET":
        # A form that can only be refused on save is not offered (the link is hidden too).
        try:
            theses.thesis_edit_check(thesis=thesis, edited_by=request.user)
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
            return redirect(thesis.get_absolute_url())
    form = ThesisEditForm(request.POST or None, initial={
        "title": thesis.title, "idea": thesis.idea, "forbidden_changes": thesis.forbidden_changes})
    if request.method == "POST" and form.is_valid():
        try:
            theses.thesis_edit(thesis=thesis, edited_by=request.user, **form.cleaned_data)
        except ValidationError as error:
            _add_errors(form, error)
        else:
            return redirect(thesis.get_absolute_url())
    return render(request, "research/thesis_edit.html", {"thesis": thesis, "form": form},
                  status=422 if form.errors else 200)


@login_required
@require_POST
def thesis_archive(request: HttpRequest, thesis_id: int, archived: bool) -> HttpResponse:
    thesis = selectors.thesis_get(thesis_id)
    try:
        theses.thesis_archive(thesis=thesis, by=request.user, archived=archived)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, "Archived: off the dashboard and closed to new sweeps." if archived
                         else "Restored to the dashboard.")
    return redirect(thesis.get_absolute_url())


def _thesis_context(thesis, sweep_form: SweepForm) -> dict:
    summary = thesis.evidence.summary if thesis.evidence else None
    return {
        "thesis": thesis,
        "idea_html": render_markdown(thesis.idea),
        "evidence": summary,
        "evidence_figure": charts.evidence_kernel_time_figure(summary) if summary else None,
        "sweeps": thesis.sweeps.all(),
        "sweep_form": sweep_form,
        "packs": [*agent_context.packs_for(hardware=thesis.hardware, model_context=thesis.model_context),
                  "reward-hacks.md"],
    }


@login_required
@require_GET
def skill_pack(request: HttpRequest, pack: str) -> HttpResponse:
    """A context pack of skills/, as the agents of a thesis that selects it read it."""
    text = agent_context.pack_text(pack)
    if text is None:
        raise Http404(f"no pack {pack!r}")
    return render(request, "research/skill_pack.html", {"pack": pack, "html": render_markdown(text)})


@login_required
@require_POST
@rate_limited("sweep-start")
def sweep_start(request: HttpRequest, thesis_id: int) -> HttpResponse:
    thesis = selectors.thesis_get(thesis_id)
    form = SweepForm(request.POST, kernels=selectors.thesis_kernels(thesis))
    if form.is_valid():
        try:
            sweep = sweeps.sweep_start(thesis=thesis, started_by=request.user, **form.cleaned_data)
        except ValidationError as error:
            _add_errors(form, error)
        else:
            return _redirect(request, sweep.get_absolute_url())
    if request.htmx:
        return render(request, "research/thesis_detail.html#sweep-form", {"thesis": thesis, "sweep_form": form}, status=422)
    return render(request, "research/thesis_detail.html", _thesis_context(thesis, form), status=422)


@login_required
@require_GET
def sweep_detail(request: HttpRequest, sweep_id: int) -> HttpResponse:
    sweep = selectors.sweep_get(sweep_id)
    # Read the seq first: anything recorded after it is replayed over the websocket,
    # and the page's script drops what the render below already shows.
    last_seq = sweep.last_seq
    results = selectors.sweep_results(sweep)
    workloads = selectors.sweep_workload_names(sweep)
    return render(request, "research/sweep_detail.html", {
        "sweep": sweep,
        "unserved": _unserved_queue(sweep),
        "last_seq": last_seq,
        "actions": sweep_control.sweep_actions(sweep=sweep, user=request.user),
        "results": results,
        "result_html": result_rows.rendered(results),
        "counts": selectors.sweep_counts(sweep),
        "workloads": workloads,
        "more_results": len(results) == selectors.RESULT_PAGE_SIZE,
        "refused": selectors.sweep_refused(sweep),
        # Rendered like a thesis's idea: the packs and the thesis are Markdown, and
        # nothing in them may carry script.
        "context_html": render_markdown(sweep.context) if sweep.context else "",
    })


def _unserved_queue(sweep: Sweep) -> str | None:
    """The command that would serve the sweep's queue, when candidates wait on it and no
    live worker consumes it; None otherwise (or when the workers cannot be asked)."""
    waiting = sweep.candidates.filter(status=Candidate.Status.QUEUED).exists()
    running = sweep.candidates.filter(status=Candidate.Status.RUNNING).exists()
    if sweep.status not in (Sweep.Status.QUEUED, Sweep.Status.RUNNING) or not waiting or running:
        return None
    queues = workers.live_queues()
    if queues is None or sweep.queue in queues:
        return None
    return workers.start_command(sweep.queue)


_SWEEP_CONTROLS = {
    "pause": sweep_control.sweep_pause,
    "resume": sweep_control.sweep_resume,
    "cancel": sweep_control.sweep_cancel,
}


@login_required
@require_POST
def sweep_control_action(request: HttpRequest, sweep_id: int, action: str) -> HttpResponse:
    """Pause, resume or cancel: the controls fragment for htmx, the sweep page otherwise.

    Every open page of the sweep learns of the change from the event the service appends.
    """
    sweep = selectors.sweep_get(sweep_id)
    error = ""
    try:
        sweep = _SWEEP_CONTROLS[action](sweep=sweep, by=request.user)
    except ValidationError as refusal:
        error = " ".join(refusal.messages)
        sweep.refresh_from_db()
    if not request.htmx:
        if error:
            messages.error(request, error)
        return redirect(sweep)
    # The controls alone, into the controls the request was sent from. The new status
    # reaches every open page, this one too, with the event the service appended. The
    # answer names nothing else to look up: that event can reach this page first and
    # replace the controls, and htmx resolves any further target (an HX-Retarget, an
    # out-of-band status) from the form the request came from, which is then detached:
    # "Invalid re-target", or no target for the status.
    return render(request, "research/sweep_detail.html#controls", {
        "sweep_id": sweep.pk, "error": error,
        "actions": sweep_control.sweep_actions(sweep=sweep, user=request.user),
    }, status=422 if error else 200)


@login_required
@require_GET
def sweep_results(request: HttpRequest, sweep_id: int) -> HttpResponse:
    """Result rows after a candidate number, as table rows (htmx) or the full page."""
    sweep = selectors.sweep_get(sweep_id)
    after = _int_param(request, "after")
    results = selectors.sweep_results(sweep, after_number=after)
    return render(request, "research/sweep_detail.html#result-rows", {
        "sweep": sweep,
        "results": results,
        "result_html": result_rows.rendered(results),
        "more_results": len(results) == selectors.RESULT_PAGE_SIZE,
    })


@login_required
@require_GET
def sweep_events(request: HttpRequest, sweep_id: int) -> JsonResponse:
    """The stored events after `after` (CONTRACTS §6), for scripts and polling clients."""
    sweep = selectors.sweep_get(sweep_id)
    events = selectors.sweep_events_after(sweep.pk, _int_param(request, "after"))
    return JsonResponse({"sweep": sweep.pk, "last_seq": sweep.last_seq, "events": events})


@login_required
@require_GET
def sweep_chart(request: HttpRequest, sweep_id: int) -> JsonResponse:
    sweep = selectors.sweep_get(sweep_id)
    workloads = selectors.sweep_workload_names(sweep)
    return JsonResponse(charts.sweep_speedup_figure(workloads, selectors.sweep_speedup_points(sweep), sweep.budget))


@login_required
@require_GET
def candidate_export(request: HttpRequest, candidate_id: int) -> HttpResponse:
    """The candidate as a zip to run again elsewhere (research.exports)."""
    candidate = selectors.candidate_get(candidate_id)
    response = HttpResponse(exports.candidate_bundle(candidate), content_type="application/zip")
    response["Content-Disposition"] = f'attachment; filename="{exports.bundle_name(candidate)}"'
    return response


def _int_param(request: HttpRequest, name: str) -> int:
    value = request.GET.get(name, "0")
    if not value.isdigit() or len(value) > 18:
        raise BadRequest(f"{name} must be a whole number, not {value[:20]!r}")
    return int(value)


@login_required
@never_cache  # the page that shows a new token once must not be kept by the browser
@require_http_methods(["GET", "POST"])
@rate_limited("api-token-create")
def api_token_list(request: HttpRequest) -> HttpResponse:
    """The signed-in user's API tokens, and a form for a new one, shown once: in the
    answer to the POST that made it, never stored (not even in the session) nor cached."""
    form = ApiTokenForm(request.POST or None)
    new_token = None
    if request.method == "POST" and form.is_valid():
        try:
            _, new_token = api_tokens.api_token_create_on_page(user=request.user, **form.cleaned_data)
        except ValidationError as error:
            _add_errors(form, error)
        else:
            form = ApiTokenForm()
    return render(request, "research/api_tokens.html", {
        "form": form,
        "tokens": api_tokens.api_tokens_of(request.user),
        "may_create_host_token": api_tokens.may_create_host_token(request.user),
        "new_token": new_token,
    }, status=422 if form.errors else 200)


@login_required
@require_POST
def api_token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    token = ApiToken.objects.filter(pk=token_id, user=request.user).first()
    if token is None:
        raise Http404("no such token of yours")
    api_tokens.api_token_revoke(token=token, revoked_by=request.user)
    messages.success(request, f"Token {token} revoked: it no longer opens the API.")
    return redirect("api_token_list")
