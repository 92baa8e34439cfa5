"""`python -s -m runners.jail.group MODULE REQUEST_FD REPLY_FD [REQUEST_FD REPLY_FD ...]`:
the first process of a jail shared by a collective group's ranks.

It starts one process per further pipe pair, first thing, before it has imported
anything beyond the standard library or read a byte from the judge (the supervisor
lets the jail's first process start exactly ranks - 1 processes, and an import that
starts a helper program would spend them). Each process keeps its own pair, closes its
peers', and runs MODULE as `python -m MODULE REQUEST_FD REPLY_FD` would: it is rank 0
here, rank r in the r-th process started. No rank holds a channel of a peer's.
"""

from __future__ import annotations

import os
import runpy
import sys


def start(pairs: list[tuple[int, int]]) -> int:
    """Starts the other ranks; returns this process's rank."""
    for rank in range(1, len(pairs)):
        if os.fork() == 0:
            return rank
    return 0


def main(argv: list[str]) -> None:
    module, numbers = argv[1], [int(argument) for argument in argv[2:]]
    pairs = list(zip(numbers[::2], numbers[1::2], strict=True))
    rank = start(pairs)
    for other, pair in enumerate(pairs):
        if other != rank:
            for fd in pair:
                os.close(fd)
    sys.argv = [module, *map(str, pairs[rank])]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
