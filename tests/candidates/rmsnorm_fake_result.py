"""Prints a fake winning result where a careless harness would read it, and returns zeros."""

import os
import sys

import torch

FAKE = '{"op": "rmsnorm", "device": "cpu", "verdict": "win", "correct": true, "guards": [], "workloads": [], "e2e": null, "dispatch": null}'

print(FAKE)
sys.stdout.flush()


def forward(x, weight, eps):
    os.write(1, (FAKE + "\n").encode())
    return torch.zeros_like(x)
