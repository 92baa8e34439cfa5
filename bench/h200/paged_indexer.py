"""The paged CuTe indexer on the H200: its GPU tests, then its times beside the shipped
baselines, and what a new length costs it.

    python3 bench/h200/paged_indexer.py [--ctx 4096,65536,262144] [--replays 50] [--out FILE]

1. Runs the paged kernel's tests (`pytest tests/test_kernels_cute.py -k paged`): on a
   GPU they check every SPACE point against the op's reference on its workloads, 20
   graph replays bit-identical, a replay on new lengths, and a tie plateau (most scores
   exactly 0.0). Timing stops if they fail: a wrong kernel's time means nothing.
2. For each --ctx and the op's mixes at 64 sequences (next_n = 1, and 2 at the longest):
   `logits_topk_paged_cute` captured in a CUDA graph and replayed (median and
   10th-90th percentiles, L2 flushed before each replay, as indexer_points times), torch
   eager (the op's baseline.py, also in a graph), and the shipped `per_sequence` kernel
   (eager and timed with events around one call: it reads the lengths on the host and
   cannot be captured). Each is checked against the op's reference first.
3. A new length: the kernel is called on a batch whose lengths and table width it has
   not seen, timed on the host around the call with a synchronize (the first call),
   then the same call again (steady). With lengths as runtime values the first call
   compiles nothing, so the two should be within launch noise.

Writes one JSON line per case to --out (default bench/h200/paged_indexer.jsonl) and a
table to stdout. The FP8 paged kernel is not written yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from indexer_points import ROOT, load, time_graph  # noqa: E402

sys.path.insert(0, str(ROOT))
from runners.ops import get_op  # noqa: E402

OP = get_op("dsa_indexer_topk_paged")


def percentiles(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": statistics.median(ordered), "p10_ms": ordered[len(ordered) // 10],
            "p90_ms": ordered[(9 * len(ordered)) // 10]}


def checked(forward, inputs: dict) -> str | None:
    correct, detail = OP.check(forward(*inputs.values()), OP.reference(inputs), inputs)
    return None if correct else detail


def eager_times(forward, inputs: dict, replays: int, flush: torch.Tensor) -> list[float]:
    times = []
    for _ in range(replays):
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward(*inputs.values())
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def host_ms(forward, inputs: dict) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    forward(*inputs.values())
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", default="4096,65536,262144")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/h200/paged_indexer.jsonl")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/test_kernels_cute.py", "-q", "-k", "paged"],
                           cwd=ROOT)
    if tests.returncode:
        sys.exit("the paged kernel's GPU tests failed: not timing it")

    ours = load(OP.kernels()["logits_topk_paged_cute"], "logits_topk_paged_cute").forward
    per_sequence = load(OP.kernels()["per_sequence"], "per_sequence").forward
    baseline = load(OP.baseline_path, "paged_baseline").forward
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, device="cuda")
    contexts = [int(c) for c in args.ctx.split(",")]
    with args.out.open("w") as out:
        for workload in OP.build_workloads("cuda", contexts, [64]):
            inputs = OP.make_inputs(workload, 11, "normal")
            row = {"workload": workload.name}
            for name, forward, graphed in (("cute", ours, True), ("torch", baseline, True),
                                           ("per_sequence", per_sequence, False)):
                wrong = checked(forward, inputs)
                if wrong:
                    row[name] = {"wrong": wrong}
                    continue
                times = (time_graph(forward, inputs, args.replays, flush) if graphed
                         else eager_times(forward, inputs, max(5, args.replays // 10), flush))
                row[name] = percentiles(times)
            # A new length and table width, never seen by this process's kernels.
            fresh = OP.make_inputs(OP.build_workloads("cuda", [workload.params["context_length"] // 2 + 1000], [64])[0],
                                   12, "normal")
            row["cute_first_call_ms"] = host_ms(ours, fresh)
            row["cute_steady_call_ms"] = statistics.median(host_ms(ours, fresh) for _ in range(10))
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
