"""The synthetic decode step used by the end-to-end check (CPU, eager, small shape)."""

from __future__ import annotations

import pytest
import torch

from runners.e2e.model import SHAPES
from runners.e2e.step import build_step, kept_dispatch


def _counting(kernel, calls):
    def wrapped(*args):
        calls.append(args[0].shape)
        return kernel(*args)
    return wrapped


@pytest.mark.parametrize("op_name, per_layer", [("rmsnorm", 3), ("dsa_indexer_topk", 1), ("dsa_indexer_topk_fp8", 1)])
def test_the_step_calls_the_dispatched_kernel_in_every_layer(op_name, per_layer):
    calls = []
    step = build_step(op_name, _counting(kept_dispatch()[op_name], calls), device="cpu",
                      context_length=1024, batch=2, seed=1)
    output = step()
    assert output.shape == (2, SHAPES["cpu"].hidden) and torch.isfinite(output.float()).all()
    assert len(calls) == per_layer * SHAPES["cpu"].layers


def test_the_same_seed_gives_the_same_step_and_the_kernel_changes_the_result():
    kept = kept_dispatch()["dsa_indexer_topk"]
    first = build_step("dsa_indexer_topk", kept, device="cpu", context_length=1024, batch=2, seed=7)()
    again = build_step("dsa_indexer_topk", kept, device="cpu", context_length=1024, batch=2, seed=7)()
    assert torch.equal(first, again)

    def first_tokens(q, k, weights, topk):  # a wrong indexer: always the first topk tokens
        return torch.arange(topk).expand(q.shape[0], topk)

    wrong = build_step("dsa_indexer_topk", first_tokens, device="cpu", context_length=1024, batch=2, seed=7)()
    assert not torch.equal(first, wrong)


def test_it_refuses_an_op_the_step_does_not_dispatch_and_a_context_below_topk():
    with pytest.raises(ValueError, match="does not dispatch"):
        build_step("softmax", lambda *a: a[0], device="cpu", context_length=1024, batch=1, seed=1)
    with pytest.raises(ValueError, match="below top-k"):
        build_step("rmsnorm", kept_dispatch()["rmsnorm"], device="cpu", context_length=16, batch=1, seed=1)


def test_the_fp8_step_serves_the_indexer_e4m3_keys_with_their_scales_and_scaled_weights():
    seen = []

    def recording(q, k, k_scale, weights, topk):
        seen.append((q.dtype, k.dtype, k_scale.dtype, k_scale.shape, weights.shape, topk))
        return kept_dispatch()["dsa_indexer_topk_fp8"](q, k, k_scale, weights, topk)

    output = build_step("dsa_indexer_topk_fp8", recording, device="cpu", context_length=1024, batch=2, seed=3)()
    shape = SHAPES["cpu"]
    assert torch.isfinite(output.float()).all()
    assert seen == [(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, (1024,),
                     (2, shape.index_heads), shape.topk)] * shape.layers
