"""Shows that a change to the CuTe indexer kernels or runners/kernel_lib left their
generated code as it was: `dump` writes the PTX of every compiled kernel of the four
indexers, `compare` says which differ between two dumps. Compiles for sm_90a on the
CPU (CUTE_DSL_ARCH, unless set otherwise); no GPU needed.

    python scripts/cute_ptx.py dump BEFORE --tree OLD_CHECKOUT [--kernels dense paged ...]
    python scripts/cute_ptx.py dump AFTER
    python scripts/cute_ptx.py compare BEFORE AFTER

`dump` compiles each kernel file as the harness runs it, one materialised SPACE point
at a time (and PARAMS), with the arguments its forward would pass at 64 heads, D=128
(and a few other dtypes and shapes), next_n 1 and 2 for the paged kernels, every
select bucket; builds that repeat across points are compiled once. `--tree` reads the
kernels and runners/kernel_lib from another checkout (say, `git archive` of an earlier
commit). The PTX is written as the compiler gave it.

`compare` first drops what cannot change the code: comment lines (the compiler's
version) and debug lines (`.loc`, `.file`), and it names the kernel's entry `KERNEL0`
(its mangled name spells the Python function's name and its arguments' types, and the
name of each parameter starts with it). It prints each build whose PTX differs and
each kernel name that changed, and exits 1 if any PTX differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

KERNELS = {
    "dense": "runners/ops/dsa_indexer_topk/kernels/logits_topk_cute.py",
    "dense_fp8": "runners/ops/dsa_indexer_topk_fp8/kernels/logits_topk_fp8_cute.py",
    "paged": "runners/ops/dsa_indexer_topk_paged/kernels/logits_topk_paged_cute.py",
    "paged_fp8": "runners/ops/dsa_indexer_topk_paged_fp8/kernels/logits_topk_paged_fp8_cute.py",
}
HEADS, DIM, TOPK = 64, 128, 2048
# Past 128 heads a CTA holds one query row (ROWS=1 paths); 32 heads fill half a wgmma N.
OTHER_HEADS = (32, 256)


def _load(source: str, name: str, scratch: Path):
    """The kernel as the harness loads a point of it: the materialised file, imported."""
    candidate = scratch / f"{name}.py"
    candidate.write_text(source)
    spec = importlib.util.spec_from_file_location(name, candidate)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _label(point: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in point.items())


def _dense_builds(kind: str, module, point: dict) -> Iterator[tuple[str, Callable]]:
    import torch

    schedule, reduce, stages = point["SCHEDULE"], point["REDUCE"], point["STAGES"]
    # (heads, q and k dtype, weights dtype); the e4m3 kernel's q and k are e4m3 always.
    dtype = torch.bfloat16 if kind == "dense" else torch.float8_e4m3fn
    shapes = [(HEADS, dtype, torch.float32)]
    if point.get("is_params"):
        shapes += [(HEADS, torch.float16 if kind == "dense" else dtype, torch.bfloat16)]
        shapes += [(heads, dtype, torch.float32) for heads in OTHER_HEADS]
    for heads, dtype, weight_dtype in shapes:
        rows = module.mma_rows(point["ROWS"], heads, schedule)
        if schedule == "roundrobin" and rows * heads > 128:
            continue
        name = (f"scores_rows{rows}_stages{stages}_{schedule}_{reduce}_h{heads}"
                f"_{str(dtype).split('.')[-1]}_w{str(weight_dtype).split('.')[-1]}")
        if kind == "dense":
            yield name, lambda: module.compiled_scores_mma(
                dtype, heads, DIM, rows, stages, weight_dtype, schedule, reduce)
        else:
            yield name, lambda: module.compiled_scores_mma(
                heads, DIM, rows, stages, weight_dtype, schedule, reduce)
    for vec in (4, 1):
        for by_bitmap in (True, False):
            yield (f"select_threads{point['SELECT_THREADS']}_vec{vec}_bitmap{int(by_bitmap)}",
                   lambda: module.compiled_select(TOPK, point["SELECT_THREADS"], vec, by_bitmap))
    if kind == "dense":
        for weight_dtype in (torch.float32, torch.bfloat16):
            yield (f"scores_simt_w{str(weight_dtype).split('.')[-1]}",
                   lambda: module.compiled_scores_simt(HEADS, DIM, weight_dtype))


def _paged_builds(kind: str, module, point: dict) -> Iterator[tuple[str, Callable]]:
    import torch

    schedule, reduce, stages, span = point["SCHEDULE"], point["REDUCE"], point["STAGES"], point["SPAN"]
    dtypes = [torch.bfloat16, torch.float16] if kind == "paged" and point.get("is_params") else [torch.bfloat16]
    for next_n in (1, 2):
        for dtype in dtypes:
            name = f"scores_next{next_n}_stages{stages}_{schedule}_{reduce}_span{span}_{str(dtype).split('.')[-1]}"
            if kind == "paged":
                yield name, lambda: module.compiled_scores_mma(
                    dtype, HEADS, DIM, next_n, stages, schedule, reduce, span)
            else:
                yield name, lambda: module.compiled_scores_mma(HEADS, DIM, next_n, stages, schedule, reduce, span)
        for by_bitmap in (True, False):
            yield (f"select_next{next_n}_span{span}_threads{point['SELECT_THREADS']}_bitmap{int(by_bitmap)}",
                   lambda: module.compiled_select(next_n, TOPK, span, point["SELECT_THREADS"], by_bitmap))


def _ptx(compiled) -> str:
    ptx = compiled.artifacts.PTX
    if ptx is None:
        raise SystemExit("no PTX kept: run with CUTE_DSL_KEEP=ptx (dump sets it when unset)")
    if not ptx.lstrip().startswith(("//", ".")):  # a path under CUTE_DSL_DUMP_DIR
        ptx = Path(ptx).read_text()
    return ptx


def dump(out: Path, tree: Path, kinds: list[str]) -> int:
    from runners.space import grid_points, materialize, read_literals

    import runners.kernel_lib

    if Path(runners.kernel_lib.__file__).resolve().parent != (tree / "runners/kernel_lib").resolve():
        raise SystemExit(f"runners.kernel_lib resolves to {runners.kernel_lib.__file__}, not {tree}'s")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cute-ptx-"))
    count = 0
    for kind in kinds:
        relative = KERNELS[kind]
        source = (tree / relative).read_text()
        params, space = read_literals(source)
        points = [{**params, "is_params": True}] + grid_points(space)
        done: set[str] = set()
        for index, point in enumerate(points):
            values = {key: value for key, value in point.items() if key != "is_params"}
            module = _load(materialize(source, values), f"ptx_{kind}_{index}", scratch)
            builds = _dense_builds if kind.startswith("dense") else _paged_builds
            for name, build in builds(kind, module, point):
                if name in done:
                    continue
                done.add(name)
                (out / f"{kind}__{name}.ptx").write_text(_ptx(build()))
                count += 1
                print(f"{kind} {name} ({_label(values)})", flush=True)
    print(f"{count} builds written to {out}")
    return 0


_ENTRY = re.compile(r"^\.(?:visible|weak)?\s*\.entry\s+(\S+?)\(", re.M)


def normalised(ptx: str) -> tuple[str, list[str]]:
    """The PTX less what cannot change the code, and the kernel names it had."""
    names = _ENTRY.findall(ptx)
    lines = [line for line in ptx.splitlines()
             if not line.lstrip().startswith(("//", ".loc", ".file"))]
    text = "\n".join(lines)
    for number, name in enumerate(names):
        text = text.replace(name, f"KERNEL{number}")
    return text, names


def compare(before: Path, after: Path) -> int:
    old = {path.name for path in before.glob("*.ptx")}
    new = {path.name for path in after.glob("*.ptx")}
    differ = 0
    for name in sorted(old ^ new):
        print(f"only in {'before' if name in old else 'after'}: {name}")
        differ += 1
    renamed: dict[tuple[str, str], int] = {}
    for name in sorted(old & new):
        (text_a, names_a), (text_b, names_b) = (
            normalised((folder / name).read_text()) for folder in (before, after))
        if text_a != text_b:
            print(f"PTX differs: {name}")
            differ += 1
        for a, b in zip(names_a, names_b):
            if a != b:
                renamed[(a, b)] = renamed.get((a, b), 0) + 1
    for (a, b), count in sorted(renamed.items()):
        print(f"kernel renamed in {count} builds: {a} -> {b}")
    print(f"{len(old & new)} builds compared, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dump_args = commands.add_parser("dump", help="compile every build and write its PTX")
    dump_args.add_argument("out", type=Path)
    dump_args.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    dump_args.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS),
                           help="which kernels to compile (default: all four)")
    compare_args = commands.add_parser("compare", help="which builds' PTX differ between two dumps")
    compare_args.add_argument("before", type=Path)
    compare_args.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "compare":
        return compare(args.before, args.after)
    # The kernels import runners.kernel_lib from the tree they are read from; the
    # compiled-module cache and kept files go to a fresh folder, so nothing compiled
    # from another tree is reused.
    sys.path.insert(0, str(args.tree.resolve()))
    work = Path(tempfile.mkdtemp(prefix="cute-ptx-work-"))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("CUTE_DSL_KEEP", "ptx")
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", str(work))
    os.environ["CUTE_DSL_CACHE_DIR"] = str(work)
    return dump(args.out, args.tree, args.kernels)


if __name__ == "__main__":
    sys.exit(main())
