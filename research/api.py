"""The JSON API (django-ninja), for remote GPU hosts and scripts: /api/, schema at
/api/openapi.json, docs at /api/docs.

Bearer tokens (research.api_tokens). Like the views, the endpoints only translate:
filing a thesis goes through the browser form and theses.thesis_submit, a results
file through research.importing.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from ninja import File, Form, NinjaAPI, Schema, Status, UploadedFile
from ninja.errors import HttpError
from ninja.errors import ValidationError as RequestInvalid
from ninja.security import HttpBearer
from pydantic import Field

from config.ratelimit import RateLimited, rate_limit_hit
from research import theses
import workspace
from research.api_tokens import api_token_authenticate
from research.hardware import HARDWARE, KERNEL_DSLS, MODEL_CONTEXTS
from research.forms import ThesisForm
from research.importing import AlreadyImported, results_import
from research.models import Sweep, Thesis
from runners import ops


class TokenAuth(HttpBearer):
    """A person's token. A GPU host's token (ApiToken.host) is refused: it may only import."""

    accepts_host_tokens = False

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        row = api_token_authenticate(token)
        if row is None:
            return None
        if row.host and not self.accepts_host_tokens:
            raise HttpError(403, f"{row} is the token of GPU host {row.host!r}: it can only import results")
        request.user = row.user
        request.api_token = row
        if request.method == "POST":
            # Every write counts, malformed ones too, before its body is even parsed.
            rate_limit_hit(user=row.user, action="api-post")
        return row.user


api = NinjaAPI(
    title="Kernel Lab API",
    version="1",
    description=(
        "File theses and import results measured on GPU hosts that reach neither Redis nor the "
        "database. Authenticate with `Authorization: Bearer <token>` (`manage.py create_api_token "
        "USERNAME NAME`)."
    ),
    urls_namespace="api",
    auth=TokenAuth(),
)


class ImportAuth(TokenAuth):
    """The import's: a person's token, or a GPU host's."""

    accepts_host_tokens = True


IMPORT_PERMISSION = "research.import_results"


@api.exception_handler(RateLimited)
def _rate_limited(request: HttpRequest, refusal: RateLimited) -> HttpResponse:
    response = api.create_response(request, {"detail": str(refusal)}, status=429)
    response["Retry-After"] = str(refusal.retry_after_s)
    return response


class Error(Schema):
    detail: str
    errors: dict[str, list[str]] = Field(default_factory=dict, description="messages per field")


class Duplicate(Error):
    sweep: int = Field(description="the sweep the file was imported as")


# Every endpoint answers these, so the schema says so: a missing, unknown or revoked
# token (401), a request that does not fit the schema (422), an id that names nothing (404).
UNAUTHORIZED = {401: Error, 403: Error, 422: Error}
NOT_FOUND = {404: Error}


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, error: ValidationError) -> HttpResponse:
    errors = error.message_dict if hasattr(error, "error_dict") else {"__all__": error.messages}
    detail = "; ".join(sum(errors.values(), []))
    if isinstance(error, AlreadyImported):
        return api.create_response(request, {"detail": detail, "errors": errors, "sweep": error.sweep_id},
                                   status=409)
    return api.create_response(request, {"detail": detail, "errors": errors}, status=422)


@api.exception_handler(RequestInvalid)
def _request_invalid(request: HttpRequest, error: RequestInvalid) -> HttpResponse:
    """Ninja's own checks of a request (a missing field, an id that is not a number), in the
    same shape as every other refusal: a message, and messages per field."""
    errors: dict[str, list[str]] = {}
    for problem in error.errors:
        field = str(problem.get("loc", ["__all__"])[-1])
        errors.setdefault(field, []).append(str(problem.get("msg", "invalid")))
    detail = "; ".join(f"{field}: {message}" for field, messages in errors.items() for message in messages)
    return api.create_response(request, {"detail": detail, "errors": errors}, status=422)


