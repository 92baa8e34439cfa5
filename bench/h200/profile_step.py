"""A small bf16 decoder step, for making real profiler exports on a GPU host.

    python3 bench/h200/profile_step.py --trace OUT.json.gz   # torch.profiler, 3 steps
    ncu --csv --page details python3 bench/h200/profile_step.py --steps 1

The step is what an engineer's evidence usually holds: cuBLASLt GEMMs (the QKV, output
and MLP projections), FlashAttention through scaled_dot_product_attention, an RMSNorm,
a ReLU MLP, residual adds, a dtype conversion and a top-k over the logits, so one trace
has three different vectorized_elementwise_kernel instantiations beside vendor GEMMs.
The exports it makes are the parser's fixtures (tests/fixtures/evidence/h200_*).
"""

from __future__ import annotations

import argparse
import gzip
import json

import torch
import torch.nn.functional as F


def step(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    batch, seq, hidden = x.shape
    h = F.rms_norm(x, (hidden,), w["norm"], eps=1e-6)
    q, k, v = (h @ w["qkv"]).split(hidden, dim=-1)
    q, k, v = (t.view(batch, seq, heads, hidden // heads).transpose(1, 2) for t in (q, k, v))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + attn.transpose(1, 2).reshape(batch, seq, hidden) @ w["out"]
    x = x + torch.relu(x @ w["up"]) @ w["down"]
    logits = (x[:, -1] @ w["vocab"]).float()
    return torch.topk(logits, 64, dim=-1).indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace", help="write a torch.profiler Chrome trace here (.gz compresses it)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch, seq, hidden, heads, vocab = 4, 1024, 2048, 16, 32768
    dev, bf16 = "cuda", torch.bfloat16
    w = {
        "norm": torch.ones(hidden, device=dev, dtype=bf16),
        "qkv": torch.randn(hidden, 3 * hidden, device=dev, dtype=bf16) / hidden**0.5,
        "out": torch.randn(hidden, hidden, device=dev, dtype=bf16) / hidden**0.5,
        "up": torch.randn(hidden, 4 * hidden, device=dev, dtype=bf16) / hidden**0.5,
        "down": torch.randn(4 * hidden, hidden, device=dev, dtype=bf16) / (4 * hidden) ** 0.5,
        "vocab": torch.randn(hidden, vocab, device=dev, dtype=bf16) / hidden**0.5,
    }
    x = torch.randn(batch, seq, hidden, device=dev, dtype=bf16)
    step(x, w, heads)  # warm-up: handles, autotuning and module loads stay out
    torch.cuda.synchronize()
    if not args.trace:
        for _ in range(args.steps):
            step(x, w, heads)
        torch.cuda.synchronize()
        return
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step(x, w, heads)
        torch.cuda.synchronize()
    plain = args.trace.removesuffix(".gz")
    prof.export_chrome_trace(plain)
    if args.trace.endswith(".gz"):
        with open(plain, "rb") as raw, gzip.open(args.trace, "wb") as packed:
            packed.write(raw.read())
    events = json.load(open(plain))["traceEvents"]
    kernels = {e["name"] for e in events if e.get("cat") == "kernel"}
    print(f"{len(kernels)} distinct kernels in {args.steps} steps")


if __name__ == "__main__":
    main()
