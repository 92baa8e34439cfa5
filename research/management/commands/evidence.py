"""``manage.py evidence FILE [--json]``: the upload form's parser, from the shell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from research.evidence import (
    MAX_EVIDENCE_BYTES,
    EvidenceError,
    EvidenceSummary,
    check_evidence_size,
    parse_evidence,
)

# Templated C++ kernel names run to hundreds of characters; the table shows the start.
TABLE_NAME_WIDTH = 100
USAGE_ERROR = 2


class Command(BaseCommand):
    help = (
        "Summarise a profile: a PyTorch profiler Chrome trace (.json or .json.gz), "
        "an `ncu --csv --page details` export or an `nsys stats` kernel summary CSV."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the profile export to read")
        parser.add_argument(
            "--json", action="store_true", dest="as_json",
            help="print the summary as one JSON object",
        )

    def handle(self, *args: Any, file: str, as_json: bool, **options: Any) -> None:
        max_bytes = getattr(settings, "EVIDENCE_MAX_BYTES", MAX_EVIDENCE_BYTES)
        path = Path(file)
        try:
            # Refuse by size before reading, so a huge file is never loaded.
            check_evidence_size(path.stat().st_size, max_bytes=max_bytes)
            summary = parse_evidence(path.read_bytes(), path.name, max_bytes=max_bytes)
        except OSError as exc:
            raise CommandError(
                f"cannot read {file}: {exc.strerror}", returncode=USAGE_ERROR
            ) from exc
        except EvidenceError as exc:
            raise CommandError(f"{file}: {exc}", returncode=USAGE_ERROR) from exc
        self.stdout.write(json.dumps(summary) if as_json else _table(summary))


def _table(summary: EvidenceSummary) -> str:
    lines = [
        f"{summary['format']}: {summary['kernel_count']:,} kernels, "
        f"{summary['total_ms']:.3f} ms in all",
        f"bottleneck: {summary['bottleneck']} — {summary['reason']}",
        "",
        f"{'share':>7}  {'total ms':>10}  {'calls':>8}  name",
    ]
    for row in summary["top_kernels"]:
        name = row["name"]
        if len(name) > TABLE_NAME_WIDTH:
            name = name[: TABLE_NAME_WIDTH - 1] + "…"
        lines.append(f"{row['share']:>7.1%}  {row['total_ms']:>10.3f}  {row['calls']:>8,}  {name}")
    lines += [f"note: {note}" for note in summary["notes"]]
    return "\n".join(lines)