class ThesisIn(Schema):
    """The browser form's fields, as it sends them."""

    # The values the form accepts, documented (the form still checks them, with its
    # messages): clients and the schema fuzzer see what a valid thesis looks like.
    title: str = Field(json_schema_extra={"minLength": 1, "maxLength": ThesisForm.base_fields["title"].max_length})
    idea: str = Field(description="Markdown",
                      json_schema_extra={"minLength": 1, "maxLength": ThesisForm.base_fields["idea"].max_length})
    op: str = Field(description="`python -m runners.harness ops` lists them",
                    json_schema_extra={"enum": ops.list_ops()})
    hardware: str = Field(json_schema_extra={"enum": list(HARDWARE)})
    model_context: str = Field("none", json_schema_extra={"enum": [key for key, _ in MODEL_CONTEXTS]})
    required_dsl: str = Field(json_schema_extra={"enum": [key for key, _ in KERNEL_DSLS]})
    allowed_paths: str = Field("", description="paths an agent may change, one per line")
    forbidden_changes: str = ""
    context_lengths: str = Field("", description="e.g. \"4096, 32768\"; blank for the op's defaults")
    batch_sizes: str = Field("", description="e.g. \"1, 4\"; blank for the op's defaults")


class EvidenceOut(Schema):
    filename: str
    sha256: str
    format: str
    summary: dict[str, Any]


class KeptKernelOut(Schema):
    name: str = Field(description="its file name's stem: pass it as <name>.py to --baseline")
    commit: str
    source: str


class SweepSummary(Schema):
    id: int
    url: str
    kernel: str
    strategy: str
    status: str
    done: int
    total: int


class ThesisOut(Schema):
    id: int
    url: str
    author: str
    title: str
    idea: str
    op: str
    hardware: str
    model_context: str
    required_dsl: str
    allowed_paths: list[str]
    forbidden_changes: str
    context_lengths: list[int]
    batch_sizes: list[int]
    created_at: datetime
    evidence: EvidenceOut | None
    kept_kernel: KeptKernelOut = Field(description="the op's kept kernel now: time candidates against it")
    sweeps: list[SweepSummary]


class CandidateOut(Schema):
    number: int
    params: dict[str, Any]
    status: str
    verdict: str
    correct: bool | None
    geomean_speedup: float | None
    best_speedup: float | None
    error: str
    refusal: str = Field(description="why it was refused before evaluation (status refused)")
    proposed_by: str
    attempts: int
    commit: str
    branch: str
    url: str


class SweepOut(SweepSummary):
    thesis: int
    hardware: str
    seed: int
    budget: int
    stop_reason: str
    context: str
    base_commit: str
    baseline_kernel: str
    last_seq: int
    events_url: str
    created_at: datetime
    finished_at: datetime | None
    candidates: list[CandidateOut]


def _url(path: str) -> str:
    return settings.SITE_URL.rstrip("/") + path


def _sweep_summary(sweep: Sweep) -> dict[str, Any]:
    return {"id": sweep.pk, "url": _url(sweep.get_absolute_url()), "kernel": sweep.kernel,
            "strategy": sweep.strategy, "status": sweep.status, "done": sweep.done, "total": sweep.total}


def _thesis_out(thesis: Thesis) -> dict[str, Any]:
    # The kernel its hardware class keeps: what a GPU host of that class times against.
    kept = workspace.kept_kernel(thesis.op, thesis.hardware)
    evidence = thesis.evidence
    return {
        "id": thesis.pk, "url": _url(thesis.get_absolute_url()), "author": thesis.author.get_username(),
        **{name: getattr(thesis, name) for name in (
            "title", "idea", "op", "hardware", "model_context", "required_dsl", "allowed_paths",
            "forbidden_changes", "context_lengths", "batch_sizes", "created_at")},
        "evidence": evidence and {"filename": evidence.filename, "sha256": evidence.sha256,
                                  "format": evidence.format, "summary": evidence.summary},
        "kept_kernel": {"name": kept.name, "commit": kept.commit, "source": kept.source},
        "sweeps": [_sweep_summary(sweep) for sweep in thesis.sweeps.all()],
    }


