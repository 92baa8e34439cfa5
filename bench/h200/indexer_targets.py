"""The indexer's targets, side by side in one run: the thesis's references and our kernels.

    python3 bench/h200/indexer_targets.py [--ctx 4096,8192,32768,65536,131072,262144]
        [--rounds 30] [--bf16 '{"ROWS": 2, ...}'] [--fp8 '{"ROWS": 4, ...}']
        [--candidates '[{"ROWS": 2, ..., "REDUCE": "scatter"}]'] [--fp8-candidates '[...]']
        [--files '[["label", "dsa_indexer_topk", "path/to/kernel.py"]]'] [--out targets.jsonl]

The issue's targets ask for one run on one H200: torch eager (the op's baseline:
einsum, relu, einsum, topk), fused logits + torch.topk (`fused_logits_triton` at the
point the harness measured), the kept bf16 CuTe kernel, any further bf16 points given
with --candidates, the fp8 CuTe kernel and any further fp8 points (--fp8-candidates),
and other versions of a kernel file at their own PARAMS (--files: an earlier commit's,
say, to time a change against what it replaced).
Per context every entry is checked against the op's reference, captured in a CUDA
graph, then timed in `--rounds` rounds; each
round replays every entry once, in an order rotated from round to round, L2 flushed
(twice its size) before each replay, timed by CUDA events. All entries thus share the
machine's state at every moment of the run. Reported: the median and the 10th-90th
percentile range per entry and context, each entry's multiple of the compute floor
(ours, from skills/hardware/peaks.toml, and the issue's: the op's FLOPs at the 709
TFLOP/s it measured), and the targets, met or not, against the issue's floor. No
isolation and no guards: the harness's own sweeps (`python -m runners.harness sweep`)
are the results; this is the side-by-side view.

Needs torch, triton and CuTe DSL (on PYTHONPATH) on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from indexer_points import capture_graph, check, load, timed_replay  # noqa: E402

from runners.harness.roofline import floor_ms, hardware_key  # noqa: E402
from runners.ops import get_op  # noqa: E402
from runners.space import materialize  # noqa: E402

# The thesis's measured bf16 matmul rate on the H200, its compute floor.
THESIS_TFLOPS = 709.0
FUSED_POINT = {"BLOCK_N": 128, "BLOCK_H": 32, "ROWS": 1, "num_warps": 4, "num_stages": 2}
BF16_KEPT = {"ROWS": 4, "STAGES": 3, "SCHEDULE": "pingpong", "REDUCE": "scatter", "SELECT_THREADS": 1024}
FP8_KEPT = {"ROWS": 4, "STAGES": 6, "SCHEDULE": "roundrobin", "REDUCE": "mma", "SELECT_THREADS": 1024}
TORCH_EAGER, FUSED, BF16, FP8 = "torch eager", "fused logits + torch.topk", "bf16 kept", "fp8"


def entries(
    bf16: dict, fp8: dict, candidates: list[dict], fp8_candidates: list[dict] = (),
    files: list[list[str]] = (),
) -> list[tuple[str, str, str, dict | None]]:
    """(label, op, kernel, point) of everything timed: the kernel is a kernel's name,
    'baseline' or a kernel file's path; a point of None times the file at its PARAMS."""
    def named(prefix: str, point: dict) -> str:
        return f"{prefix} {','.join(f'{k}={v}' for k, v in point.items())}"

    found = [(TORCH_EAGER, "dsa_indexer_topk", "baseline", None),
             (FUSED, "dsa_indexer_topk", "fused_logits_triton", FUSED_POINT),
             (BF16, "dsa_indexer_topk", "logits_topk_cute", bf16)]
    found += [(named("bf16", point), "dsa_indexer_topk", "logits_topk_cute", point) for point in candidates]
    found.append((FP8, "dsa_indexer_topk_fp8", "logits_topk_fp8_cute", fp8))
    found += [(named("fp8", point), "dsa_indexer_topk_fp8", "logits_topk_fp8_cute", point)
              for point in fp8_candidates]
    found += [(label, op_name, path, None) for label, op_name, path in files]
    return found


def forward_of(op, kernel: str, point: dict | None, scratch: Path, name: str):
    if kernel == "baseline":
        path = op.baseline_path
    else:
        path = Path(kernel) if kernel.endswith(".py") else op.kernels()[kernel]
    source = path.read_text() if point is None else materialize(path.read_text(), point)
    file = scratch / f"{name}.py"
    file.write_text(source)
    return load(file, name).forward


