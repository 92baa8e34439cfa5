"""Does DeepGEMM's indexer run here? Its logits calls, each in a fresh process, smallest first.

    . /opt/refs.env && python3 bench/h200/deepgemm_smoke.py [--timeout 120]

bench/h200/indexer_vs_production.py needs DeepGEMM's `fp8_mqa_logits` and
`fp8_paged_mqa_logits`. When a call kills its process (a segfault in the first call
was seen once), the side-by-side cannot say which call, input or import did it. Each
case here runs alone in a new interpreter with faulthandler on and DeepGEMM's JIT
debug output (`DG_JIT_DEBUG=1`), so a crash names its case, its signal and the Python
line, and the cases tell the likely causes apart:

  own_dense      DeepGEMM's own test shape (tests/test_attention.py: 2048 rows, 8192 keys,
                 64 heads, D=128), q and keys quantised as that test does;
  op_dense       the dense FP8 op's inputs (64 rows x 32K keys) through the adapter
                 indexer_vs_production.py times;
  op_dense_cute  the same after CuTe DSL is imported (both load their own compiler
                 libraries into one process);
  op_paged       the paged FP8 op's mixed batch up to 32K through the paged adapter.

Each case runs under each --variants entry, which tells the likely causes apart further:

  plain       as a user would run it;
  big_stack   an unlimited stack (a deep recursion, e.g. in std::regex, dies of the
              8 MiB default);
  nvrtc       DeepGEMM's JIT through NVRTC instead of nvcc (DG_JIT_USE_NVRTC=1);
  no_preload  without the LD_PRELOAD of the system's libstdc++ that /opt/refs.env sets
              (bench/h200/build_references.sh says why: without it every case died in
              std::regex's constructor, at DeepGEMM's first JIT call).

C's stdout is line-buffered (`stdbuf -oL`), so DeepGEMM's own debug lines up to a crash
are kept. Prints one line per case and variant: ok (with the output's shape and a
checksum) or how it died.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

CASES = {
    "own_dense": """
import torch, deep_gemm
q = torch.randn(2048, 64, 128, device="cuda").to(torch.float8_e4m3fn)
kv = torch.randn(8192, 128, device="cuda")
scale = kv.abs().amax(1).clamp(min=1e-4) / 448
keys = (kv / scale[:, None]).to(torch.float8_e4m3fn)
weights = torch.randn(2048, 64, device="cuda")
starts = torch.zeros(2048, dtype=torch.int32, device="cuda")
ends = torch.full((2048,), 8192, dtype=torch.int32, device="cuda")
out = deep_gemm.fp8_mqa_logits(q, (keys, scale), weights, starts, ends, clean_logits=False, max_seqlen_k=0)
""",
    "op_dense": """
import torch, deep_gemm
from indexer_vs_production import dense_deepgemm
from runners.ops import get_op
op = get_op("dsa_indexer_topk_fp8")
inputs = op.make_inputs(op.workloads("cuda", [32768], [64])[0], 11, "normal")
out = dense_deepgemm(deep_gemm, inputs, compact=False)()
""",
    "op_paged": """
import torch, deep_gemm
from indexer_vs_production import paged_deepgemm
from runners.ops import get_op
op = get_op("dsa_indexer_topk_paged_fp8")
inputs = op.make_inputs(op.workloads("cuda", [32768], [64])[0], 11, "normal")
out = paged_deepgemm(deep_gemm, op, inputs)[0]()
""",
}
CASES["op_dense_cute"] = "import cutlass.cute\n" + CASES["op_dense"]
VARIANTS = {
    "plain": ({}, None),
    "big_stack": ({}, lambda: resource.setrlimit(resource.RLIMIT_STACK, (resource.RLIM_INFINITY,) * 2)),
    "nvrtc": ({"DG_JIT_USE_NVRTC": "1"}, None),
    "no_preload": ({"LD_PRELOAD": None}, None),
}
REPORT = """
torch.cuda.synchronize()
print(f"ok: {tuple(out.shape)} {out.dtype}, finite sum {out[out.isfinite()].double().sum().item():.6g}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--variants", default="plain")
    args = parser.parse_args()
    line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
    env = {**os.environ, "DG_JIT_DEBUG": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")]))}
    summary = []
    for variant in args.variants.split(","):
        extra_env, before = VARIANTS[variant]
        for case in args.cases.split(","):
            name = f"{case} ({variant})"
            try:
                done = subprocess.run([*line_buffered, sys.executable, "-c", CASES[case] + REPORT],
                                      env={name: value for name, value in {**env, **extra_env}.items() if value is not None},
                                      preexec_fn=before, capture_output=True, text=True,
                                      timeout=args.timeout)
            except subprocess.TimeoutExpired:
                summary.append(f"{name}: no answer in {args.timeout:g} s")
                continue
            print(f"===== {name}: exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}", flush=True)
            if done.returncode == 0:
                summary.append(f"{name}: {done.stdout.strip().splitlines()[-1]}")
            else:
                died = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
                last = (done.stdout.strip().splitlines() or ["(no stdout)"])[-1]
                summary.append(f"{name}: {died}; its last line: {last[:200]}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