def _sweep_out(sweep: Sweep) -> dict[str, Any]:
    return {
        **_sweep_summary(sweep),
        **{name: getattr(sweep, name) for name in (
            "hardware", "seed", "budget", "stop_reason", "context", "base_commit", "baseline_kernel", "last_seq",
            "created_at", "finished_at")},
        "thesis": sweep.thesis_id,
        "events_url": _url(reverse("sweep_events", args=[sweep.pk])),
        "candidates": [{
            **{name: getattr(c, name) for name in (
                "number", "params", "status", "verdict", "correct", "geomean_speedup", "best_speedup",
                "error", "refusal", "proposed_by", "attempts", "commit", "branch")},
            "url": _url(c.get_absolute_url()),
        } for c in sweep.candidates.all()],
    }


@api.post("/theses", response={201: ThesisOut, 422: Error, 429: Error, **UNAUTHORIZED}, summary="File a thesis")
def thesis_create(request: HttpRequest, data: Form[ThesisIn],
                  evidence: File[UploadedFile | None] = None) -> Status:
    """The browser form's fields as multipart/form-data, with the profile as the optional file
    `evidence` (PyTorch profiler trace, Nsight Compute or Nsight Systems CSV)."""
    # The validated fields, so the schema's defaults apply; then the browser form's own
    # parsing and checks (lists, paths, the evidence's size).
    form = ThesisForm(data.dict(), request.FILES)
    if not form.is_valid():
        errors = {field: [str(m) for m in messages] for field, messages in form.errors.items()}
        raise ValidationError(errors)
    thesis = theses.thesis_submit(author=request.user, **form.cleaned_data)
    return Status(201, _thesis_out(thesis))


@api.get("/theses/{thesis_id}", response={200: ThesisOut, **UNAUTHORIZED, **NOT_FOUND}, summary="A thesis, its kept kernel and sweeps")
def thesis_get(request: HttpRequest, thesis_id: int) -> dict[str, Any]:
    return _thesis_out(get_object_or_404(Thesis.objects.select_related("author", "evidence"), pk=thesis_id))


@api.post(
    "/theses/{thesis_id}/results",
    response={201: SweepOut, 409: Duplicate, 413: Error, 422: Error, 429: Error, **UNAUTHORIZED, **NOT_FOUND},
    summary="Import a results file",
    openapi_extra={"requestBody": {"required": True, "content": {"application/x-ndjson": {"schema": {
        "type": "string",
        "description": "the file `python -m runners.harness sweep ... --out FILE` wrote, as is",
    }}}}},
    auth=ImportAuth(),
)
def results_create(request: HttpRequest, thesis_id: int,
                   hardware: str | None = None) -> Status:
    """The request body is the results file. It becomes a finished sweep of the thesis, started
    by the token's user; the same file twice is refused (409, naming the sweep). It needs a GPU
    host's token (`manage.py create_api_token USERNAME NAME --host HOST`), whose host is named on
    every result, or a user with the permission to import (403 otherwise). Imported results
    are badged as such, and a win is kept only once a worker of the lab has verified it."""
    token = request.api_token
    if not token.host and not request.user.has_perm(IMPORT_PERMISSION):
        return Status(403, {"detail": (
            f"{request.user.get_username()} may not import results: that needs a GPU host's token "
            f"or the permission {IMPORT_PERMISSION}")})
    thesis = get_object_or_404(Thesis, pk=thesis_id)
    limit = settings.RESULTS_MAX_BYTES
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > limit:
        return Status(413, {"detail": f"the file is {length:,} bytes; at most {limit:,}"})
    # Read the stream, not request.body: that one stops at DATA_UPLOAD_MAX_MEMORY_SIZE.
    data = request.read(limit + 1)
    if len(data) > limit:
        return Status(413, {"detail": f"the file is over {limit:,} bytes"})
    sweep = results_import(thesis=thesis, imported_by=request.user, data=data, hardware=hardware, token=token)
    return Status(201, _sweep_out(sweep))


@api.get("/sweeps/{sweep_id}", response={200: SweepOut, **UNAUTHORIZED, **NOT_FOUND}, summary="A sweep and its candidates")
def sweep_get(request: HttpRequest, sweep_id: int) -> dict[str, Any]:
    return _sweep_out(get_object_or_404(Sweep, pk=sweep_id))