def time_rounds(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, flush: torch.Tensor) -> dict[str, list[float]]:
    """ms of each replay, every entry once per round, the order rotated each round."""
    names = list(graphs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed_replay(graphs[name], flush))
    return times


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def verdicts(rows: dict[int, dict], floors: dict[int, float]) -> list[str]:
    """The issue's targets against this run's medians. `floors` are the issue's own: the
    op's FLOPs at the 709 TFLOP/s it measured (thesis_floor_ms), not the datasheet peak."""
    lines = []
    for context, limit in ((131072, 1.2), (262144, 1.2), (32768, 1.5), (65536, 1.5)):
        if context in rows:
            ratio = rows[context][BF16] / floors[context]
            lines.append(f"bf16 within {limit}x of the 709 TFLOP/s floor at {context // 1024}K: {ratio:.2f}x "
                         f"({rows[context][BF16]:.3f} ms, floor {floors[context]:.3f}) "
                         f"{'met' if ratio <= limit else 'not met'}")
    if 262144 in rows:
        ms = rows[262144][BF16]
        lines.append(f"bf16 at most 0.47 ms at 256K: {ms:.3f} ms {'met' if ms <= 0.47 else 'not met'}")
    for context in (131072, 262144):
        if context in rows:
            ratio = rows[context][FUSED] / rows[context][BF16]
            lines.append(f"bf16 at least 1.5x faster than fused logits + torch.topk at {context // 1024}K: "
                         f"{ratio:.2f}x {'met' if ratio >= 1.5 else 'not met'}")
    slower = [c for c, row in rows.items() if row[BF16] > row[TORCH_EAGER]]
    lines.append("bf16 never slower than torch eager: " + ("met" if not slower else
                 "not met at " + ", ".join(f"{c // 1024}K" for c in slower)))
    if 262144 in rows:
        ratio = rows[262144][FP8] / rows[262144][BF16]
        lines.append(f"fp8 at most 0.6x the bf16 kernel at 256K: {ratio:.2f}x {'met' if ratio <= 0.6 else 'not met'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", default="4096,8192,32768,65536,131072,262144")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--bf16", type=json.loads, default=BF16_KEPT, help="the bf16 CuTe point")
    parser.add_argument("--fp8", type=json.loads, default=FP8_KEPT, help="the fp8 CuTe point")
    parser.add_argument("--candidates", type=json.loads, default=[], help="more bf16 CuTe points")
    parser.add_argument("--fp8-candidates", type=json.loads, default=[], help="more fp8 CuTe points")
    parser.add_argument("--files", type=json.loads, default=[],
                        help="[label, op, path] of other kernel files, timed at their own PARAMS")
    parser.add_argument("--out", type=Path, default=Path("targets.jsonl"))
    args = parser.parse_args()
    hardware = hardware_key("cuda")
    flush = torch.empty(2 * 64 * 2**20 // 4, dtype=torch.float32, device="cuda")
    scratch = Path(tempfile.mkdtemp(prefix="indexer-targets-"))
    timed = entries(args.bf16, args.fp8, args.candidates, args.fp8_candidates, args.files)
    forwards = {}
    for index, (label, op_name, kernel, point) in enumerate(timed):
        op = get_op(op_name)
        forwards[label] = forward = forward_of(op, kernel, point, scratch, f"entry{index}")
        wrong = check(op, forward)
        if wrong:
            raise SystemExit(f"{label} is wrong: {wrong}")
    rows: dict[int, dict] = {}
    floors: dict[int, float] = {}
    with args.out.open("w") as out:
        for context in (int(c) for c in args.ctx.split(",")):
            graphs, keep = {}, []
            for label, op_name, _, _ in timed:
                op = get_op(op_name)
                workload = op.workloads("cuda", [context], op.default_batch_sizes("cuda"))[0]
                inputs = list(op.make_inputs(workload, 11, "normal").values())
                keep.append(inputs)  # the graphs read these buffers
                graphs[label] = capture_graph(forwards[label], inputs)
                if op_name == "dsa_indexer_topk":
                    floors[context] = floor_ms(op, workload, hardware)
            times = time_rounds(graphs, args.rounds, flush)
            rows[context] = {label: statistics.median(values) for label, values in times.items()}
            for label, values in times.items():
                out.write(json.dumps({
                    "context": context, "entry": label, "median_ms": statistics.median(values),
                    "p10_ms": percentile(values, 0.1), "p90_ms": percentile(values, 0.9),
                    "floor_ms": floors[context], "thesis_floor_ms": thesis_floor_ms(context), "rounds": args.rounds,
                }) + "\n")
            out.flush()
            print(f"{context // 1024}K: " + ", ".join(f"{label} {rows[context][label]:.3f}" for label in rows[context]),
                  file=sys.stderr, flush=True)
            del graphs, keep
            torch.cuda.empty_cache()

    labels = [label for label, *_ in timed]
    print("| context | floor (ours) | floor at 709 TFLOP/s | " + " | ".join(labels)
          + " | bf16 / floor (ours) | bf16 / 709 floor | fp8 / bf16 |")
    print("|---" * (len(labels) + 6) + "|")
    for context, row in rows.items():
        print(f"| {context // 1024}K | {floors[context]:.3f} | {thesis_floor_ms(context):.3f} | "
              + " | ".join(f"{row[label]:.3f}" for label in labels)
              + f" | {row[BF16] / floors[context]:.2f}x | {row[BF16] / thesis_floor_ms(context):.2f}x"
              + f" | {row[FP8] / row[BF16]:.2f}x |")
    print()
    print("\n".join(verdicts(rows, {context: thesis_floor_ms(context) for context in rows})))


def thesis_floor_ms(context: int) -> float:
    """The thesis's floor: the bf16 op's FLOPs at 709 TFLOP/s."""
    op = get_op("dsa_indexer_topk")
    workload = op.workloads("cuda", [context], op.default_batch_sizes("cuda"))[0]
    return op.flops(workload) / (THESIS_TFLOPS * 1e9)


if __name__ == "__main__":
    main()
