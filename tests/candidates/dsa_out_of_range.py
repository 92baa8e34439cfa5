"""Indices out of range: the last slot of every row points one past the context."""

import torch


def forward(q, k, weights, topk):
    logits = torch.einsum("mhd,nd->mhn", q, k).float().relu_()
    scores = torch.einsum("mhn,mh->mn", logits, weights)
    indices = scores.topk(topk, dim=-1).indices
    indices[:, -1] = k.shape[0]
    return indices
