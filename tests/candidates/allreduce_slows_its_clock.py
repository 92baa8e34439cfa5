"""Slow, but says it is fast: each call sleeps 20 ms before an honest sum, and at
import it replaces time.perf_counter_ns, the clock a rank would time its calls with,
by one that runs a hundred times slower. A rank that timed itself would report
a fifth of a millisecond."""

import time

from runners.ops.allreduce_sum.kernels.shared_memory_one_shot import forward as _honest

_real = time.perf_counter_ns
_start = _real()
time.perf_counter_ns = lambda: _start + (_real() - _start) // 100


def forward(x, comm):
    time.sleep(0.02)
    return _honest(x, comm)
