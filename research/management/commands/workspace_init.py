"""Creates the kernel workspace (a git repository) and seeds every op's baseline kernel."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

import workspace


class Command(BaseCommand):
    help = "Create the kernel workspace if it does not exist; seed ops that have no kept kernel yet."

    def handle(self, *args, **options) -> None:
        try:
            workspace.ensure()
            head = workspace.main_head()
        except workspace.WorkspaceError as error:
            raise CommandError(str(error)) from error
        ops = ", ".join(sorted(workspace.dispatch_table()))
        self.stdout.write(f"Kernel workspace {workspace.path()} at {head[:12]} ({ops})")
