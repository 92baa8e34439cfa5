"""Our indexer kernels side by side with the production references, on the same inputs.

    python3 bench/h200/indexer_vs_production.py [--ctx 32768,131072,262144]
        [--paged equal,mixed] [--rounds 60] [--no-cute] [--out DIR]

What a serving engine would run instead of our kernels is DeepSeek's DeepGEMM
(`fp8_mqa_logits`, `fp8_paged_mqa_logits`: they stop at the [rows, N] float32 logits)
followed by a separate top-k. This script times, on the ops' own CUDA shapes
(DeepSeek-V3.2's indexer: H=64 heads, D=128, top-2048, 64 query rows or 64 sequences
with next_n=1) and the ops' own inputs (seed 11, normal draws):

- dense, at each --ctx: our kept `logits_topk_cute` (bf16 op) and
  `logits_topk_fp8_cute` (fp8 op), DeepGEMM `fp8_mqa_logits` + `torch.topk`, DeepGEMM
  `fp8_mqa_logits` + our CuTe select as a separate top-k (`separate_select.py`: a
  histogram pass, then the select our kernels end with), DeepGEMM's logits alone (two
  modes: its default strided output, and the compact one the select needs), and torch
  eager (each op's `baseline.py`);
- paged FP8 (`dsa_indexer_topk_paged_fp8`) at 64 sequences of 256K ("equal") and at the
  op's long-tailed mix up to 256K ("mixed"): our `logits_topk_paged_fp8_cute`, DeepGEMM `fp8_paged_mqa_logits` (the op's
  64-token blocks are DeepGEMM's Hopper block size; the cache is repacked into its fused
  layout, each block's 64x128 e4m3 values then its 64 float32 scales) + `torch.topk`
  over each row's valid prefix (the logits past it are unwritten, so they are set to
  -inf first, and -1 pads rows shorter than top-k, as the op wants), the same + our
  select, the logits alone, and torch eager. DeepGEMM's schedule metadata
  (`get_paged_mqa_logits_metadata`) is computed once per batch outside the timed graph,
  as an engine computes it once per step for all layers.

Each entry is checked against its op's reference with the op's own check (top-k sets
compared by score, within the op's tolerance) on the very inputs it is timed on, before
it is timed; an entry that fails is reported and not timed. Timing is the harness's
protocol (`runners/harness/timing.py`, as `indexer_points.timed_replay` does it): each
entry captured once in a CUDA graph, then `--rounds` rounds in which every entry of a
case is replayed once, in an order rotated each round, the L2 flushed before each
replay by writing twice its size, the GPU held busy while the host queues the events
and the replay, timed by CUDA events. Reported: median and 10th-90th percentiles.

The same run measures the ceilings the floors use: an 8192^3 e4m3 `torch._scaled_mm`
(unit scales, bf16 out; with and without fast accumulation) and an 8192^3 bf16 matmul,
on random data. Each entry's floor is its op's FLOPs at the measured peak of its
dtype (e4m3 with fast accumulation for the FP8 ops, bf16 for the bf16 op) or its op's
bytes at 4.8 TB/s, whichever is longer.

Writes DIR/results.jsonl (one line per entry and case, every replay's time), DIR/peaks.json,
DIR/table.md, and prints the table last. Needs torch on a GPU, DeepGEMM importable
(`bench/h200/build_references.sh` builds it), and CuTe DSL on PYTHONPATH unless
--no-cute. `--device cpu` runs the torch paths and a torch stand-in for DeepGEMM's two
calls (`--fake-deepgemm`) at the ops' CPU shapes: a check of the adapters, no timing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = next(p for p in HERE.parents if (p / "runners").is_dir())
sys.path[:0] = [str(HERE), str(ROOT / "bench/h200"), str(ROOT)]

import torch  # noqa: E402
from indexer_points import capture_graph, load, timed_replay  # noqa: E402

from runners.ops import get_op  # noqa: E402

HBM_GBPS = 4800.0  # the H200's datasheet HBM3e bandwidth, the floors' memory term
PEAK_SIZE = 8192
SEED, DISTRIBUTION = 11, "normal"

OURS_BF16 = "ours: logits_topk_cute (bf16)"
OURS_FP8 = "ours: logits_topk_fp8_cute (fp8)"
OURS_PAGED_FP8 = "ours: logits_topk_paged_fp8_cute (paged fp8)"
DG_DENSE_TOPK = "DeepGEMM fp8_mqa_logits + torch.topk"
DG_DENSE_TOPK_COMPACT = "DeepGEMM fp8_mqa_logits (compact) + torch.topk"
DG_DENSE_SELECT = "DeepGEMM fp8_mqa_logits + our CuTe select"
DG_DENSE_LOGITS = "DeepGEMM fp8_mqa_logits alone (strided)"
DG_DENSE_LOGITS_COMPACT = "DeepGEMM fp8_mqa_logits alone (compact)"
DG_PAGED_TOPK = "DeepGEMM fp8_paged_mqa_logits + torch.topk"
DG_PAGED_SELECT = "DeepGEMM fp8_paged_mqa_logits + our CuTe select"
DG_PAGED_LOGITS = "DeepGEMM fp8_paged_mqa_logits alone"
EAGER_BF16 = "torch eager (bf16 op baseline)"
EAGER_FP8 = "torch eager (fp8 op baseline)"
EAGER_PAGED_FP8 = "torch eager (paged fp8 op baseline)"


@dataclass
class Entry:
    label: str
    op: Any
    workload: Any
    inputs: dict  # the op's inputs, which the check reads and `run` is made from
    run: Callable[[], torch.Tensor]
    # Turns the entry's output into the op's output, for the check: logits-alone
    # entries are checked through a top-k of their logits.
    to_indices: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
    component: bool = False  # a part of a pipeline (logits alone), not a whole top-k
    result: dict = field(default_factory=dict)


@dataclass
class Case:
    name: str
    # The DeepGEMM + torch.topk entries: the fastest of them is what the others are compared with.
    reference_labels: tuple[str, ...]
    entries: list[Entry]


# --- DeepGEMM adapters ------------------------------------------------------------------


def dense_deepgemm(dg, inputs: dict, compact: bool) -> Callable[[], torch.Tensor]:
    """fp8_mqa_logits on the dense FP8 op's inputs: every row sees keys [0, N). Its
    default output is [rows, N] inside rows of N + 256 rounded to 1 KB (`compact`:
    max_seqlen_k=N, the same logits in rows of exactly N, as the select reads them).
    Nothing lies outside [0, N), so clean_logits has nothing to clean: off."""
    q, k, k_scale = inputs["q"].contiguous(), inputs["k"].contiguous(), inputs["k_scale"].contiguous()
    weights = inputs["weights"].float().contiguous()
    rows, context = q.shape[0], k.shape[0]
    starts = torch.zeros(rows, dtype=torch.int32, device=q.device)
    ends = torch.full((rows,), context, dtype=torch.int32, device=q.device)
    width = context if compact else 0
    return lambda: dg.fp8_mqa_logits(q, (k, k_scale), weights, starts, ends,
                                     clean_logits=False, max_seqlen_k=width)


def fused_fp8_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """The op's cache ([blocks, 64, D] e4m3 and [blocks, 64] float32 scales) in DeepGEMM's
    fused layout: per block its 64 x D values, then its 64 scales, as bytes, viewed
    [blocks, 64, 1, D + 4] (tests/test_attention.py's kv_cache_cast_to_fp8)."""
    blocks, block_size, dim = kv_cache.shape
    fused = torch.empty(blocks, block_size * (dim + 4), dtype=torch.uint8, device=kv_cache.device)
    fused[:, :block_size * dim] = kv_cache.reshape(blocks, -1).view(torch.uint8)
    fused[:, block_size * dim:] = kv_scale.float().reshape(blocks, -1).contiguous().view(torch.uint8)
    return fused.view(blocks, block_size, 1, dim + 4)


def paged_deepgemm(dg, op, inputs: dict) -> tuple[Callable[[], torch.Tensor], torch.Tensor, int]:
    """fp8_paged_mqa_logits on the paged FP8 op's inputs: (call, each row's prefix length
    [rows] int64, logits width). Context lengths go in per row, [B, next_n] (the only form
    it takes): the number of tokens row (b, j) sees."""
    q = inputs["q"].contiguous()
    batch, next_n = q.shape[:2]
    block_size = inputs["kv_cache"].shape[1]
    fused = fused_fp8_cache(inputs["kv_cache"], inputs["kv_scale"])
    prefixes = op.prefix_lengths(inputs)
    context_lens = prefixes.view(batch, next_n).to(torch.int32).contiguous()
    table = inputs["block_table"].to(torch.int32).contiguous()
    weights = inputs["weights"].float().contiguous()
    width = table.shape[1] * block_size
    # Per batch, not per call: an engine computes it once a step for every layer.
    meta = dg.get_paged_mqa_logits_metadata(context_lens, block_size, dg.get_num_sms())
    return (lambda: dg.fp8_paged_mqa_logits(q, fused, weights, context_lens, table, meta, width, False),
            prefixes, width)


def masked_topk(logits: torch.Tensor, prefixes: torch.Tensor, topk: int) -> torch.Tensor:
    """torch.topk over each row's first prefixes[row] logits, -1 where a row has fewer
    than topk (the paged op's baseline does the same after its own scores)."""
    positions = torch.arange(logits.shape[1], device=logits.device)
    logits.masked_fill_(positions >= prefixes.unsqueeze(1), float("-inf"))
    top = logits.topk(topk, dim=1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)


class FakeDeepGEMM:
    """DeepGEMM's two calls in torch, for checking the adapters on a CPU: the same
    arguments, layouts and unwritten tails (NaN where DeepGEMM leaves memory unset)."""

    @staticmethod
    def get_num_sms() -> int:
        return 132

    @staticmethod
    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
        assert context_lens.dim() == 2 and block_kv == 64
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    @staticmethod
    def _scores(q, keys, weights):  # q [rows, H, D], keys [N, D] float32
        return torch.einsum("mhn,mh->mn", torch.einsum("mhd,nd->mhn", q.float(), keys).relu(), weights)

    def fp8_mqa_logits(self, q, kv, weights, starts, ends, clean_logits=True, max_seqlen_k=0):
        k, scale = kv
        assert q.dtype == k.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        rows, context = q.shape[0], k.shape[0]
        stride = max_seqlen_k or context + 256
        out = torch.full((rows, stride), float("nan"))
        out[:, :context] = self._scores(q, k.float() * scale[:, None], weights)
        return out[:, :max_seqlen_k or context]

    def fp8_paged_mqa_logits(self, q, fused, weights, context_lens, table, meta, width, clean):
        blocks, block_size, _, row_bytes = fused.shape
        dim = row_bytes - 4
        raw = fused.view(blocks, -1)
        values = raw[:, :block_size * dim].contiguous().view(torch.float8_e4m3fn).view(blocks, block_size, dim)
        scales = raw[:, block_size * dim:].contiguous().view(torch.float32).view(blocks, block_size)
        keys = values.float() * scales[..., None]
        batch, next_n = q.shape[:2]
        out = torch.full((batch * next_n, width), float("nan"))
        for b in range(batch):
            for j in range(next_n):
                seen = int(context_lens[b, j])
                if seen:
                    row_keys = keys[table[b, :-(-seen // block_size)].long()].reshape(-1, dim)[:seen]
                    out[b * next_n + j, :seen] = self._scores(q[b, j:j + 1], row_keys, weights[b * next_n + j:][:1])[0]
        return out


# --- cases ------------------------------------------------------------------------------


def kernel_forward(op, name: str):
    """A kernel of the op, at the PARAMS its file holds (the kept point)."""
    return load(op.kernels()[name], f"vs_production_{op.name}_{name}").forward


def dense_case(context: int, device: str, dg, cute: bool) -> Case:
    bf16_op, fp8_op = get_op("dsa_indexer_topk"), get_op("dsa_indexer_topk_fp8")
    shape_device = "cuda" if device == "cuda" else "cpu"
    entries = []
    bf16_workload = bf16_op.workloads(shape_device, [context], bf16_op.default_batch_sizes(shape_device))[0]
    bf16_inputs = bf16_op.make_inputs(bf16_workload, SEED, DISTRIBUTION)
    fp8_workload = fp8_op.workloads(shape_device, [context], fp8_op.default_batch_sizes(shape_device))[0]
    fp8_inputs = fp8_op.make_inputs(fp8_workload, SEED, DISTRIBUTION)
    topk = fp8_inputs["topk"]

    def with_bf16(label, run, **kw):
        entries.append(Entry(label, bf16_op, bf16_workload, bf16_inputs, run, **kw))

    def with_fp8(label, run, **kw):
        entries.append(Entry(label, fp8_op, fp8_workload, fp8_inputs, run, **kw))

    if cute:
        ours_bf16 = kernel_forward(bf16_op, "logits_topk_cute")
        with_bf16(OURS_BF16, lambda: ours_bf16(*bf16_inputs.values()))
        ours_fp8 = kernel_forward(fp8_op, "logits_topk_fp8_cute")
        with_fp8(OURS_FP8, lambda: ours_fp8(*fp8_inputs.values()))
    if dg is not None:
        strided = dense_deepgemm(dg, fp8_inputs, compact=False)
        compact = dense_deepgemm(dg, fp8_inputs, compact=True)
        with_fp8(DG_DENSE_TOPK, lambda: strided().topk(topk, dim=1).indices)
        with_fp8(DG_DENSE_TOPK_COMPACT, lambda: compact().topk(topk, dim=1).indices)
        if cute:
            import separate_select

            rows = fp8_inputs["q"].shape[0]
            separate_select.compile_for(rows, context, topk)
            lengths = torch.full((rows,), context, dtype=torch.int32, device=device)
            with_fp8(DG_DENSE_SELECT, lambda: separate_select.select(compact(), lengths, topk, pad=False))
        top = lambda logits: logits.topk(topk, dim=1).indices  # noqa: E731
        with_fp8(DG_DENSE_LOGITS, strided, to_indices=top, component=True)
        with_fp8(DG_DENSE_LOGITS_COMPACT, compact, to_indices=top, component=True)
    eager_bf16 = load(bf16_op.baseline_path, "vs_production_eager_bf16").forward
    with_bf16(EAGER_BF16, lambda: eager_bf16(*bf16_inputs.values()))
    eager_fp8 = load(fp8_op.baseline_path, "vs_production_eager_fp8").forward
    with_fp8(EAGER_FP8, lambda: eager_fp8(*fp8_inputs.values()))
    return Case(f"dense {context // 1024}K", (DG_DENSE_TOPK, DG_DENSE_TOPK_COMPACT), entries)


def paged_case(mix: str, context: int, device: str, dg, cute: bool) -> Case:
    op = get_op("dsa_indexer_topk_paged_fp8")
    shape_device = "cuda" if device == "cuda" else "cpu"
    workloads = op.workloads(shape_device, [context], op.default_batch_sizes(shape_device))
    workload = next(w for w in workloads if w.params["mix"] == mix and w.params["next_n"] == 1)
    inputs = op.make_inputs(workload, SEED, DISTRIBUTION)
    topk = inputs["topk"]
    entries = []

    def add(label, run, **kw):
        entries.append(Entry(label, op, workload, inputs, run, **kw))

    if cute:
        ours = kernel_forward(op, "logits_topk_paged_fp8_cute")
        add(OURS_PAGED_FP8, lambda: ours(*inputs.values()))
    if dg is not None:
        logits, prefixes, width = paged_deepgemm(dg, op, inputs)
        add(DG_PAGED_TOPK, lambda: masked_topk(logits(), prefixes, topk))
        if cute:
            import separate_select

            separate_select.compile_for(prefixes.shape[0], width, topk)
            lengths = prefixes.to(torch.int32)
            add(DG_PAGED_SELECT, lambda: separate_select.select(logits(), lengths, topk, pad=True))
        add(DG_PAGED_LOGITS, logits, to_indices=lambda out: masked_topk(out, prefixes, topk), component=True)
    eager = load(op.baseline_path, "vs_production_eager_paged_fp8").forward
    add(EAGER_PAGED_FP8, lambda: eager(*inputs.values()))
    p = workload.params
    label = "all-" if mix == "equal" else "mixed <="
    return Case(f"paged {label}{context // 1024}K, {p['tokens']:,} tokens", (DG_PAGED_TOPK,), entries)


# --- checks, ceilings, timing ---------------------------------------------------------


def check_entries(case: Case) -> None:
    """Each entry against its op's reference, on the inputs it is timed on; a wrong or
    failing entry is marked and left out of the timing."""
    references: dict[int, torch.Tensor] = {}
    for entry in case.entries:
        inputs = entry.inputs
        key = id(inputs)
        try:
            if key not in references:
                references[key] = entry.op.reference({k: v.clone() if hasattr(v, "clone") else v
                                                      for k, v in inputs.items()})
            out = entry.to_indices(entry.run())
            correct, detail = entry.op.check(out, references[key], inputs)
        except Exception as error:  # noqa: BLE001 - one entry's failure must not end the run
            correct, detail = False, f"{type(error).__name__}: {error}"
            traceback.print_exc()
        entry.result.update(correct=correct, check=detail)
        print(f"  check {entry.label}: {'ok' if correct else 'FAILED'} ({detail})", file=sys.stderr, flush=True)
    references.clear()


def matmul_peaks(device: str) -> dict[str, float]:
    """TFLOP/s of an 8192^3 bf16 matmul and e4m3 _scaled_mm (unit scales, bf16 out, with
    and without fast accumulation) on random data: the median of 5 timings of 20 calls."""
    if device != "cuda":
        return {}
    n = PEAK_SIZE
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator)
    b = torch.randn(n, n, device=device, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    calls = {
        "bf16_tflops": lambda: a16 @ b16.T,
        "e4m3_tflops": lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "e4m3_fast_accum_tflops": lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16, use_fast_accum=True),
    }
    peaks = {}
    for name, call in calls.items():
        for _ in range(5):
            call()
        per_call = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                call()
            end.record()
            torch.cuda.synchronize()
            per_call.append(start.elapsed_time(end) / 20)
        peaks[name] = 2 * n**3 / (statistics.median(per_call) * 1e-3) / 1e12
        peaks[name.replace("tflops", "ms")] = statistics.median(per_call)
    return peaks


def floor_of(entry: Entry, peaks: dict[str, float]) -> float | None:
    """ms: the op's FLOPs at the measured peak of its dtype, or its bytes at 4.8 TB/s."""
    if not peaks:
        return None
    fp8 = "fp8" in entry.op.name
    tflops = max(peaks["e4m3_tflops"], peaks["e4m3_fast_accum_tflops"]) if fp8 else peaks["bf16_tflops"]
    compute = entry.op.flops(entry.workload) / (tflops * 1e12)
    memory = entry.op.bytes(entry.workload) / (HBM_GBPS * 1e9)
    return max(compute, memory) * 1e3


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def time_case(case: Case, rounds: int, flush: torch.Tensor | None) -> None:
    timed = [e for e in case.entries if e.result.get("correct")]
    if flush is None:  # on a CPU: one plain call each, to exercise the path
        for entry in timed:
            start = time.perf_counter()
            entry.run()
            entry.result["times_ms"] = [(time.perf_counter() - start) * 1e3]
        return
    graphs = {}
    for entry in timed:
        try:
            graphs[entry.label] = capture_graph(lambda *_: entry.run(), [])
        except Exception as error:  # noqa: BLE001
            entry.result.update(correct=False, check=f"capture failed: {type(error).__name__}: {error}")
            traceback.print_exc()
    names = list(graphs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(rounds):
        shift = round_number % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            times[name].append(timed_replay(graphs[name], flush))
    for entry in timed:
        if entry.label in times:
            entry.result["times_ms"] = times[entry.label]
    graphs.clear()


def summarize(case: Case, peaks: dict[str, float]) -> list[dict]:
    rows = []
    references = [statistics.median(e.result["times_ms"]) for e in case.entries
                  if e.label in case.reference_labels and e.result.get("times_ms")]
    reference_ms = min(references, default=None)
    for entry in case.entries:
        values = entry.result.get("times_ms")
        row = {"case": case.name, "entry": entry.label, "op": entry.op.name, "workload": entry.workload.name,
               "component": entry.component, "correct": entry.result.get("correct"),
               "check": entry.result.get("check"), "flops": entry.op.flops(entry.workload),
               "bytes": entry.op.bytes(entry.workload), "floor_ms": floor_of(entry, peaks)}
        if values:
            median = statistics.median(values)
            row.update(median_ms=median, p10_ms=percentile(values, 0.1), p90_ms=percentile(values, 0.9),
                       replays=len(values), times_ms=values,
                       vs_deepgemm_topk=reference_ms / median if reference_ms else None,
                       vs_floor=median / row["floor_ms"] if row["floor_ms"] else None)
        rows.append(row)
    return rows


def table(rows: list[dict], peaks: dict[str, float]) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| kernel | shape | median ms [p10, p90] | x vs DeepGEMM + torch.topk (faster variant) | x floor (floor ms) |",
             "|---|---|---|---|---|"]
    for row in rows:
        if "median_ms" not in row:
            lines.append(f"| {row['entry']} | {row['case']} | not timed: {row['check']} | - | - |")
            continue
        lines.append(
            f"| {row['entry']} | {row['case']} | {row['median_ms']:.3f} [{row['p10_ms']:.3f}, {row['p90_ms']:.3f}] | "
            f"{fmt(row['vs_deepgemm_topk'], '.2f')} | {fmt(row['vs_floor'], '.2f')} ({fmt(row['floor_ms'], '.3f')}) |")
    if peaks:
        lines.append("")
        lines.append(f"Measured in this run: bf16 matmul {peaks['bf16_tflops']:.0f} TFLOP/s, e4m3 _scaled_mm "
                     f"{peaks['e4m3_tflops']:.0f} TFLOP/s ({peaks['e4m3_fast_accum_tflops']:.0f} with fast "
                     f"accumulation, the FP8 floors' peak), {PEAK_SIZE}^3, random data; memory term at "
                     f"{HBM_GBPS / 1000:.1f} TB/s.")
    return "\n".join(lines)


def environment(device: str, dg) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, l2_bytes=props.L2_cache_size)
    if dg is not None and not isinstance(dg, FakeDeepGEMM):
        info["deep_gemm"] = f"{getattr(dg, '__version__', '?')} at {Path(dg.__file__).parent}"
    try:
        import cutlass

        info["cutlass_dsl"] = getattr(cutlass, "__version__", "present")
    except ImportError:
        info["cutlass_dsl"] = None
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", default="32768,131072,262144", help="dense contexts")
    parser.add_argument("--paged", default="equal,mixed", help="paged FP8 mixes at 256K ('' for none)")
    parser.add_argument("--paged-ctx", type=int, default=262144)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--no-cute", action="store_true", help="leave out every CuTe DSL entry")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--fake-deepgemm", action="store_true", help="a torch stand-in for DeepGEMM (CPU check)")
    parser.add_argument("--out", type=Path, default=Path("vs_production"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cute = not args.no_cute
    if cute:
        try:
            import cutlass.cute  # noqa: F401
        except ImportError as error:  # the run goes on with the entries that need no CuTe DSL
            print(f"CuTe DSL not importable, its entries left out: {error}", file=sys.stderr)
            cute = False

    dg = None
    if args.fake_deepgemm:
        dg = FakeDeepGEMM()
    else:
        try:
            import deep_gemm as dg
        except Exception as error:  # noqa: BLE001 - the run goes on without DeepGEMM's entries
            print(f"DeepGEMM not importable, its entries left out: {type(error).__name__}: {error}", file=sys.stderr)
    info = environment(args.device, dg)
    print(json.dumps(info), file=sys.stderr, flush=True)

    peaks = matmul_peaks(args.device)
    (args.out / "peaks.json").write_text(json.dumps({**peaks, "environment": info}, indent=1) + "\n")
    print(f"peaks: {json.dumps(peaks)}", file=sys.stderr, flush=True)
    flush = None
    if args.device == "cuda":
        l2 = torch.cuda.get_device_properties(0).L2_cache_size or 64 * 2**20
        flush = torch.empty(2 * l2 // 4, dtype=torch.float32, device="cuda")

    builders = [lambda c=c: dense_case(c, args.device, dg, cute) for c in (int(x) for x in args.ctx.split(",") if x)]
    builders += [lambda m=m: paged_case(m, args.paged_ctx, args.device, dg, cute)
                 for m in (x for x in args.paged.split(",") if x)]
    rows: list[dict] = []
    with (args.out / "results.jsonl").open("w") as out:
        for build in builders:
            started = time.time()
            try:
                case = build()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                continue
            print(f"{case.name}: inputs made", file=sys.stderr, flush=True)
            check_entries(case)
            time_case(case, args.rounds, flush)
            case_rows = summarize(case, peaks)
            for row in case_rows:
                out.write(json.dumps(row) + "\n")
            out.flush()
            rows += case_rows
            print(f"{case.name}: " + ", ".join(f"{r['entry']} {r.get('median_ms', float('nan')):.3f}" for r in case_rows)
                  + f" ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
            del case
            if args.device == "cuda":
                torch.cuda.empty_cache()
    report = table(rows, peaks)
    (args.out / "table.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
