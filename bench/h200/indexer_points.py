"""Every SPACE point of the indexer kernels on one GPU, quickly: correct, and how fast.

    python3 bench/h200/indexer_points.py [--ops dsa_indexer_topk,dsa_indexer_topk_fp8]
        [--kernels NAME,...] [--ctx 4096,16384,65536,131072,262144] [--replays 30]
        [--out points.jsonl]

A scouting pass that picks which points of which kernels deserve the harness's full
evaluation (`python -m runners.harness sweep`, every guard, A/A noise floor, the
end-to-end check) inside a short GPU lease. It is not that measurement: no isolation,
no guards, one seed; its numbers choose what to evaluate and are never reported as
results.

Per point: a correctness check against the op's reference at a context that leaves
partial tiles (both value distributions), then per context the median and spread of
`--replays` CUDA-graph replays, each after an L2 flush, timed by CUDA events; the
compute floor of skills/hardware/peaks.toml and the fraction of it reached. The op's
baseline is measured the same way. One JSON line per (kernel, point, context) goes to
--out; the table printed last gives each kernel's best point per context.

Needs only torch, triton, numpy, scipy (and CuTe DSL on PYTHONPATH for CuTe kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runners.harness.roofline import floor_ms, hardware_key  # noqa: E402
from runners.ops import get_op  # noqa: E402
from runners.space import grid_points, materialize, read_literals  # noqa: E402

CHECK_CONTEXT = 6000  # not a multiple of any tile: partial tiles everywhere
DISTRIBUTIONS = ("normal", "uniform_outliers")


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton looks kernels' modules up here
    spec.loader.exec_module(module)
    return module


def check(op, forward) -> str | None:
    """None when correct, else what is wrong."""
    workload = op.workloads("cuda", [CHECK_CONTEXT], op.default_batch_sizes("cuda"))[0]
    for distribution in DISTRIBUTIONS:
        inputs = op.make_inputs(workload, 7, distribution)
        expected = op.reference({k: v.clone() if hasattr(v, "clone") else v for k, v in inputs.items()})
        correct, detail = op.check(forward(*inputs.values()), expected, inputs)
        if not correct:
            return f"{distribution}: {detail}"
    return None


def scores_launch(module, inputs: dict, rows: int, stages: int, schedule: str, reduce: str):
    """(launch, scores, hist): a callable that launches a CuTe indexer module's scores
    kernel alone on the op's inputs at these parameters, and the buffers it writes. The
    e4m3 module (inputs with a k_scale) takes the keys' scales and compiles for e4m3."""
    from runners.kernel_lib.cute_host import current_stream, sm_count
    from runners.kernel_lib.indexer_scores import SCHEDULES, mma_splits
    from runners.kernel_lib.indexer_select import BINS

    q, k, weights = inputs["q"], inputs["k"], inputs["weights"]
    rows_m, heads, dim = q.shape
    context, sms = k.shape[0], sm_count()
    rows = module.mma_rows(rows, heads, schedule)
    splits, per_cta = mma_splits(rows_m, context, rows, sms)
    scores = torch.empty(rows_m, context, dtype=torch.float32, device=q.device)
    hist = torch.empty(splits, rows_m, BINS, dtype=torch.int32, device=q.device)
    shape = (heads, dim, rows, stages, weights.dtype, schedule, reduce)
    # Taking turns, a tile is one warpgroup's 64 tokens: twice the 128-token count.
    span = per_cta * (2 if SCHEDULES[schedule] > 1 else 1)
    if "k_scale" in inputs:
        kernel = module.compiled_scores_mma(*shape)
        tensors = (q.view(rows_m * heads, dim), k, inputs["k_scale"], weights, scores, hist)
    else:
        kernel = module.compiled_scores_mma(q.dtype, *shape)
        tensors = (q.view(rows_m * heads, dim), k, weights, scores, hist)
    def launch(*_unused):
        kernel(*tensors, current_stream(q), span)
    return launch, scores, hist


