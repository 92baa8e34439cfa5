"""Does work one process leaves running on a GPU delay another process's kernel?

The judge's GPU probe (runners.harness.observe.GpuProbe) rests on it: right after a
child replies and is stopped, the judge times a tiny kernel of its own, on its own
clock; CUDA contexts of different processes take turns on the GPU, so a kernel the
child left running holds the probe back by about the time it still had to run.

    python3 bench/gpu_sharing.py [--samples 30]

A second process launches a spin kernel of a given length (torch.cuda._sleep) and says
so without waiting for it; this one then runs the probe. Prints, per length, the
probe's median and 90th percentile in ms, and the same with the other process idle.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

from runners.harness.observe import GpuProbe  # noqa: E402

_OTHER = textwrap.dedent("""
    import sys, torch
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    cycles_per_us = 1980  # the H200's boost clock; the lengths are nominal
    print("ready", flush=True)
    for line in sys.stdin:
        us = float(line)
        if us > 0:
            torch.cuda._sleep(int(us * cycles_per_us))
        print("launched", flush=True)
        torch.cuda.synchronize()
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    other = subprocess.Popen([sys.executable, "-c", _OTHER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert other.stdout is not None and other.stdin is not None
    assert other.stdout.readline().strip() == "ready"
    probe = GpuProbe()
    rows = []
    for us in (0, 50, 200, 1000, 5000):
        found = []
        for _ in range(args.samples):
            other.stdin.write(f"{us}\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == "launched"
            found.append(probe.idle_ms())
            time.sleep(max(0.002, 2 * us / 1e6))  # the other kernel is done before the next
        rows.append((us, float(np.median(found)), float(np.percentile(found, 90))))
    other.stdin.close()
    other.wait()
    print("other process's kernel (us) | probe median (ms) | probe p90 (ms)")
    for us, median, p90 in rows:
        print(f"{us:>27} | {median:>17.4f} | {p90:>14.4f}")


if __name__ == "__main__":
    main()
