"""A compiled CuTe program called with torch tensors reads each call's own extents.

The indexer kernels compile once per shape with the context, batch and table widths as
runtime values (fake tensors with cute.sym_int extents), then take tensors of any
length. A tensor from `from_dlpack` is static: handed to such a program it passed no
extents, and the program read whatever lay past its descriptor (on the GPU, a grid of
0 CTAs that CUDA refused). `runners.kernel_lib.cute_host.Program` passes each
torch tensor as its fake describes it. A host-only program shows what it reads (the
JIT's host code runs on a CPU; no kernel is launched).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from runners.harness.dsl import child_environment

import cutlass.cute  # noqa: F401,E402 — a dependency: its absence must fail, not skip

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent('''
    import sys

    import torch

    import cutlass
    import cutlass.cute as cute

    from runners.kernel_lib.cute_host import Program, fake_tensor


    @cute.jit
    def show(scores: cute.Tensor, hist: cute.Tensor, lengths: cute.Tensor, out: cute.Tensor):
        cute.printf("scores {} {} hist {} {} lengths {} out {}", scores.shape, scores.layout.stride,
                    hist.shape, hist.layout.stride, lengths.shape, out.shape)
        cute.printf("read {} {} {}", scores[1, 2], hist[1, 2, 3], lengths[2])


    # The select's arguments: rows of a runtime length (a multiple of 4), runtime
    # split and row counts, a runtime batch, a static output.
    runtime = cute.sym_int32
    arguments = (fake_tensor(cutlass.Float32, (64, runtime(divisibility=4))),
                 fake_tensor(cutlass.Int32, (runtime(), runtime(), 2048)),
                 fake_tensor(cutlass.Int32, (runtime(),)), fake_tensor(cutlass.Int64, (64, 16)))
    program = Program(cute.compile(show, *arguments), arguments)
    for length, splits, rows in ((100, 3, 5), (4096, 7, 4)):
        scores = torch.arange(64 * length, dtype=torch.float32).view(64, length)
        hist = torch.arange(splits * rows * 2048, dtype=torch.int32).view(splits, rows, 2048)
        lengths = torch.arange(10, 10 + 2 * rows, dtype=torch.int32)
        out = torch.empty(64, 16, dtype=torch.int64)
        print(f"want {scores[1, 2]:.6f} {hist[1, 2, 3]} {lengths[2]}", flush=True)
        program(scores, hist, lengths, out)
        sys.stdout.flush()
    try:
        program(scores, hist, lengths, torch.empty(64, 32, dtype=torch.int64))
    except ValueError as refused:
        print("refused:", refused, flush=True)
''')


def _run(tmp_path) -> list[str]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {**os.environ, **child_environment("cute", "cpu", tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_a_program_compiled_for_runtime_extents_reads_each_calls_own(tmp_path):
    lines = _run(tmp_path)
    assert lines[:6] == [
        "want 102.000000 14339 12",
        "scores (64,100) (100,1) hist (3,5,2048) (10240,2048,1) lengths (10) out (64,16)",
        "read 102.000000 14339 12",
        "want 4098.000000 12291 12",
        "scores (64,4096) (4096,1) hist (7,4,2048) (8192,2048,1) lengths (8) out (64,16)",
        "read 4098.000000 12291 12",
    ]
    # A tensor whose static extents differ from the program's is refused before the call.
    assert lines[6] == "refused: a tensor of shape (64, 32) for a program compiled for (64, 16)"

