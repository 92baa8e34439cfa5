"""What the kept dense CuTe indexers cost per decode step, wired into the paged decode loop.

    python3 bench/h200/kept_decode_loop.py [--steps 6] [--batch 4] [--context 8192] [--json FILE]

The kept kernels (runners/ops/dsa_indexer_topk*/kernels/logits_topk*_cute.py) serve the
dense op: one context length for every row. A serving engine calls the paged op, each
sequence at its own length, and every decode step makes every length one token longer.
A thin adapter serves the paged op with a dense kernel the only way it can: per sequence,
that sequence's keys gathered from its blocks, at its own length (read on the host, so
it runs eagerly: a graph could not follow the lengths). The decode loop of the
end-to-end check (runners.e2e.model.PagedDecodeLoop, the full model shape) then runs
`--steps` steps with the adapter, and as many with the paged op's torch baseline, each
step timed on its own (wall clock, synchronized): the first call of the adapter compiles,
and so does every later step, since every sequence's length is new there.

Prints per kernel the per-step milliseconds and the decode tokens per second; writes
them to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from runners.e2e.model import SHAPES, Dispatch, PagedDecodeLoop  # noqa: E402
from runners.e2e.step import kept_dispatch  # noqa: E402
from runners.harness.candidate import load_candidate  # noqa: E402
from runners.ops.dsa_indexer_topk_paged import blocks_for  # noqa: E402

KEPT = {"dsa_indexer_topk_paged": ROOT / "runners/ops/dsa_indexer_topk/kernels/logits_topk_cute.py",
        "dsa_indexer_topk_paged_fp8": ROOT / "runners/ops/dsa_indexer_topk_fp8/kernels/logits_topk_fp8_cute.py"}


def paged_through_dense(dense, fp8: bool):
    """The paged op served by a dense kernel, sequence by sequence (next_n = 1). A
    sequence shorter than top-k, which the dense kernels refuse, is ranked in torch."""

    def forward(q, kv_cache, *rest):
        kv_scale, (block_table, context_lens, weights, topk) = (rest[0], rest[1:]) if fp8 else (None, rest)
        batch, next_n, heads, dim = q.shape
        assert next_n == 1, "the adapter serves one token per sequence"
        out = torch.full((batch, topk), -1, dtype=torch.int64, device=q.device)
        for b, length in enumerate(context_lens.tolist()):
            blocks = block_table[b, :blocks_for(length)].long()
            keys = kv_cache[blocks].reshape(-1, dim)[:length]
            scale = kv_scale[blocks].reshape(-1)[:length] if fp8 else None
            if length >= topk:
                args = (q[b], keys, scale, weights[b:b + 1], topk) if fp8 else (q[b], keys, weights[b:b + 1], topk)
                out[b] = dense(*args)[0]
                continue
            logits = torch.einsum("hd,nd->hn", q[b, 0].float(), keys.float())
            if fp8:
                logits = logits * scale
            scores = (logits.relu() * weights[b].view(-1, 1)).sum(0)
            out[b, :length] = scores.topk(length).indices
        return out

    return forward


def run_loop(op: str, paged_kernel, *, steps: int, batch: int, context: int) -> list[float]:
    kernels = kept_dispatch()
    kernels[op] = paged_kernel
    loop = PagedDecodeLoop(SHAPES["cuda"], context_length=context, batch=batch, device="cuda",
                           seed=20261201, dispatch=Dispatch(**kernels), fp8_indexer=op.endswith("fp8"),
                           steps=1)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loop.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    found = {}
    for op, path in KEPT.items():
        adapter = paged_through_dense(load_candidate(path).forward, op.endswith("fp8"))
        for name, kernel in ((f"{path.stem} (adapter)", adapter), ("baseline", kept_dispatch()[op])):
            times = run_loop(op, kernel, steps=args.steps, batch=args.batch, context=args.context)
            later = times[1:]
            found[f"{op}: {name}"] = {
                "step_ms": [round(t, 2) for t in times],
                "tokens_per_s_after_first": round(args.batch * len(later) / (sum(later) / 1e3), 1)}
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "loops": found}, indent=1))
    print(f"decode loop, full model shape, batch {args.batch}, mixed lengths up to {args.context}, "
          f"{args.steps} steps each timed alone (eager)")
    for name, row in found.items():
        print(f"{name:58s} steps (ms): {', '.join(f'{t:,.1f}' for t in row['step_ms'])}; "
              f"{row['tokens_per_s_after_first']:,} tokens/s after the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
