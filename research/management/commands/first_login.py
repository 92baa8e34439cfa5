"""Creates the first login of a new installation and prints its password once.

The password is printed when it is created and kept in DATA_DIR/first-login.txt
(readable by its owner only); later starts name the file instead of printing it again,
and remove the file once the password has been changed.
"""

from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

USERNAME = "admin"


class Command(BaseCommand):
    help = "Create the first login (admin) if there is no user yet, and print it once."

    def handle(self, *args, **options) -> None:
        note = settings.DATA_DIR / "first-login.txt"
        User = get_user_model()
        if not User.objects.exists():
            password = secrets.token_urlsafe(12)
            User.objects.create_superuser(USERNAME, "", password)
            note.parent.mkdir(parents=True, exist_ok=True)
            note.touch(mode=0o600)
            note.chmod(0o600)
            note.write_text(f"username: {USERNAME}\npassword: {password}\n")
            self.stdout.write("First login (change it under /admin/):\n" + note.read_text())
            return
        if not note.exists():
            return
        password = dict(line.split(": ", 1) for line in note.read_text().splitlines() if ": " in line).get("password")
        admin = User.objects.filter(username=USERNAME).first()
        if admin is None or password is None or not admin.check_password(password):
            note.unlink()  # changed since: the note would only mislead, and it is a secret
            return
        self.stdout.write(f"First login: {USERNAME}, its password is in {note} (change it under /admin/).\n")
