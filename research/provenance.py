"""Where a result was measured, as the lab knows it: by one of its workers, or imported.

A candidate's `provenance` is written by the lab when it records the result, never
read from the result: an imported results file may say anything about itself. What
the file says of its machine (`result["machine"]`) is shown as what it claims.

A worker's result names its queue and host. An imported one names who imported it,
through which token (a GPU host's token names its host) and the run; it is "not
reproduced here" until a VERIFY sweep on a trusted worker of its hardware class
measured the same candidate again and agreed (reviews.verification).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from research.models import ApiToken, Candidate, Sweep
from runners.harness import machine

WORKER = "worker"
IMPORT = "import"


def worker_provenance(*, queue: str) -> dict[str, Any]:
    return {"by": WORKER, "queue": queue, "host": socket.gethostname()}


def import_provenance(*, imported_by, token: ApiToken | None, header: dict[str, Any]) -> dict[str, Any]:
    """`token`: the API token the file came with (None: `manage.py import_results`, run
    by someone with the server's shell). The host is the token's when it is a host
    token; otherwise only what the file claims, and said so."""
    harness = header.get("harness") or {}
    return {
        "by": IMPORT,
        "imported_by": imported_by.get_username(),
        "through": "the import_results command" if token is None else f"API token {token}",
        "host": token.host if token is not None and token.host else None,
        "claimed_host": (header.get("machine") or {}).get("host"),  # checked: a short string or absent
        "run": header.get("run"),
        "harness_commit": harness.get("commit"),
    }


def is_imported(candidate: Candidate) -> bool:
    """Imported, by its provenance or its sweep (one imported before provenance was kept)."""
    return candidate.provenance.get("by") == IMPORT or candidate.sweep.strategy == Sweep.Strategy.IMPORTED


def describe(candidate: Candidate) -> str:
    """One line for badges: who measured it, where."""
    found = candidate.provenance
    if found.get("by") == WORKER:
        return f"measured here by a worker on {found.get('host')} (queue {found.get('queue')})"
    if found.get("by") == IMPORT:
        host = found.get("host") or (f"a host that calls itself {found['claimed_host']}"
                                     if found.get("claimed_host") else "an unnamed host")
        return f"imported by {found.get('imported_by')} from {host}, not reproduced here"
    return "measured before the lab recorded provenance"


@dataclass(frozen=True)
class MachineRow:
    label: str
    candidate: Any
    kept: Any
    differs: bool


def machine_rows(candidate_machine: dict | None, kept_machine: dict | None) -> list[MachineRow]:
    """The two machine states side by side, each field either reports."""
    # Results recorded before machine states were checked may hold anything.
    one, other = (state if isinstance(state, dict) else {} for state in (candidate_machine, kept_machine))
    differing = set(machine.differences(one, other))
    return [MachineRow(label, one.get(key), other.get(key), label in differing)
            for key, label in machine.LABELS.items() if key in one or key in other]
