"""First stage of a child: tie its life to the judge's, turn address-space randomisation
off, then become the worker.

    python -s runners/harness/launch.py REQUEST_FD REPLY_FD JUDGE_PID

Run as a script, not a module, so that nothing of the harness (nor torch) is imported
before the exec: the worker then starts once, in its final layout.

A child runs in a session of its own, so the judge can kill its whole process group;
that also takes it out of reach of whatever kills the judge (the worker's time limit, a
Ctrl-C), so the kernel is asked to kill it when its parent, the judge, dies.

Where libraries and the heap land decides which code and data alias in the branch
predictors and caches; with randomisation on, each process draws its own layout and
keeps it, and two processes running the same code differed by 10% and more. Off, the
baseline and candidate processes start from one layout. Where the system refuses, the
worker starts randomised, as it would anyway.
"""

from __future__ import annotations

import ctypes
import os
import sys

_ADDR_NO_RANDOMIZE = 0x0040000
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def _die_with_the_judge(libc: ctypes.CDLL, judge: int) -> None:
    # The signal comes when the thread that started this process ends: the judge
    # starts children from the thread that runs the evaluation, and waits there.
    libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
    if os.getppid() != judge:  # the judge died before the request took effect
        os._exit(1)


def _no_randomization(libc: ctypes.CDLL) -> None:
    current = libc.personality(0xFFFFFFFF)
    if current >= 0 and not current & _ADDR_NO_RANDOMIZE:
        libc.personality(current | _ADDR_NO_RANDOMIZE)


if __name__ == "__main__":
    _libc = ctypes.CDLL(None, use_errno=True)
    _die_with_the_judge(_libc, int(sys.argv[3]))
    _no_randomization(_libc)
    os.execv(sys.executable, [sys.executable, "-s", "-m", "runners.harness.worker", *sys.argv[1:3]])
