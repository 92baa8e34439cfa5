"""The judge's own work on a CPU: the element-wise comparison, and what a sweep's memo saves.

    .venv/bin/python bench/judge_work.py [--repeat 10] [--evaluations 3]

1. `compare_close` at T=4096 x 1024 (the rmsnorm workload that dominates correctness),
   float32 and bfloat16 outputs against a float64 reference, on one thread as the judge
   runs: the chunked comparison beside the whole-tensor definition it replaced
   (tests/test_judge_memo.py checks that both say the same).
2. `evaluate("rmsnorm", "baseline")` on the op's default CPU workloads, EVALUATIONS times
   on one secret seed: each time alone, then each time through one memo, as a sweep
   judges its candidates (runners.harness.memo). Wall per evaluation, the judge's own
   CPU time in it (user and system), the wall spent inside its requests to the children
   (every request timed from the judge's side), and what the memo made and reused.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runners.harness import children, evaluate  # noqa: E402
from runners.harness.memo import Memo, limit_bytes  # noqa: E402
from runners.ops.base import compare_close  # noqa: E402
from tests.test_judge_memo import whole_tensor_compare  # noqa: E402


def comparison(repeat: int) -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    print("compare_close at 4096 x 1024, one thread (median ms of", repeat, "calls)")
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.randn(4096, 1024, generator=generator, dtype=torch.float64)
        actual = (expected + 1e-5 * torch.randn(4096, 1024, generator=generator, dtype=torch.float64)).to(dtype)
        times: dict[str, list[float]] = {"whole tensor": [], "chunked": []}
        for _ in range(repeat):  # alternating, so that both see the same machine
            for name, compare in (("whole tensor", whole_tensor_compare), ("chunked", compare_close)):
                began = time.perf_counter()
                compare(actual, expected, rtol=1.6e-2, atol=1e-2)
                times[name].append(1000 * (time.perf_counter() - began))
        whole, chunked = (statistics.median(times[name]) for name in ("whole tensor", "chunked"))
        print(f"  {str(dtype):15s} whole tensor {whole:7.1f} ms   chunked {chunked:6.1f} ms   {whole / chunked:.2f}x")


def _timing_requests(spent: list[float]) -> None:
    """Adds the wall of every request the judge makes of a child to spent[0]."""
    request = children.Child.request

    def timed(self, *args, **kwargs):
        began = time.monotonic()
        try:
            return request(self, *args, **kwargs)
        finally:
            spent[0] += time.monotonic() - began

    children.Child.request = timed


def evaluations(count: int) -> None:
    print(f"evaluate('rmsnorm', 'baseline'), default CPU workloads, one secret seed, {count} times each way")
    walls: dict[str, list[float]] = {"alone": [], "through one memo": []}
    judge: dict[str, list[tuple[float, float, float]]] = {way: [] for way in walls}
    memo = Memo(limit_bytes("cpu"))  # as a CPU sweep keeps it
    spent = [0.0]
    _timing_requests(spent)
    for way in walls:
        for _ in range(count):
            spent[0] = 0.0
            before, began = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            result = evaluate("rmsnorm", "baseline", seed=20261205,
                              memo=memo if way == "through one memo" else None)
            walls[way].append(time.monotonic() - began)
            after = resource.getrusage(resource.RUSAGE_SELF)
            judge[way].append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, spent[0]))
            print(f"  {way:17s} {walls[way][-1]:6.2f} s  {result.verdict}", file=sys.stderr)
    for way, found in walls.items():
        later = judge[way][1:] or judge[way]
        print(f"  {way:17s} wall per evaluation: median {statistics.median(found):.2f} s, "
              f"first {found[0]:.2f} s, later ones median {statistics.median(found[1:] or found):.2f} s; "
              f"in the later ones the judge's CPU: user {statistics.median(u for u, _, _ in later):.2f} s, "
              f"system {statistics.median(s for _, s, _ in later):.2f} s; inside requests to the children "
              f"{statistics.median(r for _, _, r in later):.2f} s")
    print(f"  the memo: {memo.summary()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--evaluations", type=int, default=3)
    args = parser.parse_args()
    comparison(args.repeat)
    if args.evaluations:
        evaluations(args.evaluations)


if __name__ == "__main__":
    main()