def capture_graph(forward, args: list) -> torch.cuda.CUDAGraph:
    """forward(*args) captured in a CUDA graph, after two calls on a side stream that
    compile and warm it up (capture cannot compile)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(*args)
    return graph


def time_graph(forward, inputs: dict, replays: int, flush: torch.Tensor) -> list[float]:
    """Milliseconds of each replay of forward captured in a CUDA graph, L2 flushed before each."""
    graph = capture_graph(forward, list(inputs.values()))
    return [timed_replay(graph, flush) for _ in range(replays)]


# How long the GPU spins while the host queues the events and the replay (about 0.5 ms
# at an H200's clocks), so that no launch latency is timed.
HOLD_CYCLES = 1_000_000


def timed_replay(graph: torch.cuda.CUDAGraph, flush: torch.Tensor) -> float:
    """ms of one replay on the GPU's clock, after an L2 flush. The GPU spins while the host
    queues the events and the replay, so no launch latency is timed."""
    flush.add_(1)
    torch.cuda._sleep(HOLD_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def kernel_points(op, only: set[str] | None):
    """(kernel name, point label, source) for the baseline and every SPACE point."""
    yield "baseline", "-", op.baseline_path.read_text()
    for name, path in sorted(op.kernels().items()):
        if only and name not in only:
            continue
        source = path.read_text()
        space = read_literals(source)[1]
        for point in grid_points(space) if space else [None]:
            label = ",".join(f"{k}={v}" for k, v in point.items()) if point else "-"
            yield name, label, materialize(source, point) if point else source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="dsa_indexer_topk,dsa_indexer_topk_fp8")
    parser.add_argument("--kernels", help="only these kernels (names without .py)")
    parser.add_argument("--ctx", default="4096,16384,65536,131072,262144")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("points.jsonl"))
    args = parser.parse_args()
    contexts = [int(c) for c in args.ctx.split(",")]
    only = set(args.kernels.split(",")) if args.kernels else None
    hardware = hardware_key("cuda")
    # Twice the L2 (60 MiB on an H200), written before every replay.
    flush = torch.empty(2 * 64 * 2**20 // 4, dtype=torch.float32, device="cuda")
    scratch = Path(tempfile.mkdtemp(prefix="indexer-points-"))
    best: dict[tuple[str, str, int], tuple[float, str]] = {}
    floors: dict[tuple[str, int], float | None] = {}
    with args.out.open("w") as out:
        for op_name in args.ops.split(","):
            op = get_op(op_name)
            workloads = {c: op.workloads("cuda", [c], op.default_batch_sizes("cuda"))[0] for c in contexts}
            for index, (kernel, label, source) in enumerate(kernel_points(op, only)):
                file = scratch / f"{op_name}_{kernel}_{index}.py"
                file.write_text(source)
                row = {"op": op_name, "kernel": kernel, "point": label}
                started = time.monotonic()
                try:
                    forward = load(file, file.stem).forward
                    wrong = check(op, forward)
                except Exception as error:  # noqa: BLE001 — reported, and the next point runs
                    wrong = f"{type(error).__name__}: {error}"
                    traceback.print_exc(file=sys.stderr)
                if wrong:
                    out.write(json.dumps({**row, "error": wrong[:500]}) + "\n")
                    print(f"{op_name} {kernel} {label}: WRONG {wrong[:200]}", file=sys.stderr, flush=True)
                    continue
                for context, workload in workloads.items():
                    try:
                        times = time_graph(forward, op.make_inputs(workload, 11, "normal"), args.replays, flush)
                    except Exception as error:  # noqa: BLE001
                        out.write(json.dumps({**row, "context": context, "error": f"{type(error).__name__}: {error}"[:500]}) + "\n")
                        print(f"{op_name} {kernel} {label} ctx={context}: {type(error).__name__}: {error}"[:300],
                              file=sys.stderr, flush=True)
                        break
                    median = statistics.median(times)
                    floor = floors.setdefault((op_name, context), floor_ms(op, workload, hardware))
                    out.write(json.dumps({
                        **row, "context": context, "median_ms": median, "min_ms": min(times), "max_ms": max(times),
                        "floor_ms": floor, "fraction": floor / median if floor else None,
                    }) + "\n")
                    out.flush()
                    key = (op_name, kernel, context)
                    if key not in best or median < best[key][0]:
                        best[key] = (median, label)
                print(f"{op_name} {kernel} {label}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()

    print(f"{'op':<22} {'kernel':<24} " + " ".join(f"{c // 1024:>6}K" for c in contexts) + "   best points")
    for op_name in args.ops.split(","):
        print(f"{op_name:<22} {'floor':<24} " + " ".join(
            f"{floors.get((op_name, c)) or 0:7.3f}" for c in contexts))
        kernels = sorted({k for (o, k, _) in best if o == op_name}, key=lambda k: (k != "baseline", k))
        for kernel in kernels:
            cells = [best.get((op_name, kernel, c)) for c in contexts]
            labels = sorted({cell[1] for cell in cells if cell})
            print(f"{op_name:<22} {kernel:<24} " + " ".join(
                f"{cell[0]:7.3f}" if cell else "      -" for cell in cells) + "   " + " | ".join(labels))


if __name__ == "__main__":
    main()
