"""The paged CuTe indexers (bf16 and FP8) on the H200: their GPU tests, then their times
beside the shipped baselines, and what a new length costs them.

    python3 bench/h200/paged_indexer.py [--ops dsa_indexer_topk_paged,dsa_indexer_topk_paged_fp8]
        [--ctx 4096,65536,262144] [--replays 50] [--out FILE]

1. Runs the paged kernels' tests (`pytest tests/test_kernels_cute.py -k paged`, both
   kernels): on a GPU they check every SPACE point against its op's reference on its
   workloads, 20 graph replays bit-identical, a replay on new lengths, a tie plateau
   (most scores exactly 0.0) and every 256K workload at 64 sequences. Timing stops if
   they fail: a wrong kernel's time means nothing.
2. For each op of --ops, each --ctx and the op's mixes at 64 sequences (next_n = 1, and
   2 at the longest): the CuTe kernel (`logits_topk_paged_cute`,
   `logits_topk_paged_fp8_cute`) captured in a CUDA graph and replayed (median and
   10th-90th percentiles, L2 flushed before each replay, as indexer_points times), torch
   eager (the op's baseline.py, also in a graph), and the shipped per-sequence kernel
   (`per_sequence`, `per_sequence_fp8`: eager and timed with events around one call; it
   reads the lengths on the host and cannot be captured). Each is checked against the
   op's reference first.
   For the FP8 op each row also has its compute floor: the op's FLOPs at the e4m3 matmul
   rate this GPU reaches, measured in the same run (torch._scaled_mm on 8192^3, graph
   replays), and the kernel's median over it (the issue's target at all-256K: 1.3x).
   Every row has its memory floor too: the op's bytes (each sequence's keys read once)
   at the read rate this GPU reaches (a sum over 4 GiB), measured in the same run. At 64 sequences of 256K
   the paged ops read 2.2 GB (FP8) and 4.3 GB (bf16): memory, not the matmul, bounds them.
3. A new length: the kernel is called on a batch whose lengths and table width it has
   not seen, timed on the host around the call with a synchronize (the first call),
   then the same call again (steady). With lengths as runtime values the first call
   compiles nothing, so the two should be within launch noise.

Writes one JSON line per (op, workload) to --out (default bench/h200/paged_indexer.jsonl)
and to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from indexer_points import ROOT, capture_graph, load, time_graph, timed_replay  # noqa: E402

sys.path.insert(0, str(ROOT))
from runners.ops import get_op  # noqa: E402

# Each paged op's CuTe kernel and its shipped per-sequence kernel.
KERNELS = {
    "dsa_indexer_topk_paged": ("logits_topk_paged_cute", "per_sequence"),
    "dsa_indexer_topk_paged_fp8": ("logits_topk_paged_fp8_cute", "per_sequence_fp8"),
}


def percentiles(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": statistics.median(ordered), "p10_ms": ordered[len(ordered) // 10],
            "p90_ms": ordered[(9 * len(ordered)) // 10]}


def checked(op, forward, inputs: dict) -> str | None:
    correct, detail = op.check(forward(*inputs.values()), op.reference(inputs), inputs)
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


def e4m3_peak_tflops(flush: torch.Tensor, replays: int) -> float:
    """The e4m3 matmul rate this GPU reaches: torch._scaled_mm (cuBLASLt) on 8192^3 with
    unit scales, the median of graph replays, as the FP8 kernels' timing runs them."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    one = torch.ones((), device="cuda")
    graph = capture_graph(
        lambda a, b: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), [a, b])
    return 2 * n**3 / (statistics.median(timed_replay(graph, flush) for _ in range(replays)) * 1e-3) / 1e12


def read_bandwidth_gbs(flush: torch.Tensor, replays: int) -> float:
    """The rate at which this GPU reads memory: a sum over 4 GiB (read once, nothing
    written back but the sum), the median of graph replays. A paged indexer reads every
    key of every sequence once and writes little, so at long lengths this, not the
    matmul rate, is its floor. (A copy's rate is no floor for it: a copy also writes,
    and on the H200 the e4m3 kernel read faster than a 2 GiB copy moved bytes.)"""
    source = torch.ones(2**30, device="cuda")
    total = torch.empty((), device="cuda")
    graph = capture_graph(lambda source, total: total.copy_(source.sum()), [source, total])
    seconds = statistics.median(timed_replay(graph, flush) for _ in range(replays)) * 1e-3
    return source.numel() * source.element_size() / seconds / 1e9


