"""Files that hold a secret (a password, a URL with one) under the data directory."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """`text` as the whole of a file of its owner's alone, written to a fresh file beside
    it and renamed over `path`: a link planted at the name is replaced, never followed
    (written through, it carried the secret to the file it named and made that file 0600)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(staging, path)
