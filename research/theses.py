"""Filing a thesis and its evidence, editing and archiving it.

Every service takes keyword-only arguments, validates before it writes, runs in one
transaction and enqueues follow-up work only once that transaction has committed, so
bad input never leaves anything half-stored (the same holds in research.sweeps and
research.candidates).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from research.evidence import EvidenceError, parse_evidence
from research.hardware import HARDWARE, KERNEL_DSLS, MODEL_CONTEXTS
from research.hidden_characters import character_name, hidden_characters
from research.models import Evidence, Sweep, Thesis
from runners import ops
from webhooks import payloads as webhook_payloads
from webhooks.services import webhook_event

MAX_ALLOWED_PATHS = 50


@dataclass(frozen=True)
class Upload:
    """An uploaded file, already read: services never see request objects."""

    name: str
    data: bytes


def op_or_error(op_name: str) -> ops.Op:
    """The op named, or a ValidationError on the `op` field."""
    try:
        return ops.get_op(op_name)
    except ops.UnknownOpError as exc:
        raise ValidationError({"op": str(exc)}) from exc


_PATH_CHARACTERS = re.compile(r"[A-Za-z0-9._\-/*\[\]]+")


def _clean_allowed_paths(paths: list[str]) -> list[str]:
    if len(paths) > MAX_ALLOWED_PATHS:
        raise ValidationError({"allowed_paths": f"at most {MAX_ALLOWED_PATHS} paths"})
    cleaned = []
    for path in paths:
        normal = posixpath.normpath(path)
        if path.startswith("/") or normal.startswith("..") or "\x00" in path or "\\" in path:
            raise ValidationError(
                {"allowed_paths": f"{path!r} must be a relative path inside the workspace"}
            )
        # The paths go into an agent's instructions as code: nothing that could close the
        # quoting or start new text there.
        if not _PATH_CHARACTERS.fullmatch(path):
            raise ValidationError({"allowed_paths": f"{path!r}: a path may hold letters, digits and "
                                                    "._-/*[] only"})
        cleaned.append(normal)
    return cleaned


def _parsed_evidence(upload: Upload) -> dict:
    """Parsed before anything is stored: unreadable evidence never reaches the database."""
    try:
        return parse_evidence(upload.data, upload.name, max_bytes=settings.EVIDENCE_MAX_BYTES)
    except EvidenceError as exc:
        raise ValidationError({"evidence": str(exc)}) from exc


def _stored_evidence(*, uploaded_by, upload: Upload, summary: dict) -> Evidence:
    return Evidence.objects.create(
        uploaded_by=uploaded_by,
        filename=posixpath.basename(upload.name.replace("\\", "/"))[:255] or "evidence",
        sha256=hashlib.sha256(upload.data).hexdigest(),
        size_bytes=len(upload.data),
        format=summary["format"],
        summary=summary,
    )


def refuse_hidden_characters(field: str, text: str) -> None:
    """A one-line text shown across the app (a title, a name) holds no character that
    renders as nothing or reorders what follows (a U+202E in a title reversed the page
    text after its link in every breadcrumb), nor a line break or tab."""
    also = dict.fromkeys(re.findall("[\t\n]", text))
    hidden = hidden_characters(text) + [character_name(c) for c in also]
    if hidden:
        raise ValidationError({field: f"holds characters that render as nothing or reorder the text "
                                      f"around them: {', '.join(hidden)}"})


def _thesis_text_problems(title: str, idea: str) -> dict[str, list[str]]:
    """What is wrong with a thesis's title and idea, by field (empty when nothing is)."""
    problems: dict[str, list[str]] = {}
    if not title.strip():
        problems["title"] = ["a thesis needs a title"]
    try:
        refuse_hidden_characters("title", title)
    except ValidationError as error:
        problems.setdefault("title", []).extend(error.message_dict["title"])
    if not idea.strip():
        problems["idea"] = ["say what the idea is"]
    return problems


