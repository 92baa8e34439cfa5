"""Creates the first login of a new installation and prints its password once.

The password is printed when it is created and kept in DATA_DIR/first-login.txt
(readable by its owner only); later starts name the file instead of printing it again.
The file goes once the password has been changed (research.first_login).
"""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from config.private_files import write_private
from research.first_login import USERNAME, forget_if_changed, note_path


class Command(BaseCommand):
    help = "Create the first login (admin) if there is no user yet, and print it once."

    def handle(self, *args, **options) -> None:
        note = note_path()
        User = get_user_model()
        if not User.objects.exists():
            password = secrets.token_urlsafe(12)
            User.objects.create_superuser(USERNAME, "", password)
            text = f"username: {USERNAME}\npassword: {password}\n"
            note.parent.mkdir(parents=True, exist_ok=True)
            write_private(note, text)
            self.stdout.write("First login (change it under /admin/):\n" + text)
            return
        if forget_if_changed(note):
            self.stdout.write(f"First login: {USERNAME}, its password is in {note} (change it under /admin/).\n")
