"""Right on every call it runs eagerly, wrong on a CUDA-graph replay with new lengths: the
op's per-sequence kernel (runners.kernel_lib.topk_torch.paged_topk), which plans the
batch from each sequence's length read on the host and so cannot be captured, made
capturable by handing it the lengths of the call before whenever the stream is
capturing, which is the call the graph is captured for. Every replay then scores the
captured lengths, whatever `context_lens` says: a server replaying the graph as contexts
grow gets the first step's answer shape every step."""

import torch

from runners.kernel_lib.topk_torch import paged_topk

CHUNK = 4096  # the shipped per-sequence kernel's default
_plan: dict[str, torch.Tensor] = {}


def _host_lengths(context_lens: torch.Tensor) -> torch.Tensor:
    if context_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return _plan["lengths"]  # a copy to the host would synchronize, which capture refuses
    _plan["lengths"] = context_lens.cpu()
    return _plan["lengths"]


def forward(q, kv_cache, kv_scale, block_table, context_lens, weights, topk):
    return paged_topk(q, kv_cache, block_table, _host_lengths(context_lens), weights, topk,
                      chunk=CHUNK, fused=True, kv_scale=kv_scale)
