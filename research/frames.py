"""Turns a stored sweep event into the frame a browser receives.

A frame is the event itself (CONTRACTS §6) plus `html`: out-of-band fragments that
htmx swaps into the sweep page (progress bar, status, controls, a new result row).
The controls depend on who is watching, so the consumer says whether they may use them.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from django.template.loader import render_to_string

from research.sweep_control import sweep_actions_for_status

_PAGE = "research/sweep_detail.html"


# The sweep's status after each of its own events; pause, resume and cancel carry theirs.
_SWEEP_STATUS = {"sweep.started": "running", "sweep.finished": "finished"}
_CONTROL_NOTES = {"sweep.paused": "Paused by {by}: no new candidate starts until it is resumed.",
                  "sweep.resumed": "Resumed by {by}.", "sweep.cancelled": "Cancelled by {by}."}


# An agent sweep's proposals (research.agents), and work sent again (research.recovery).
_ACTIVITY_NOTES = {"agent.started": "The agent is writing candidate {number}…",
                   "agent.proposed": "Candidate {number} proposed by the agent; queued for evaluation.",
                   "candidate.refused": "Candidate {number} refused before evaluation: {refusal}",
                   "candidate.requeued": "Candidate {number} queued again: {reason}.",
                   "agent.resent": "The agent is asked again: {reason}."}


# Frames rendered lately, by what they were rendered from: every page on a sweep gets
# the same frame of each event, and one Daphne process serves many pages.
_RENDERED: OrderedDict[tuple[bool, str], dict] = OrderedDict()
_RENDERED_MAX = 2048


def event_frame(message: dict, *, can_control: bool = False) -> dict:
    key = (can_control, json.dumps(message, sort_keys=True, default=str))
    frame = _RENDERED.get(key)
    if frame is None:
        frame = {**message, "html": _event_html(message, can_control=can_control)}
        _RENDERED[key] = frame
        while len(_RENDERED) > _RENDERED_MAX:
            _RENDERED.popitem(last=False)
    return frame


def _event_html(message: dict, *, can_control: bool) -> str:
    payload = message["payload"]
    kind = message["type"]
    parts = []
    status = _SWEEP_STATUS.get(kind) or (payload.get("status") if kind in _CONTROL_NOTES else None)
    if status:
        parts.append(render_to_string(f"{_PAGE}#status", {"status": status, "oob": True}))
        parts.append(render_to_string(f"{_PAGE}#controls", {
            "sweep_id": message["sweep"], "oob": True,
            "actions": sweep_actions_for_status(status) if can_control else [],
        }))
    if kind in _CONTROL_NOTES:
        parts.append(render_to_string(f"{_PAGE}#activity", {
            "note": _CONTROL_NOTES[kind].format(by=payload.get("by", "someone")), "oob": True}))
    if "done" in payload and "total" in payload:
        parts.append(render_to_string(f"{_PAGE}#progress", {
            "done": payload["done"], "total": payload["total"],
            "wins": payload.get("wins"), "rejected": payload.get("rejected"), "oob": True,
        }))
    if kind == "candidate.started":
        parts.append(render_to_string(f"{_PAGE}#activity", {"payload": payload, "at": message.get("at"),
                                                             "oob": True}))
    if kind in _ACTIVITY_NOTES:
        parts.append(render_to_string(f"{_PAGE}#activity", {
            "note": _ACTIVITY_NOTES[kind].format(**payload), "oob": True}))
    if kind == "candidate.refused":
        parts.append(render_to_string(f"{_PAGE}#live-refused", {"row": payload, "sweep_id": message["sweep"]}))
    if kind == "candidate.result":
        parts.append(render_to_string(f"{_PAGE}#live-row", {"row": payload, "sweep_id": message["sweep"]}))
    return "".join(parts)
