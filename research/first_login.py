"""The first login's note, DATA_DIR/first-login.txt: the generated admin password, kept
(readable by its owner only) until that password is changed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model

USERNAME = "admin"


def note_path() -> Path:
    return settings.DATA_DIR / "first-login.txt"


def read_note(note: Path) -> str | None:
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


def forget_if_changed(note: Path) -> bool:
    """Removes the note once its password is no longer the admin's (it would only
    mislead, and it is a secret); True while it still holds the admin's password."""
    text = read_note(note)
    if text is None:
        return False
    password = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line).get("password")
    admin = get_user_model().objects.filter(username=USERNAME).first()
    if admin is None or password is None or not admin.check_password(password):
        note.unlink(missing_ok=True)
        return False
    return True


def forget_on_password_change(sender, instance, update_fields=None, **kwargs) -> None:
    """post_save of a user: the note goes as soon as the admin's password changes, not at
    the next start (a changed password's note outlived the change while the app ran)."""
    if instance.get_username() != USERNAME or (update_fields is not None and "password" not in update_fields):
        return
    forget_if_changed(note_path())
