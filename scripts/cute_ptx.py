"""Writes the PTX of the shipped CuTe indexer kernels, one file per kernel and build, so a
change that should not change the generated code (moving shared code into
runners/kernel_lib, renaming) can be shown not to: run it before and after, then
`diff -r BEFORE AFTER`. Compiles for sm_90a on the CPU; no GPU needed.

    CUTE_DSL_ARCH=sm_90a python scripts/cute_ptx.py OUT_FOLDER [--tree ROOT]

`--tree` reads the kernels from another checkout of the project (say, `git archive` of
an earlier commit), importing that tree's runners/kernel_lib too.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import torch

import ptx_tree  # beside this script: what both PTX scripts share

KERNELS = {
    "dense": "runners/ops/dsa_indexer_topk/kernels/logits_topk_cute.py",
    "dense_fp8": "runners/ops/dsa_indexer_topk_fp8/kernels/logits_topk_fp8_cute.py",
    "paged": "runners/ops/dsa_indexer_topk_paged/kernels/logits_topk_paged_cute.py",
    "paged_fp8": "runners/ops/dsa_indexer_topk_paged_fp8/kernels/logits_topk_paged_fp8_cute.py",
}
SCHEDULES = {"dense": ("cooperative", "pingpong", "roundrobin"), "dense_fp8": ("cooperative", "pingpong", "roundrobin"),
             "paged": ("pingpong", "roundrobin"), "paged_fp8": ("pingpong", "roundrobin")}
REDUCTIONS = ("shuffle", "scatter", "mma")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _builds(kind: str, module):
    """(name, a function that compiles it) of every build compared."""
    rows = 2 if kind.startswith("dense") else None
    for schedule in SCHEDULES[kind]:
        for reduce in REDUCTIONS:
            if kind == "dense":
                yield f"scores_{schedule}_{reduce}", lambda s=schedule, r=reduce: module.compiled_scores_mma(
                    torch.bfloat16, 3, 64, 128, rows, 3, torch.float32, s, r)
            elif kind == "dense_fp8":
                yield f"scores_{schedule}_{reduce}", lambda s=schedule, r=reduce: module.compiled_scores_mma(
                    3, 64, 128, rows, 3, torch.float32, s, r)
            elif kind == "paged":
                yield f"scores_{schedule}_{reduce}", lambda s=schedule, r=reduce: module.compiled_scores_mma(
                    torch.bfloat16, 64, 128, 1, 6, s, r, 8192)
            else:
                yield f"scores_{schedule}_{reduce}", lambda s=schedule, r=reduce: module.compiled_scores_mma(
                    64, 128, 1, 6, s, r, 8192)
    for by_bitmap in (True, False):
        if kind.startswith("dense"):
            for vec in (4, 1):
                yield f"select_vec{vec}_bitmap{int(by_bitmap)}", lambda v=vec, b=by_bitmap: module.compiled_select(
                    3, 2048, 1024, v, b)
        else:
            yield f"select_bitmap{int(by_bitmap)}", lambda b=by_bitmap: module.compiled_select(1, 2048, 8192, 1024, b)
    if kind == "dense":
        yield "scores_simt", lambda: module.compiled_scores_simt(3, 64, 128)


def main() -> int:
    args = ptx_tree.arguments(__doc__)
    for kind, relative in KERNELS.items():
        module = _load(args.tree / relative, f"ptx_{kind}")
        for name, build in _builds(kind, module):
            ptx = build().artifacts.PTX
            if not ptx.lstrip().startswith(("//", ".")):  # a path under CUTE_DSL_DUMP_DIR
                ptx = Path(ptx).read_text()
            # The compiler's version line and file names are not the code.
            ptx = re.sub(r"^//.*$", "", ptx, flags=re.M)
            ptx_tree.write(args.out, f"{kind}_{name}", ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
