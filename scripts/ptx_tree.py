"""What the PTX scripts share (cute_ptx.py, triton_ptx.py): their command line (an output
folder, and the checkout whose kernels and runners/kernel_lib are compiled) and how they
write a kernel's PTX."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def arguments(doc: str) -> argparse.Namespace:
    """OUT and --tree (this checkout by default), with the tree first on sys.path, so its
    runners package is the one imported, and OUT created."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def write(out: Path, name: str, ptx: str) -> None:
    """OUT/NAME.ptx, and a line saying so."""
    (out / f"{name}.ptx").write_text(ptx)
    print(f"{name}: {len(ptx.splitlines())} lines", flush=True)
