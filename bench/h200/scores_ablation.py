"""What the CuTe indexers' scores launches spend their time on: each kept kernel's
scores launch timed alone, beside copies of it with part of its work taken out.

    python3 bench/h200/scores_ablation.py [--ctx 262144] [--replays 30] [--out ablation.jsonl]
        [--files '[["label", "dsa_indexer_topk_fp8", "path/to/kernel.py"]]']

A copy is the kept kernel file with its own copy of the shared scores code the
ablations edit (runners/kernel_lib/indexer_scores.py, whose pieces make up the
kernel's scores, and indexer_select.py's `record`: `with_own_copies`), then edits
(ABLATIONS): "no stores" drops every
score's store and histogram count; "MMA only" (e4m3) drops the stores, the ReLU's
conversion to bfloat16 and the N=8 head-sum MMAs too, leaving the TMA pipeline, the
turns and the big MMAs; "4 head-sum MMAs" and "1 head-sum MMA" (e4m3) issue only the
first half, or the first, of the eight N=8 head-sum MMAs a tile (the conversions
that fed the others go with them). --files adds other kernel files' scores launches
at their own PARAMS (variants, say), timed the same way, after the op's copies. The
copies compute wrong scores: they are timed, never checked (the kept kernels are
checked against the op's reference first; a file given with --files is checked only
where `indexer_targets.py --files` times it). Each launch
is captured alone in a CUDA graph and timed over `--replays` replays with the L2
flushed before each, as `indexer_split.py` does. What a part costs is the kept
launch's time less the copy's, an upper bound where the parts overlap. A scouting tool: its numbers say where to look, they are not results.

Needs torch and CuTe DSL (on PYTHONPATH) on a GPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from indexer_points import check, load, scores_launch, time_graph  # noqa: E402
from indexer_targets import BF16_KEPT, FP8_KEPT  # noqa: E402

from runners.kernel_lib import indexer_scores, indexer_select  # noqa: E402
from runners.ops import get_op  # noqa: E402
from runners.space import materialize  # noqa: E402


def _definition(module, name: str) -> str:
    """The source of a top-level function of a shared module, decorators included."""
    source = Path(module.__file__).read_text()
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "".join(lines[node.decorator_list[0].lineno - 1:node.end_lineno])
    raise SystemExit(f"{module.__name__} no longer defines {name}")


def _body(module) -> str:
    """A shared module's source from its `from __future__` import on, less that line (it
    may only open a file): its imports and definitions, to go after a kernel's own."""
    source = Path(module.__file__).read_text()
    future = "from __future__ import annotations\n"
    if future not in source:
        raise SystemExit(f"{module.__name__} no longer opens with {future.strip()!r}")
    return source[source.index(future) + len(future):]


# The kept kernels' scores are made of indexer_scores.py's pieces, which store through
# indexer_select.py's `record`: a copy of a kernel gets its own copies of both, defined
# last so they are the ones its kernel finds, for the edits to change.
OWN_COPIES = ("\n\n# Own copies of shared code, for the ablations to edit.\n" + _body(indexer_scores)
              + "\n\nfrom runners.kernel_lib.indexer_select import radix_key  # noqa: E402\n\n\n"
              + _definition(indexer_select, "record"))


def with_own_copies(source: str) -> str:
    return source + OWN_COPIES


RECORD = '''    scores[row, token] = score
    digit = cutlass.Int32(radix_key(score) >> cutlass.Uint32(21))
    cute.arch.atomic_add(hist.iterator + hist_row * BINS + digit, cutlass.Int32(1))
'''
_HEAD_SUMS_DEFINITION = _definition(indexer_scores, "head_sums")
# head_sums's body but its return: the ReLU's conversion and the N=8 MMAs.
HEAD_SUMS = _HEAD_SUMS_DEFINITION[_HEAD_SUMS_DEFINITION.index("    packed = "):
                                  _HEAD_SUMS_DEFINITION.index("    warpgroup.commit_group()\n")] \
    + "    warpgroup.commit_group()\n"
