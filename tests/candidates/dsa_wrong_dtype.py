"""Wrong dtype: int32 indices where the contract says a LongTensor."""

import torch


def forward(q, k, weights, topk):
    logits = torch.einsum("mhd,nd->mhn", q, k).float().relu_()
    scores = torch.einsum("mhn,mh->mn", logits, weights)
    return scores.topk(topk, dim=-1).indices.to(torch.int32)
