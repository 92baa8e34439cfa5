"""Creates the first login of a new installation and prints its password once.

The password is printed when it is created and kept in DATA_DIR/first-login.txt
(readable by its owner only); later starts name the file instead of printing it again,
and remove the file once the password has been changed.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from config.private_files import write_private

USERNAME = "admin"


class Command(BaseCommand):
    help = "Create the first login (admin) if there is no user yet, and print it once."

    def handle(self, *args, **options) -> None:
        note = settings.DATA_DIR / "first-login.txt"
        User = get_user_model()
        if not User.objects.exists():
            password = secrets.token_urlsafe(12)
            User.objects.create_superuser(USERNAME, "", password)
            text = f"username: {USERNAME}\npassword: {password}\n"
            note.parent.mkdir(parents=True, exist_ok=True)
            write_private(note, text)
            self.stdout.write("First login (change it under /admin/):\n" + text)
            return
        text = _read_own_file(note)
        if text is None:
            return
        password = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line).get("password")
        admin = User.objects.filter(username=USERNAME).first()
        if admin is None or password is None or not admin.check_password(password):
            note.unlink()  # changed since: the note would only mislead, and it is a secret
            return
        self.stdout.write(f"First login: {USERNAME}, its password is in {note} (change it under /admin/).\n")


def _read_own_file(note: Path) -> str | None:
    """The note's text, or None when there is none; a link or anything but a regular
    file at its name is removed, not read."""
    try:
        descriptor = os.open(note, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:  # ELOOP: a link
        note.unlink(missing_ok=True)
        return None
    with os.fdopen(descriptor, encoding="utf-8", errors="replace") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            note.unlink(missing_ok=True)
            return None
        return handle.read(4096)