# The end of consume, where a warpgroup has waited for its last MMA.
CONSUME_END = '''                            reduce, seq_end, k_scale, ahead)


@cute.jit
def _tile_block('''
# (label, [(text in the kept file, its replacement)]): the edits of each copy. A copy
# keeps one use of what it no longer stores, one the compiler cannot prove dead (a score
# of exactly -1e30), or it would drop the MMAs that feed it as well: a first try without
# it timed the bf16 scores at 3.3 PFLOP/s. Without the head sums, the accumulator is
# read once, after the warpgroup's last MMA: read inside the loop, while the next
# tile's wgmma writes it, it made ptxas serialize every wgmma (0.615 ms at 256K, where
# the kept launch takes 0.243).
NO_STORES = (RECORD, """    if score == cutlass.Float32(-1.0e30):
        scores[row, token] = score
""")
NO_HEAD_SUMS = (HEAD_SUMS, "    warpgroup.commit_group()\n")
HEAD_SUM_LOOP = "    for kb in cutlass.range_constexpr(cols // 16):\n        head_mma.set("
HALF_THE_HEAD_SUMS = (HEAD_SUM_LOOP, HEAD_SUM_LOOP.replace("cols // 16", "cols // 32"))
ONE_HEAD_SUM = (HEAD_SUM_LOOP, HEAD_SUM_LOOP.replace("cols // 16", "1"))
READ_ACC_AT_END = (CONSUME_END, CONSUME_END.replace("\n\n\n", """
    if acc[0] == cutlass.Float32(-1.0e30):
        scores[0, 0] = acc[0]


""", 1))
ABLATIONS = {
    "logits_topk_cute": [("no stores", [NO_STORES])],
    "logits_topk_fp8_cute": [
        ("no stores", [NO_STORES]),
        ("MMA only", [NO_STORES, NO_HEAD_SUMS, READ_ACC_AT_END]),
        ("4 head-sum MMAs", [HALF_THE_HEAD_SUMS]),
        ("1 head-sum MMA", [ONE_HEAD_SUM]),
    ],
}
KEPT = {"dsa_indexer_topk": ("logits_topk_cute", BF16_KEPT), "dsa_indexer_topk_fp8": ("logits_topk_fp8_cute", FP8_KEPT)}


def ablated(source: str, edits: list[tuple[str, str]]) -> str:
    for text, replacement in edits:
        if source.count(text) != 1:
            raise SystemExit(f"the kept kernel no longer holds, once, the text an ablation edits: {text[:60]!r}")
        source = source.replace(text, replacement)
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=262144)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("ablation.jsonl"))
    parser.add_argument("--files", type=json.loads, default=[],
                        help="[[label, op, kernel file]]: more scores launches, at each file's PARAMS")
    args = parser.parse_args()
    flush = torch.empty(2 * 64 * 2**20 // 4, dtype=torch.float32, device="cuda")
    scratch = Path(tempfile.mkdtemp(prefix="scores-ablation-"))
    rows = []
    for op_name, (kernel, point) in KEPT.items():
        op = get_op(op_name)
        kept_source = materialize(op.kernels()[kernel].read_text(), point)
        workload = op.workloads("cuda", [args.ctx], op.default_batch_sizes("cuda"))[0]
        inputs = op.make_inputs(workload, 11, "normal")
        copies = [("kept", kept_source)] + [(label, ablated(with_own_copies(kept_source), edits))
                                            for label, edits in ABLATIONS[kernel]]
        copies += [(label, Path(path).read_text()) for label, file_op, path in args.files if file_op == op_name]
        for index, (label, source) in enumerate(copies):
            file = scratch / f"{kernel}_{index}.py"
            file.write_text(source)
            module = load(file, f"{kernel}_{index}")
            if label == "kept":
                wrong = check(op, module.forward)
                if wrong:
                    raise SystemExit(f"{kernel} is wrong: {wrong}")
            params = module.PARAMS
            launch, _, _ = scores_launch(module, inputs, params["ROWS"], params["STAGES"], params["SCHEDULE"],
                                         params["REDUCE"])
            ms = statistics.median(time_graph(launch, {}, args.replays, flush))
            rows.append({"op": op_name, "kernel": kernel, "copy": label, "context": args.ctx, "scores_ms": ms})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"| kernel | copy | scores launch, ms at {args.ctx // 1024}K |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['kernel']} | {row['copy']} | {row['scores_ms']:.4f} |")


if __name__ == "__main__":
    main()
