"""``manage.py import_results FILE --thesis ID --user USERNAME``: a remote host's results.

FILE is what `python -m runners.harness sweep … --out FILE` wrote; it becomes a finished
IMPORTED sweep of the thesis (research.importing). Bad input exits 2 with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from research.importing import results_import
from research.models import Thesis

USAGE_ERROR = 2


def _one_line(error: ValidationError) -> str:
    return " ".join("; ".join(sum(error.message_dict.values(), [])).split())


class Command(BaseCommand):
    help = "Import a results file written by `python -m runners.harness sweep` as a sweep of a thesis."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the results file (JSON Lines)")
        parser.add_argument("--thesis", type=int, required=True, help="the thesis's id")
        parser.add_argument("--user", required=True, help="who imports it (the sweep's starter)")
        parser.add_argument("--hardware", help="the hardware class it ran on (default: the thesis's)")

    def handle(self, *args: Any, file: str, thesis: int, user: str, hardware: str | None,
               **options: Any) -> None:
        importer = get_user_model().objects.filter(username=user).first()
        if importer is None:
            raise CommandError(f"no user {user!r}", returncode=USAGE_ERROR)
        target = Thesis.objects.filter(pk=thesis).first()
        if target is None:
            raise CommandError(f"no thesis {thesis}", returncode=USAGE_ERROR)
        path = Path(file)
        try:
            if path.stat().st_size > settings.RESULTS_MAX_BYTES:
                raise CommandError(f"{file}: larger than {settings.RESULTS_MAX_BYTES:,} bytes",
                                   returncode=USAGE_ERROR)
            data = path.read_bytes()
        except OSError as error:
            raise CommandError(f"cannot read {file}: {error.strerror}", returncode=USAGE_ERROR) from error
        try:
            sweep = results_import(thesis=target, imported_by=importer, data=data, hardware=hardware)
        except ValidationError as error:
            raise CommandError(f"{file}: {_one_line(error)}", returncode=USAGE_ERROR) from error
        counts = {v: sweep.candidates.filter(verdict=v).count() for v in ("win", "no-gain", "rejected")}
        self.stdout.write(
            f"imported {sweep.total} candidates as sweep {sweep.pk} ({counts['win']} win, "
            f"{counts['no-gain']} no-gain, {counts['rejected']} rejected): {settings.SITE_URL}"
            f"{sweep.get_absolute_url()}")
