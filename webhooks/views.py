"""Thin views: each serves the full page, and its fragment to htmx."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import HttpResponseClientRedirect, trigger_client_event

from webhooks import selectors, services
from webhooks.forms import EndpointForm

LOG_CHANGED = "webhook-log-changed"


def _redirect(request: HttpRequest, url: str) -> HttpResponse:
    return HttpResponseClientRedirect(url) if request.htmx else redirect(url)


def _new_secret_key(endpoint_id: int) -> str:
    return f"webhooks.new-secret.{endpoint_id}"


def _log_context(endpoint) -> dict:
    deliveries = selectors.delivery_log(endpoint)
    # The log refreshes itself only while something is still on its way.
    return {"endpoint": endpoint, "deliveries": deliveries, "log_changed": LOG_CHANGED,
            "log_is_live": any(d.is_active for d in deliveries)}


@login_required
@require_GET
def endpoint_list(request: HttpRequest) -> HttpResponse:
    return render(request, "webhooks/list.html", {
        "endpoints": selectors.endpoint_list_for_owner(request.user),
    })


@login_required
@require_http_methods(["GET", "POST"])
def endpoint_new(request: HttpRequest) -> HttpResponse:
    form = EndpointForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            endpoint = services.endpoint_create(owner=request.user, **form.cleaned_data)
        except ValidationError as error:
            for field, errors in error.message_dict.items():
                form.add_error(field if field in form.fields else None, errors)
        else:
            # Handed to the next page through the session, which pops it: the secret
            # is shown once and never travels in a URL.
            request.session[_new_secret_key(endpoint.pk)] = endpoint.secret
            return redirect(endpoint.get_absolute_url())
    # A plain form: htmx would add nothing to a page that is left on success.
    return render(request, "webhooks/form.html", {"form": form}, status=422 if form.errors else 200)


@login_required
@require_GET
def endpoint_detail(request: HttpRequest, endpoint_id: int) -> HttpResponse:
    endpoint = selectors.endpoint_get_for_owner(request.user, endpoint_id)
    return render(request, "webhooks/detail.html", {
        **_log_context(endpoint),
        "new_secret": request.session.pop(_new_secret_key(endpoint.pk), None),
    })


@login_required
@require_GET
def endpoint_deliveries(request: HttpRequest, endpoint_id: int) -> HttpResponse:
    """The delivery log alone: htmx refreshes it while deliveries are under way."""
    endpoint = selectors.endpoint_get_for_owner(request.user, endpoint_id)
    if not request.htmx:
        return redirect(endpoint.get_absolute_url())
    return render(request, "webhooks/detail.html#delivery-log", _log_context(endpoint))


@login_required
@require_POST
def endpoint_toggle(request: HttpRequest, endpoint_id: int) -> HttpResponse:
    endpoint = selectors.endpoint_get_for_owner(request.user, endpoint_id)
    # The wanted state, not "flip": a double click cannot undo itself.
    endpoint = services.endpoint_set_enabled(endpoint=endpoint, enabled=request.POST.get("enabled") == "1")
    if request.htmx:
        response = render(request, "webhooks/detail.html#endpoint-state", {"endpoint": endpoint})
        # Disabling settles what was owed: the delivery log on the page reloads itself.
        return trigger_client_event(response, LOG_CHANGED)
    messages.info(request, f"Webhook {'enabled' if endpoint.enabled else 'disabled'}.")
    return redirect(endpoint.get_absolute_url())


@login_required
@require_POST
def endpoint_delete(request: HttpRequest, endpoint_id: int) -> HttpResponse:
    endpoint = selectors.endpoint_get_for_owner(request.user, endpoint_id)
    services.endpoint_delete(endpoint=endpoint)
    messages.info(request, f"Deleted the webhook to {endpoint.url}.")
    return _redirect(request, reverse("webhook_list"))


@login_required
@require_POST
def delivery_redeliver(request: HttpRequest, delivery_id: int) -> HttpResponse:
    delivery = selectors.delivery_get_for_owner(request.user, delivery_id)
    error = None
    try:
        delivery = services.delivery_redeliver(delivery=delivery)
    except ValidationError as exc:
        error = " ".join(exc.messages)
    if request.htmx:
        # The whole log, so that it starts refreshing itself while the attempt runs.
        return render(request, "webhooks/detail.html#delivery-log", {
            **_log_context(delivery.endpoint), "redeliver_error": error,
        })
    if error:
        messages.error(request, error)
    else:
        messages.info(request, f"Redelivering {delivery.webhook_id}.")
    return redirect(delivery.endpoint.get_absolute_url())
