#!/usr/bin/env python3
"""The two commands of the quick start. Needs nothing but Python 3.11+.

    python3 dev.py start   # set up .venv, migrate, and run the whole app
    python3 dev.py test    # set up .venv (and Chromium) and run the full test suite

Both create `.venv/` in the project root and install the project into it the first
time, and again whenever pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
CHROMIUM = "/usr/bin/chromium"
TEST_PROGRAMS = {CHROMIUM: "chromium", "/usr/bin/bwrap": "bubblewrap"}


def run(*command: str, **kwargs) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, **kwargs)


def ensure_venv(extras: str = "") -> None:
    if sys.version_info < (3, 11):
        sys.exit(f"Python 3.11 or newer is needed; this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        run(sys.executable, "-m", "venv", str(VENV))
        run(str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    stamp = VENV / ".installed"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    target = f".[{extras}]" if extras else "."
    run(str(PYTHON), "-m", "pip", "install", "--quiet", "--editable", target)
    stamp.write_text(wanted)


def ensure_test_programs() -> None:
    """The machine's programs the tests run for real: the system Chromium (browser tests;
    never a browser a tool downloads) and bubblewrap (the agents' jail)."""
    missing = {package: path for path, package in TEST_PROGRAMS.items() if not Path(path).exists()}
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit(f"{', '.join(missing.values())} missing: install Debian's "
                 f"{' and '.join(missing)} (apt-get install {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-qq", env=env)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, env=env)


def start(args: list[str]) -> None:
    ensure_venv()
    os.execv(str(PYTHON), [str(PYTHON), "-m", "config.launch", *args])


def test(args: list[str]) -> None:
    ensure_venv("dev")
    ensure_test_programs()
    os.execv(str(PYTHON), [str(PYTHON), "-m", "pytest", *args])


def main() -> None:
    commands = {"start": start, "test": test}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
