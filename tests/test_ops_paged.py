"""The paged decode ops: their inputs as a serving engine lays them out, their check
(each row's own prefix, −1 padding), and the corpus's attacks on them shown outside the
harness: a kernel that ignores the lengths, which only mixed batches show, one that
drops the FP8 cache's scales, which only scales that differ show, one compiled per
length and one that bakes the captured lengths into its graph."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from runners.harness import Limits, evaluate
from runners.ops import get_op
from runners.ops.dsa_indexer_topk_fp8 import FP8
from runners.ops.dsa_indexer_topk_paged import BLOCK_SIZE, mixed_lengths

ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ROOT / "tests" / "candidates"
PAGED = ["dsa_indexer_topk_paged", "dsa_indexer_topk_paged_fp8"]


def _attack(name: str, hack: str) -> Path:
    """The corpus's candidate playing `hack` on the paged op `name`."""
    return CANDIDATES / f"dsa_paged_{'fp8_' if name.endswith('fp8') else ''}{hack}.py"


def _forward(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forward


def _case(name: str, mix: str = "mixed", next_n: int = 1, seed: int = 3,
          distribution: str = "normal", context: int = 2048):
    op = get_op(name)
    workload = next(w for w in op.workloads("cpu", [context], [8])
                    if w.params["mix"] == mix and w.params["next_n"] == next_n)
    inputs = op.make_inputs(workload, seed, distribution)
    return op, workload, inputs, op.reference(inputs)


def test_workloads_mix_lengths_and_add_two_token_decode_at_the_longest_context():
    op = get_op("dsa_indexer_topk_paged")
    assert [w.name for w in op.workloads("cpu")] == [
        "ctx<=2048,b=8,mixed", "ctx=2048,b=8",
        "ctx<=8192,b=8,mixed", "ctx<=8192,b=8,mixed,next_n=2", "ctx=8192,b=8",
    ]
    cuda = op.workloads("cuda")
    assert max(w.params["context_length"] for w in cuda) == 262144
    assert {(w.params["heads"], w.params["head_dim"], w.params["topk"]) for w in cuda} == {(64, 128, 2048)}


@pytest.mark.parametrize("name", PAGED)
def test_inputs_are_a_shuffled_paged_cache_in_forwards_order(name):
    op, workload, inputs, _ = _case(name)
    p = workload.params
    keys = ["q", "kv_cache", "kv_scale", "block_table", "context_lens", "weights", "topk"]
    assert list(inputs) == [key for key in keys if key != "kv_scale" or name.endswith("fp8")]
    value_dtype = FP8 if name.endswith("fp8") else torch.bfloat16
    assert (inputs["q"].dtype, tuple(inputs["q"].shape)) == (value_dtype, (8, 1, 16, 64))
    assert tuple(inputs["kv_cache"].shape) == (p["num_blocks"], BLOCK_SIZE, 64)
    assert (inputs["block_table"].dtype, tuple(inputs["block_table"].shape)) == (torch.int32, (8, 32))
    lengths = inputs["context_lens"]
    assert lengths.dtype == torch.int32 and int(lengths.sum()) == p["tokens"]
    assert int(lengths.max()) == 2048 and int(lengths.min()) < p["topk"]
    # Every sequence owns its own blocks, and they are not laid out in order.
    owned = [inputs["block_table"][row, :-(-int(n) // BLOCK_SIZE)].tolist()
             for row, n in enumerate(lengths)]
    flat = [block for blocks in owned for block in blocks]
    assert len(flat) == len(set(flat)) and flat != sorted(flat)


def test_slots_no_sequence_owns_hold_louder_keys():
    op, workload, inputs, _ = _case("dsa_indexer_topk_paged")
    cache = inputs["kv_cache"].float()
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for row, length in enumerate(inputs["context_lens"].tolist()):
        blocks = inputs["block_table"][row, :-(-length // BLOCK_SIZE)].long()
        owned.view(-1)[(blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(-1)[:length]] = True
    assert float(cache[~owned].abs().mean()) > 6 * float(cache[owned].abs().mean())


def test_the_cache_drawn_a_few_blocks_at_a_time_is_whole_and_quantised_row_by_row(monkeypatch):
    """The keys are drawn in chunks of blocks (a 256K batch's cache is never whole in
    float32): every block of every chunk is written, and each FP8 row has its own scale."""
    import runners.ops.dsa_indexer_topk_paged as paged

    monkeypatch.setattr(paged, "KEY_CHUNK_BLOCKS", 5)
    op, workload, inputs, _ = _case("dsa_indexer_topk_paged_fp8")
    blocks = workload.params["num_blocks"]
    assert blocks > 3 * paged.KEY_CHUNK_BLOCKS and blocks % paged.KEY_CHUNK_BLOCKS  # a partial last chunk
    values = inputs["kv_cache"].float()
    assert values.shape[0] == blocks and inputs["kv_scale"].shape == (blocks, BLOCK_SIZE)
    # Each row's largest |value| is e4m3's largest (448): quantised by its own scale, never left unset.
    assert torch.equal(values.abs().amax(-1), torch.full((blocks, BLOCK_SIZE), 448.0))
    assert bool((inputs["kv_scale"] > 0).all())
    # The same seed gives the same cache; the chunks are not copies of each other.
    again = op.make_inputs(workload, 3, "normal")
    assert torch.equal(again["kv_cache"].view(torch.uint8), inputs["kv_cache"].view(torch.uint8))
    assert not torch.equal(inputs["kv_scale"][:5], inputs["kv_scale"][5:10])


def test_mixed_lengths_sum_to_the_total_within_bounds_for_any_seed():
    for seed in range(20):
        lengths = mixed_lengths(64, 262144, 262144 + 63 * 65536, 256, 2048,
                                torch.Generator().manual_seed(seed))
        assert sum(lengths) == 262144 + 63 * 65536 and len(lengths) == 64
        assert max(lengths) == 262144 and 256 <= min(lengths) < 2048


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize(("mix", "next_n"), [("mixed", 1), ("equal", 1), ("mixed", 2)])
def test_the_baseline_passes_the_check_in_any_order(name, mix, next_n):
    op, _, inputs, scores = _case(name, mix, next_n, distribution="uniform_outliers")
    output = _forward(op.baseline_path)(*inputs.values())
    shuffled = output[:, torch.randperm(output.shape[1])]
    ok, detail = op.check(shuffled, scores, inputs)
    assert ok, detail
    assert (output == -1).any() == (mix == "mixed")  # a mixed batch always has a short row


@pytest.mark.parametrize("name", PAGED)
def test_the_baseline_in_groups_of_sequences_gives_what_it_gives_whole(name):
    """The baseline scores a few sequences at a time (bounded memory at 64 x 256K); the
    groups must not change a bit of its answer, on a batch of mixed lengths and two
    query rows per sequence."""
    op, _, inputs, scores = _case(name, next_n=2)
    spec = importlib.util.spec_from_file_location("grouped_baseline", op.baseline_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    whole = module.forward(*inputs.values())
    batch, next_n, heads, _ = inputs["q"].shape
    width = inputs["block_table"].shape[1] * inputs["kv_cache"].shape[1]
    module.LOGITS_AT_ONCE = 3 * next_n * heads * width  # 8 sequences in groups of 3, 3 and 2
    assert torch.equal(module.forward(*inputs.values()), whole)
    assert op.check(whole, scores, inputs)[0]


@pytest.mark.parametrize("name", PAGED)
def test_the_check_refuses_indices_past_a_rows_prefix(name):
    op, _, inputs, scores = _case(name, next_n=2)
    output = _forward(_attack(name, "ignores_lengths"))(*inputs.values())
    ok, detail = op.check(output, scores, inputs)
    assert not ok and "outside their row's prefix" in detail


def test_the_check_refuses_a_short_row_without_its_padding():
    op, _, inputs, scores = _case("dsa_indexer_topk_paged")
    output = _forward(op.baseline_path)(*inputs.values())
    row = int((output == -1).any(dim=1).nonzero()[0])
    unpadded = output.clone()
    unpadded[row, (unpadded[row] == -1).nonzero()[0]] = -7
    ok, detail = op.check(unpadded, scores, inputs)
    assert not ok and "outside their row's prefix" in detail
    short = output.clone()
    short[row, (short[row] != -1).nonzero()[0]] = -1  # one real index dropped
    ok, detail = op.check(short, scores, inputs)
    assert not ok and f"row {row} sees" in detail and "padded wrongly" in detail


def test_the_check_refuses_another_sequences_blocks_and_duplicates():
    op, _, inputs, scores = _case("dsa_indexer_topk_paged", mix="equal")
    # Every sequence scored against sequence 0's blocks.
    borrowed = {**inputs, "block_table": inputs["block_table"][:1].expand_as(inputs["block_table"])}
    output = _forward(op.baseline_path)(*borrowed.values())
    ok, detail = op.check(output, scores, inputs)
    assert not ok and "fall short of the true top-256 of their prefix" in detail
    right = _forward(op.baseline_path)(*inputs.values())
    doubled = right.clone()
    doubled[2, -1] = doubled[2, 0]
    ok, detail = op.check(doubled, scores, inputs)
    assert not ok and "duplicate" in detail and "row 2" in detail


@pytest.mark.parametrize("name", PAGED)
def test_a_nearly_repeated_batch_has_another_answer(name):
    op = get_op(name)
    workload = op.workloads("cpu", [2048], [16])[0]  # the most sequences, so the most keys changed
    inputs = op.make_inputs(workload, 3, "uniform_outliers")
    other = op.make_inputs(workload, 99, "uniform_outliers")
    near = op.nearly(inputs, other, torch.Generator().manual_seed(1))
    # Each changed key is four times as loud as the loudest before, not than the last changed.
    loud = "kv_scale" if name.endswith("fp8") else "kv_cache"
    before, after = (float(values[loud].float().abs().amax()) for values in (inputs, near))
    assert after == pytest.approx(4 * before, rel=0.02)
    kept = _forward(op.baseline_path)(*inputs.values())
    assert not op.check(kept, op.reference(near), near)[0]
    assert op.check(_forward(op.baseline_path)(*near.values()), op.reference(near), near)[0]


def test_the_fp8_paged_reference_is_the_dequantized_cache():
    op, _, inputs, scores = _case("dsa_indexer_topk_paged_fp8", mix="equal")
    bf16 = get_op("dsa_indexer_topk_paged")
    widened = {**inputs, "q": inputs["q"].float(),
               "kv_cache": inputs["kv_cache"].float() * inputs["kv_scale"].unsqueeze(-1)}
    del widened["kv_scale"]
    assert torch.allclose(bf16.reference(widened), scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", PAGED)
def test_flops_and_bytes_count_each_sequences_own_tokens(name):
    op = get_op(name)
    mixed, equal = op.workloads("cuda", [65536], [64])[::2]
    assert mixed.params["tokens"] < equal.params["tokens"] == 64 * 65536
    assert op.flops(mixed) < op.flops(equal) and op.bytes(mixed) < op.bytes(equal)
    per_token = 64 * (2 * 128 + 3) + (64 if name.endswith("fp8") else 0)
    assert op.flops(equal) == 64 * 65536 * per_token


@pytest.mark.parametrize("name", PAGED)
def test_a_kernel_that_ignores_the_lengths_is_right_on_equal_batches_only(name):
    """Outside the harness it is right where every sequence fills its row; inside, the
    corpus shows it rejected by correctness on the mixed batches
    (tests/test_harness_corpus.py, PLANTED)."""
    forward = _forward(_attack(name, "ignores_lengths"))
    op, _, inputs, scores = _case(name, mix="equal")
    assert op.check(forward(*inputs.values()), scores, inputs)[0]
    op, _, inputs, scores = _case(name, mix="mixed")
    ok, detail = op.check(forward(*inputs.values()), scores, inputs)
    assert not ok and "outside their row's prefix" in detail


@pytest.mark.parametrize("mix", ["mixed", "equal"])
def test_a_kernel_that_drops_the_fp8_scales_is_right_only_where_every_token_has_one(mix):
    """One scale for every token scales every score alike, so the ranking of the e4m3
    values alone is the answer; the cache's own scales (one per token, by its absmax)
    differ, and it is wrong whatever the lengths. Inside the harness the corpus shows it
    rejected by correctness (tests/test_harness_corpus.py, PLANTED)."""
    forward = _forward(_attack("dsa_indexer_topk_paged_fp8", "ignores_scales"))
    op, _, inputs, scores = _case("dsa_indexer_topk_paged_fp8", mix=mix)
    assert float(inputs["kv_scale"].amin()) < 0.5 * float(inputs["kv_scale"].amax())
    ok, detail = op.check(forward(*inputs.values()), scores, inputs)
    assert not ok and "fall short of the true top-256" in detail
    scale = float(inputs["kv_scale"].median())
    one_scale = {**inputs, "kv_scale": torch.full_like(inputs["kv_scale"], scale)}
    ok, detail = op.check(forward(*one_scale.values()), op.reference(one_scale), one_scale)
    assert ok, detail


@pytest.mark.parametrize("name", PAGED)
def test_a_kernel_compiled_per_length_compiles_again_at_each_length_of_one_bucket(name, monkeypatch):
    """Right every call, but each new longest length costs a compile, though the inputs'
    shapes (the bucket's) stay the same: a server's every decode step. Inside the harness
    the corpus shows it rejected by first-call (tests/test_harness_corpus.py, PLANTED)."""
    compiles = []
    monkeypatch.setattr(time, "sleep", compiles.append)  # the simulated compile, not waited for
    forward = _forward(_attack(name, "compiles_per_length"))
    shapes = set()
    for context in (2048, 2048, 1901, 1902):
        op, _, inputs, scores = _case(name, context=context)
        assert op.check(forward(*inputs.values()), scores, inputs)[0]
        shapes.add(tuple(tuple(value.shape) for value in inputs.values() if isinstance(value, torch.Tensor)))
    assert len(shapes) == 1
    assert len(compiles) == 3 and all(seconds > 0 for seconds in compiles)  # not again at 2048


@pytest.mark.parametrize("name", PAGED)
def test_the_baseline_against_itself_is_no_gain(name):
    result = evaluate(name, "baseline", context_lengths=[2048], time_budget_s=0.2,
                      limits=Limits(import_s=20, call_s=20, memory_bytes=1024 * 2**20))
    assert result.correct is True
    assert result.verdict == "no-gain", [(g.name, g.detail) for g in result.guards if g.status == "fail"]



NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="a CUDA-graph replay: needs CUDA to play it")


@pytest.mark.parametrize("name", PAGED)
def test_a_kernel_that_plans_on_the_host_is_right_whenever_it_runs_eagerly(name):
    """What it gets wrong is only a graph's: run eagerly it reads the lengths every call."""
    forward = _forward(_attack(name, "bakes_captured_lengths"))
    for seed in (3, 4):
        op, _, inputs, scores = _case(name, seed=seed)
        assert op.check(forward(*inputs.values()), scores, inputs)[0]


def _cuda_inputs(name: str, seed: int) -> tuple:
    op = get_op(name)
    workload = op.workloads("cuda", [4096], [64])[0]
    assert workload.params["mix"] == "mixed"
    return op, op.make_inputs(workload, seed, "normal")


@NEEDS_CUDA
@pytest.mark.parametrize("name", PAGED)
def test_a_kernel_that_plans_on_the_host_is_wrong_when_its_graph_is_replayed_with_new_lengths(name):
    forward = _forward(_attack(name, "bakes_captured_lengths"))
    op, captured = _cuda_inputs(name, 3)
    _, replayed = _cuda_inputs(name, 4)
    assert not torch.equal(captured["context_lens"], replayed["context_lens"])
    buffers = {key: value.clone() if isinstance(value, torch.Tensor) else value
               for key, value in captured.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(*buffers.values())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward(*buffers.values())
    graph.replay()
    assert op.check(output, op.reference(captured), captured)[0]
    for key, value in replayed.items():  # a server's next step: new lengths, same buffers
        if isinstance(value, torch.Tensor):
            buffers[key].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    assert not op.check(output, op.reference(replayed), replayed)[0]
    assert op.check(forward(*replayed.values()), op.reference(replayed), replayed)[0]


@NEEDS_CUDA
@pytest.mark.parametrize("name", PAGED)
def test_a_kernel_that_bakes_the_captured_lengths_fails_the_cuda_graph_guard(name):
    result = evaluate(name, _attack(name, "bakes_captured_lengths"), context_lengths=[4096], device="cuda",
                      time_budget_s=0.2, limits=Limits(import_s=60, call_s=90), seed=20261201)
    assert result.verdict == "rejected", result.guards
    failing = {g.name: g.detail for g in result.guards if g.status == "fail"}
    assert "cuda-graph" in failing and "correctness" not in failing, failing
    for fragment in ("right when captured on its own inputs", "is replayed on the inputs of",
                     "context_lens", "block_table differs"):
        assert fragment in failing["cuda-graph"], failing["cuda-graph"]


@pytest.mark.parametrize("name", PAGED)
def test_shapes_are_the_length_buckets_so_lengths_inside_one_change_no_shape(name):
    """A server sizes its table and cache for a bucket of lengths: a new length inside it
    is new values in the same tensors, one past it is new shapes."""
    op = get_op(name)
    shapes = {}
    for context in (2048, 1901, 2049):
        for workload in op.workloads("cpu", [context], [8]):
            inputs = op.make_inputs(workload, 3, "normal")
            shapes.setdefault(context, []).append(
                {key: tuple(value.shape) for key, value in inputs.items() if isinstance(value, torch.Tensor)})
            assert int(inputs["context_lens"].max()) == context
    assert shapes[1901] == shapes[2048] != shapes[2049]
    assert {w.params["bucket"] for w in op.workloads("cpu", [2049], [8])} == {4096}
