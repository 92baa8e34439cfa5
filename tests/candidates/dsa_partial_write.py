"""Partial computation: scores only the first half of the query rows; the rest get 0..k-1."""

import torch


def forward(q, k, weights, topk):
    rows = q.shape[0] // 2
    out = torch.arange(topk, device=q.device).repeat(q.shape[0], 1)
    logits = torch.einsum("mhd,nd->mhn", q[:rows], k).float().relu_()
    scores = torch.einsum("mhn,mh->mn", logits, weights[:rows])
    out[:rows] = scores.topk(topk, dim=-1).indices
    return out