def thesis_submit(
    *,
    author,
    title: str,
    idea: str,
    op: str,
    hardware: str,
    model_context: str = "none",
    required_dsl: str,
    allowed_paths: list[str] | None = None,
    forbidden_changes: str = "",
    context_lengths: list[int] | None = None,
    batch_sizes: list[int] | None = None,
    evidence: Upload | None = None,
) -> Thesis:
    # Every problem at once: a form that named one per submit took as many submits.
    problems: dict[str, list[str]] = {}

    def checked(check: Callable[[], Any]) -> Any:
        try:
            return check()
        except ValidationError as error:
            for field, messages in error.message_dict.items():
                problems.setdefault(field, []).extend(messages)
            return None

    def refuse(field: str, message: str) -> None:
        problems.setdefault(field, []).append(message)

    title = title.strip()
    for field, messages in _thesis_text_problems(title, idea).items():
        problems.setdefault(field, []).extend(messages)
    if hardware not in HARDWARE:
        refuse("hardware", f"unknown hardware {hardware!r}")
    if required_dsl not in dict(KERNEL_DSLS):
        refuse("required_dsl", f"unknown kernel DSL {required_dsl!r}")
    if model_context not in dict(MODEL_CONTEXTS):
        refuse("model_context", f"unknown model context {model_context!r}")
    target = checked(lambda: op_or_error(op))
    if target is not None and hardware in HARDWARE:
        device = HARDWARE[hardware].device
        context_lengths = context_lengths or target.default_context_lengths(device)
        batch_sizes = batch_sizes or target.default_batch_sizes(device)
        try:
            target.workloads(device, context_lengths, batch_sizes)
        except ops.WorkloadError as exc:
            refuse("context_lengths", str(exc))
    paths = checked(lambda: _clean_allowed_paths(allowed_paths or []))
    summary = checked(lambda: _parsed_evidence(evidence)) if evidence else None
    if problems:
        raise ValidationError(problems)

    with transaction.atomic():
        stored_evidence = (
            _stored_evidence(uploaded_by=author, upload=evidence, summary=summary) if evidence else None
        )
        thesis = Thesis.objects.create(
            author=author,
            title=title,
            idea=idea,
            op=target.name,
            hardware=hardware,
            model_context=model_context,
            evidence=stored_evidence,
            required_dsl=required_dsl,
            allowed_paths=paths,
            forbidden_changes=forbidden_changes.strip(),
            context_lengths=list(context_lengths),
            batch_sizes=list(batch_sizes),
        )
        webhook_event(type="thesis.created", payload=webhook_payloads.thesis_created(thesis))
    return thesis


def thesis_edit_check(*, thesis: Thesis, edited_by) -> None:
    """Raises unless `edited_by` may edit the thesis now: its author, before its first
    sweep (from then on it is what its candidates were produced and judged under)."""
    if edited_by.pk != thesis.author_id:
        raise PermissionDenied("only the thesis's author may edit it")
    if thesis.sweeps.exists():
        raise ValidationError("a sweep has started from this thesis: it is what its candidates were "
                              "judged under, so it stays as it is (file a new thesis instead)", code="started")


def thesis_edit(*, thesis: Thesis, edited_by, title: str, idea: str, forbidden_changes: str = "") -> Thesis:
    """Its author rewrites the title, idea and forbidden changes (thesis_edit_check)."""
    thesis_edit_check(thesis=thesis, edited_by=edited_by)
    title, idea = title.strip(), idea.strip()
    problems = _thesis_text_problems(title, idea)
    if problems:
        raise ValidationError(problems)
    thesis.title, thesis.idea, thesis.forbidden_changes = title, idea, forbidden_changes.strip()
    thesis.save(update_fields=["title", "idea", "forbidden_changes"])
    return thesis


def thesis_archive(*, thesis: Thesis, by, archived: bool = True) -> Thesis:
    """Off the dashboard and closed to new sweeps (or back again); by its author or staff.
    Nothing of its sweeps, candidates or decisions changes."""
    if by.pk != thesis.author_id and not by.is_staff:
        raise PermissionDenied("only the thesis's author or staff may archive it")
    unfinished = [Sweep.Status.QUEUED, Sweep.Status.RUNNING, Sweep.Status.PAUSED]
    if archived and thesis.sweeps.filter(status__in=unfinished).exists():
        raise ValidationError("a sweep of this thesis has not finished: cancel it or let it end first",
                              code="running")
    thesis.archived_at, thesis.archived_by = (timezone.now(), by) if archived else (None, None)
    thesis.save(update_fields=["archived_at", "archived_by"])
    return thesis