def host_ms(forward, inputs: dict) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    forward(*inputs.values())
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", default=",".join(KERNELS))
    parser.add_argument("--ctx", default="4096,65536,262144")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/h200/paged_indexer.jsonl")
    parser.add_argument("--shipped-point", action="store_true",
                        help="test each kernel's shipped point (PARAMS) alone, not every SPACE point")
    args = parser.parse_args()
    ops = args.ops.split(",")
    unknown = set(ops) - set(KERNELS)
    if unknown:
        sys.exit(f"--ops takes {', '.join(KERNELS)}; got {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    # Without the project's pytest settings and conftest: they load Django, which a GPU host lacks.
    tests = subprocess.run([sys.executable, "-m", "pytest", "-c", "/dev/null", "--noconftest", "-p", "no:cacheprovider",
                            "--rootdir", ".", "-q", "-rA", "tests/test_kernels_cute.py", "-k", "paged"], cwd=ROOT,
                           env={**os.environ, **({"CUTE_TEST_POINTS": "shipped"} if args.shipped_point else {})})
    if tests.returncode:
        sys.exit("the paged kernels' GPU tests failed: not timing them")

    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, device="cuda")
    contexts = [int(c) for c in args.ctx.split(",")]
    e4m3_tflops = e4m3_peak_tflops(flush, args.replays) if "dsa_indexer_topk_paged_fp8" in ops else None
    read_gbs = read_bandwidth_gbs(flush, args.replays)
    print(json.dumps({"e4m3_matmul_tflops": e4m3_tflops, "read_gb_per_s": read_gbs}), flush=True)
    with args.out.open("w") as out:
        for op_name in ops:
            op = get_op(op_name)
            cute_name, per_sequence_name = KERNELS[op_name]
            ours = load(op.kernels()[cute_name], cute_name).forward
            per_sequence = load(op.kernels()[per_sequence_name], per_sequence_name).forward
            baseline = load(op.baseline_path, f"{op_name}_baseline").forward
            for workload in op.build_workloads("cuda", contexts, [64]):
                inputs = op.make_inputs(workload, 11, "normal")
                row = {"op": op_name, "workload": workload.name}
                for name, forward, graphed in (("cute", ours, True), ("torch", baseline, True),
                                               ("per_sequence", per_sequence, False)):
                    wrong = checked(op, forward, inputs)
                    if wrong:
                        row[name] = {"wrong": wrong}
                        continue
                    times = (time_graph(forward, inputs, args.replays, flush) if graphed
                             else eager_times(forward, inputs, max(5, args.replays // 10), flush))
                    row[name] = percentiles(times)
                if op.compute_dtype == "float8_e4m3fn" and "median_ms" in row["cute"]:
                    row["e4m3_floor_ms"] = op.flops(workload) / (e4m3_tflops * 1e12) * 1e3
                    row["cute_over_e4m3_floor"] = row["cute"]["median_ms"] / row["e4m3_floor_ms"]
                if "median_ms" in row["cute"]:
                    # The bytes the op must move (every key of every sequence once) at the
                    # read rate measured above: the floor wherever it is above the compute one.
                    row["memory_floor_ms"] = op.bytes(workload) / (read_gbs * 1e9) * 1e3
                    row["cute_over_memory_floor"] = row["cute"]["median_ms"] / row["memory_floor_ms"]
                # A new length and table width, never seen by this process's kernels.
                fresh = op.make_inputs(
                    op.build_workloads("cuda", [workload.params["context_length"] // 2 + 1000], [64])[0], 12, "normal")
                row["cute_first_call_ms"] = host_ms(ours, fresh)
                row["cute_steady_call_ms"] = statistics.median(host_ms(ours, fresh) for _ in range(10))
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
