"""Where logits_topk_cute's time goes: its two launches timed apart, per variant.

    python3 bench/h200/indexer_split.py [--ctx 16384,65536,131072,262144] [--replays 30]
        [--out split.jsonl]

The kernel's forward is two launches: the wgmma scores (with the first radix digit's
histogram) and the per-row select. Each is captured alone in a CUDA graph and timed
over `--replays` replays, L2 flushed before each (as `indexer_points.py` does), for
the scores kernel's variants (ROWS, SCHEDULE, REDUCE) and
the select's thread counts; the whole forward of the shipped parameters is timed the
same way and checked against the op's reference first. Per context it also reports
how many scores share the top-k-th score's first-digit bin (the select's candidates:
at most 16384 are kept in shared memory, fuller bins take passes over the row). A scouting tool like `indexer_points.py`: its
numbers choose what the harness evaluates and are not results.

Needs torch and CuTe DSL (on PYTHONPATH) on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from indexer_points import ROOT, check, load, scores_launch, time_graph  # noqa: E402

from runners.harness.roofline import floor_ms, hardware_key  # noqa: E402
from runners.ops import get_op  # noqa: E402

KERNEL = ROOT / "runners/ops/dsa_indexer_topk/kernels/logits_topk_cute.py"
# (ROWS, STAGES, SCHEDULE, REDUCE): the scores kernel's variants worth telling apart.
# Three warpgroups taking turns hold at most ROWS=2 (their accumulators share the registers).
SCORE_VARIANTS = [(rows, 3, schedule, reduce) for rows in (2, 4) for schedule in ("cooperative", "pingpong", "roundrobin")
                  for reduce in ("shuffle", "scatter") if not (rows == 4 and schedule == "roundrobin")]
SELECT_THREADS = [512, 1024]


def _first_digit(values: torch.Tensor) -> torch.Tensor:
    """The top 11 bits of the select's radix key, which orders like the floats."""
    bits = values.contiguous().view(torch.int32)
    keys = torch.where(bits < 0, ~bits, bits | torch.iinfo(torch.int32).min)
    return (keys >> 21) & 0x7FF


def candidates_in_bin(scores: torch.Tensor, topk: int) -> list[int]:
    """Per row: how many scores share the first 11 key bits of the top-k-th score."""
    kth = scores.topk(topk, dim=1).values[:, -1:]
    return (_first_digit(scores) == _first_digit(kth)).sum(dim=1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", default="16384,65536,131072,262144")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("split.jsonl"))
    args = parser.parse_args()
    op = get_op("dsa_indexer_topk")
    module = load(KERNEL, "logits_topk_cute")
    wrong = check(op, module.forward)
    if wrong:
        raise SystemExit(f"logits_topk_cute is wrong: {wrong}")
    flush = torch.empty(2 * 64 * 2**20 // 4, dtype=torch.float32, device="cuda")
    hardware = hardware_key("cuda")
    table = []
    with args.out.open("w") as out:
        for context in (int(c) for c in args.ctx.split(",")):
            workload = op.workloads("cuda", [context], op.default_batch_sizes("cuda"))[0]
            inputs = op.make_inputs(workload, 11, "normal")
            q, topk = inputs["q"], inputs["topk"]
            rows_m = q.shape[0]
            row = {"context": context, "floor_ms": floor_ms(op, workload, hardware)}
            row["forward_ms"] = statistics.median(time_graph(module.forward, inputs, args.replays, flush))
            for rows, stages, schedule, reduce in SCORE_VARIANTS:
                launch, scores, hist = scores_launch(module, inputs, rows, stages, schedule, reduce)
                key = f"scores ROWS={rows} STAGES={stages} {schedule} {reduce}"
                row[key] = statistics.median(time_graph(launch, {}, args.replays, flush))
            # The select reads the scores and histograms of the last variant run.
            row["in_bin"] = candidates_in_bin(scores, topk)
            out_idx = torch.empty(rows_m, topk, dtype=torch.int64, device="cuda")
            for threads in SELECT_THREADS:
                select = module.compiled_select(topk, threads, *module.select_bucket(context))
                tensors = (scores, hist, out_idx)

                def launch(*_unused, select=select, tensors=tensors):
                    select(*tensors, module.current_stream(q))

                row[f"select threads={threads}"] = statistics.median(time_graph(launch, {}, args.replays, flush))
            out.write(json.dumps(row) + "\n")
            out.flush()
            table.append(row)
            print(json.dumps({key: value for key, value in row.items() if key != "in_bin"}), file=sys.stderr, flush=True)
    keys = [key for key in table[0] if key not in ("context", "in_bin")]
    print(f"{'ms':<36}" + "".join(f"{row['context'] // 1024:>9}K" for row in table))
    for key in keys:
        print(f"{key:<36}" + "".join(f"{row[key]:10.3f}" for row in table))
    print(f"{'candidates in bin (max of rows)':<36}" + "".join(f"{max(row['in_bin']):10d}" for row in table))


if __name__ == "__main__":
    main()
