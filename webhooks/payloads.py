"""The `data` of each webhook event: small, stable, with links back to the app.

Receivers build on these shapes, so fields are only ever added. The envelope around
them is {"type": ..., "timestamp": ..., "data": ...} (see services.webhook_event).
"""

from __future__ import annotations

from typing import TypedDict

from django.conf import settings


def site_url(path: str) -> str:
    return settings.SITE_URL.rstrip("/") + path


class ThesisData(TypedDict):
    id: int
    title: str
    op: str
    hardware: str
    required_dsl: str
    author: str
    url: str


class ThesisCreated(TypedDict):
    thesis: ThesisData


class SweepData(TypedDict):
    id: int
    thesis_id: int
    op: str
    kernel: str
    strategy: str
    hardware: str
    total: int
    done: int
    # Why it ended before its budget ("time budget of 600 s spent"); empty when it ran out.
    stop_reason: str
    url: str


class SweepFinished(TypedDict):
    sweep: SweepData
    wins: int
    rejected: int


class CandidateData(TypedDict):
    id: int
    number: int
    sweep_id: int
    op: str
    params: dict
    verdict: str
    geomean_speedup: float | None
    best_speedup: float | None
    url: str


class CandidateDecided(TypedDict, total=False):
    candidate: CandidateData
    reviewer: str
    comment: str
    details: dict


def thesis_created(thesis) -> ThesisCreated:
    return {"thesis": {
        "id": thesis.pk,
        "title": thesis.title,
        "op": thesis.op,
        "hardware": thesis.hardware,
        "required_dsl": thesis.required_dsl,
        "author": thesis.author.get_username(),
        "url": site_url(thesis.get_absolute_url()),
    }}


def sweep_finished(sweep, *, wins: int, rejected: int) -> SweepFinished:
    return {
        "sweep": {
            "id": sweep.pk,
            "thesis_id": sweep.thesis_id,
            "op": sweep.thesis.op,
            "kernel": sweep.kernel,
            "strategy": sweep.strategy,
            "hardware": sweep.hardware,
            "total": sweep.total,
            "done": sweep.done,
            "stop_reason": sweep.stop_reason,
            "url": site_url(sweep.get_absolute_url()),
        },
        "wins": wins,
        "rejected": rejected,
    }


def candidate_decided(candidate, *, reviewer, comment: str = "", url: str | None = None,
                      measured=None, **details) -> CandidateDecided:
    """For candidate.kept, candidate.reverted and candidate.undone.

    details: what the decision adds, e.g. merge_commit and dispatch_range for a keep,
    revert_commit and the undone keep for an undo.
    url: the review page, when there is one (defaults to the candidate's sweep).
    measured: whose figures to send (a verified import's worker run; default the candidate).
    """
    sweep = candidate.sweep
    measured = measured or candidate
    return {
        "candidate": {
            "id": candidate.pk,
            "number": candidate.number,
            "sweep_id": candidate.sweep_id,
            "op": sweep.thesis.op,
            "params": candidate.params,
            "verdict": candidate.verdict,
            "geomean_speedup": measured.geomean_speedup,
            "best_speedup": measured.best_speedup,
            "url": site_url(url or sweep.get_absolute_url()),
        },
        "reviewer": reviewer.get_username(),
        "comment": comment,
        "details": details,
    }
