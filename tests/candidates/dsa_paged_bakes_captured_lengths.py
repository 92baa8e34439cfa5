"""Right on every call it runs eagerly, wrong on a CUDA-graph replay with new lengths: it
plans the batch on the host (each sequence's length as a Python int, as a kernel that
builds its schedule from `context_lens` on the CPU does), and since a host read cannot
be captured, under capture it reuses the plan of the call before, which is the one the
graph is captured for. Every replay then scores the captured lengths, whatever
`context_lens` says: a server replaying the graph as contexts grow gets the first
step's answer shape every step."""

import torch

_plan: dict[str, list[int]] = {}


def _lengths(context_lens: torch.Tensor) -> list[int]:
    if context_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return _plan["lengths"]  # .tolist() would synchronize, which capture refuses
    _plan["lengths"] = context_lens.tolist()
    return _plan["lengths"]


def forward(q, kv_cache, block_table, context_lens, weights, topk):
    batch, next_n, heads, dim = q.shape
    block = kv_cache.shape[1]
    out = torch.full((batch * next_n, topk), -1, dtype=torch.int64, device=q.device)
    for b, length in enumerate(_lengths(context_lens)):
        blocks = block_table[b, :-(-length // block)].long()
        keys = kv_cache[blocks].reshape(-1, dim)[:length]
        logits = torch.einsum("jhd,nd->jhn", q[b], keys).float().relu_()
        scores = torch.einsum("jhn,jh->jn", logits, weights[b * next_n:(b + 1) * next_n])
        for j in range(next_n):
            seen = length - next_n + 1 + j
            if seen <= 0:  # an empty sequence that pads the batch: its rows stay -1
                continue
            keep = min(topk, seen)
            out[b * next_n + j, :keep] = scores[j, :seen].topk(keep).indices
    return out
