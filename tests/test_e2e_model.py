"""The synthetic decode step used by the end-to-end check (CPU, eager, small shape)."""

from __future__ import annotations

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from runners.e2e import model
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


# The decode loop of the paged ops: contexts that grow every step, as a server's do.

@pytest.mark.parametrize("op_name", ["dsa_indexer_topk_paged", "dsa_indexer_topk_paged_fp8"])
def test_the_decode_loop_grows_every_context_by_a_token_a_step(op_name):
    seen = []
    kept = kept_dispatch()[op_name]

    def recording(*args):
        seen.append(args[-3].clone())  # context_lens, as the kernel saw them
        return kept(*args)

    loop = build_step(op_name, recording, device="cpu", context_length=1024, batch=4, seed=5)
    first = loop.first_lens.clone()
    output = loop()
    steps, layers = loop.steps, SHAPES["cpu"].layers
    assert steps == 4 and output.shape == (4, SHAPES["cpu"].hidden)
    assert torch.isfinite(output.float()).all()
    # Every layer of step t sees each sequence one token longer than at step t - 1.
    assert len(seen) == steps * layers
    for step in range(steps):
        for layer in range(layers):
            assert torch.equal(seen[step * layers + layer], first + step + 1)
    assert int(first.max()) == 1024 and int(first.min()) < SHAPES["cpu"].topk


def test_a_sequence_at_its_room_starts_over_at_its_first_length():
    loop = build_step("dsa_indexer_topk_paged", kept_dispatch()["dsa_indexer_topk_paged"],
                      device="cpu", context_length=1024, batch=3, seed=2)
    loop.context_lens.copy_(loop.first_lens + loop.GROWTH)
    loop.step()
    assert torch.equal(loop.context_lens, loop.first_lens + 1)


def test_the_new_token_is_written_where_its_sequence_reads_it():
    loop = build_step("dsa_indexer_topk_paged", kept_dispatch()["dsa_indexer_topk_paged"],
                      device="cpu", context_length=1024, batch=3, seed=2)
    layer = loop.layers[0]
    before = layer["index_cache"].clone()
    loop.step()
    changed = (layer["index_cache"] != before).any(dim=-1).nonzero().tolist()
    expected = []
    for row, length in enumerate(loop.context_lens.tolist()):
        position = length - 1
        expected.append([int(loop.block_table[row, position // 64]), position % 64])
    assert sorted(changed) == sorted(expected)


def test_a_kernel_that_pays_per_context_length_pays_it_every_step_of_the_loop():
    """Slower only at new lengths: fast again at lengths it has seen (what a kernel timing
    at fixed sizes sees), but in the loop every step is a new length."""
    import time

    pause_s = 0.02
    kept = kept_dispatch()["dsa_indexer_topk_paged"]
    compiled = set()

    def compiles_per_length(q, kv_cache, block_table, context_lens, weights, topk):
        longest = int(context_lens.max())
        if longest not in compiled:
            time.sleep(pause_s)
            compiled.add(longest)
        return kept(q, kv_cache, block_table, context_lens, weights, topk)

    loop = build_step("dsa_indexer_topk_paged", compiles_per_length, device="cpu",
                      context_length=1024, batch=2, seed=3)
    started = time.perf_counter()
    loop()
    # One new longest length per step, paid once per step (the layers share it).
    assert time.perf_counter() - started >= loop.steps * pause_s
    assert len(compiled) == loop.steps
    inputs = (torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16), loop.layers[0]["index_cache"],
              loop.block_table, loop.context_lens, torch.zeros(2, 16), 256)
    compiles_per_length(*inputs)  # a length it has seen: no pause
    assert len(compiled) == loop.steps


class _Draws(TorchDispatchMode):
    """The element count of every float32 tensor torch.randn makes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.randn and out.dtype == torch.float32:
            self.sizes.append(out.numel())
        return out


def test_the_paged_steps_caches_are_drawn_a_slice_at_a_time_and_the_step_is_the_same_for_a_seed(monkeypatch):
    # Whole, the 64-sequence latent cache's float32 draw was 4.7 GiB at 128K on a GPU.
    kept = kept_dispatch()["dsa_indexer_topk_paged_fp8"]
    whole = _Draws()
    with whole:
        build_step("dsa_indexer_topk_paged_fp8", kept, device="cpu", context_length=1024, batch=4, seed=5)
    # No slice is smaller than one row of its tensor: the experts' stack's is [hidden, width].
    largest_row = SHAPES["cpu"].hidden * SHAPES["cpu"].expert_width
    monkeypatch.setattr(model, "DRAW_AT_ONCE", 4096)
    sliced = _Draws()
    with sliced:
        first = build_step("dsa_indexer_topk_paged_fp8", kept, device="cpu", context_length=1024, batch=4, seed=5)
    assert max(whole.sizes) > largest_row
    assert max(sliced.sizes) <= largest_row and len(sliced.sizes) > len(whole.sizes)
    output = first()
    again = build_step("dsa_indexer_topk_paged_fp8", kept, device="cpu", context_length=1024, batch=4, seed=5)()
    assert torch.isfinite(output.float()).all() and torch.equal(output, again)
