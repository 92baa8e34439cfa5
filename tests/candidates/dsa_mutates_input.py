"""Mutated input: the right answer, then the keys are zeroed."""

import torch


def forward(q, k, weights, topk):
    logits = torch.einsum("mhd,nd->mhn", q, k).float().relu_()
    scores = torch.einsum("mhn,mh->mn", logits, weights)
    indices = scores.topk(topk, dim=-1).indices
    k.zero_()
    return indices
