"""Correct: a different formulation, dividing by the root mean square, in chunks of rows."""

import torch


def forward(x, weight, eps):
    out = torch.empty_like(x)
    scale = weight.float()
    for start in range(0, x.shape[0], 48):
        rows = x[start:start + 48].float()
        norm = rows.pow(2).mean(dim=-1, keepdim=True).add(eps).sqrt()
        out[start:start + 48] = (rows / norm * scale).to(x.dtype)
    return out
