"""What the judge keeps across a sweep's candidates, and what it must not change.

A sweep judges all its candidates on one secret seed and keeps the inputs and
references it made from it (runners.harness.memo); the element-wise comparison runs in
chunks. Neither may change a verdict: each is checked here against the plain way, and
the channel the shared seed could open between candidates is attacked.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import weakref
from pathlib import Path

import pytest
import torch

from runners.harness import Limits, evaluate
from runners.harness.correctness import CallInputs, check_calls
from runners.harness.memo import NO_MEMO, Memo
from runners.harness.sweep import sweep
from runners.ops import get_op
from runners.ops.base import compare_close

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "tests" / "candidates" / "rmsnorm_replays_a_sibling_candidate.py"
LIMITS = Limits(import_s=20, call_s=20, memory_bytes=1024 * 2**20)


def whole_tensor_compare(actual, expected, *, rtol, atol):
    """The comparison as it was written before it ran in chunks: the definition."""
    finite = torch.isfinite(actual)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return False, f"{bad:,} of {actual.numel():,} output values are NaN or inf"
    error = (actual.double() - expected.double()).abs()
    allowed = atol + rtol * expected.double().abs()
    beyond = error > allowed
    if bool(beyond.any()):
        worst = torch.unravel_index(torch.argmax(error - allowed), error.shape)
        where = ", ".join(str(int(i)) for i in worst)
        return False, (
            f"{int(beyond.sum()):,} of {actual.numel():,} values differ from the reference "
            f"beyond rtol={rtol:g}, atol={atol:g}; worst at [{where}]: "
            f"got {float(actual[worst]):.6g}, expected {float(expected[worst]):.6g}"
        )
    return True, f"max abs error {float(error.max()):.3g} (rtol={rtol:g}, atol={atol:g})"


def _cases():
    generator = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((3, 5), (4096, 1024), (70_001,), (2, 3, 65_537)):
            expected = torch.randn(shape, generator=generator, dtype=torch.float64)
            close = (expected + 1e-4 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
            yield f"{dtype}-{shape}-close", close, expected
            flat = close.clone().reshape(-1)
            count = flat.numel()
            # Wrong in several chunks: the worst place must be named, and the count be whole.
            for place in {0, count // 3, count - 1}:
                flat[place] += 5
            flat[count // 2] += 50
            flat[count - 2] += 50
            yield f"{dtype}-{shape}-wrong", flat.reshape(shape), expected
            broken = close.clone().reshape(-1)
            broken[count // 2] = float("nan")
            broken[-1] = float("inf")
            yield f"{dtype}-{shape}-nonfinite", broken.reshape(shape), expected
    strided = torch.randn(64, 2048, generator=generator)[:, ::2]
    yield "non-contiguous", strided, strided.double() * (1 + 1e-7)


@pytest.mark.parametrize("name, actual, expected", list(_cases()), ids=lambda value: value
                         if isinstance(value, str) else "")
def test_the_chunked_comparison_says_what_the_whole_tensor_one_says(name, actual, expected):
    for rtol, atol in ((1e-5, 1e-5), (1.6e-2, 1e-2)):
        kept = expected.clone()
        assert compare_close(actual, expected, rtol=rtol, atol=atol) == \
            whole_tensor_compare(actual, expected, rtol=rtol, atol=atol), name
        assert torch.equal(expected, kept), "the reference was changed by its comparison"


def test_the_memo_gives_every_caller_its_own_copy_of_the_same_inputs():
    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [64])[0]
    memo = Memo(2**30)
    first = memo.inputs(op, workload, 11, "normal")
    first["x"].zero_()  # a caller that writes on what it was given
    second, third = memo.inputs(op, workload, 11, "normal"), memo.inputs(op, workload, 11, "normal")
    made = op.make_inputs(workload, 11, "normal")
    assert torch.equal(second["x"], made["x"]) and torch.equal(second["weight"], made["weight"])
    assert second["x"].data_ptr() != third["x"].data_ptr()
    assert (memo.made, memo.hits) == (1, 2)
    other = memo.inputs(op, workload, 12, "normal")
    assert not torch.equal(other["x"], made["x"]) and memo.made == 2


def test_a_full_memo_makes_again_what_it_could_not_keep():
    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [512])[0]
    one_set = sum(value.numel() * value.element_size()
                  for value in op.make_inputs(workload, 1, "normal").values() if torch.is_tensor(value))
    memo = Memo(one_set)
    for _ in range(2):
        for seed in (1, 2):
            memo.inputs(op, workload, seed, "normal")
    assert (memo.made, memo.hits, memo.held_bytes) == (3, 1, one_set)
    for _ in range(2):
        NO_MEMO.inputs(op, workload, 1, "normal")
    assert NO_MEMO.held_bytes == 0


class _Watching:
    """NO_MEMO's inputs and references, each input set watched by a weak reference."""

    def __init__(self) -> None:
        self.sets: list[weakref.ref] = []

    def inputs(self, op, workload, seed, distribution):
        made = NO_MEMO.inputs(op, workload, seed, distribution)
        self.sets.append(weakref.ref(made["x"]))
        return made

    def reference(self, op, workload, key, inputs):
        return NO_MEMO.reference(op, workload, key, inputs)

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.sets)


def test_the_judge_lets_go_of_each_checked_input_set_once_no_later_call_needs_it():
    """On a GPU the judge shares the device with its children: a 64 x 256K paged
    workload's six seeded sets held together (beside two nearly ones) were 32 GiB."""
    op = get_op("rmsnorm")
    workload = op.workloads("cpu", [64])[0]
    calls = check_calls(workload, 5)
    watching = _Watching()
    made = CallInputs(op, workload, 5, calls, watching)
    most = 0
    for call in calls:
        expected = made.expected(call)
        assert expected.inputs is made.of(call)
        del expected
        most = max(most, watching.alive())
        made.done(call)
    assert len(watching.sets) == 6  # every seeded set made once: none made again
    assert most == 2  # the nearly repeated call's two seeds, and at no time more
    assert watching.alive() == 0


def _correctness(result):
    return [(guard.name, guard.status, guard.detail) for guard in result.guards
            if guard.name in ("correctness", "output-type", "inputs-unchanged", "deterministic")]


def test_two_evaluations_of_one_seed_through_one_memo_are_judged_alike_and_the_second_reuses_the_checks():
    memo = Memo(2**30)
    runs = []
    for _ in range(2):
        before = memo.hits
        result = evaluate("rmsnorm", "baseline", context_lengths=[64, 512], time_budget_s=0.05,
                          limits=LIMITS, seed=4242, memo=memo)
        runs.append((result, memo.hits - before))
    (first, _), (second, reused_second) = runs
    assert first.correct and second.correct
    assert _correctness(first) == _correctness(second)
    alone = evaluate("rmsnorm", "baseline", context_lengths=[64, 512], time_budget_s=0.05,
                     limits=LIMITS, seed=4242)
    assert _correctness(alone) == _correctness(first)
    # The second reused at least the input set and the reference of every checked call
    # the first made (the checks run first, so the first kept them all). How many timed
    # rounds each ran depends on the clock, so the counts of those are not compared.
    op = get_op("rmsnorm")
    workloads = op.workloads("cpu", [64, 512])
    checked = sum(len(check_calls(workload, 4242)) for workload in workloads)
    assert reused_second >= 2 * checked, (reused_second, checked)
    # Nothing the two evaluations did changed what the memo gives the next one.
    for workload in workloads:
        for call in check_calls(workload, 4242):
            hits = memo.hits
            kept, fresh = (memo.inputs(op, workload, call.seed, call.distribution),
                           op.make_inputs(workload, call.seed, call.distribution))
            assert memo.hits == hits + 1, "a checked call's set was not kept"
            assert all(torch.equal(kept[name], fresh[name]) for name in ("x", "weight"))
            assert kept["eps"] == fresh["eps"]


def _load(role: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPLAY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PARAMS["ROLE"] = role
    return module


def test_outside_the_harness_the_replaying_candidate_answers_from_a_siblings_records(tmp_path, monkeypatch):
    recorder, replayer = _load("record", "recorder"), _load("replay", "replayer")
    x, weight = torch.randn(64, 1024), 1 + 0.1 * torch.randn(1024)
    monkeypatch.setenv("HOME", str(tmp_path / "kernel-lab-child-first"))
    answer = recorder.forward(x, weight, 1e-6)
    monkeypatch.setenv("HOME", str(tmp_path / "kernel-lab-child-second"))
    assert torch.equal(replayer.forward(x, weight, 1e-6), answer)  # no work done, and right
    assert not replayer.forward(torch.randn(64, 1024), weight, 1e-6).any()  # nothing computed


def test_a_sweep_judges_its_candidates_on_one_seed_and_the_second_finds_nothing_of_the_first(tmp_path):
    out = tmp_path / "results.jsonl"
    lines = sweep("rmsnorm", str(REPLAY), out=out, budget=2, context_lengths=[64],
                  time_budget_s=0.05)
    recorded, replayed = (line["result"] for line in lines)
    assert [line["params"]["ROLE"] for line in lines] == ["record", "replay"]
    assert recorded["seed"] == replayed["seed"]  # the very inputs the first one saw
    assert recorded["correct"] and recorded["verdict"] != "rejected", recorded["guards"]
    assert replayed["verdict"] == "rejected" and replayed["correct"] is False
    failing = {guard["name"]: guard["detail"] for guard in replayed["guards"] if guard["status"] == "fail"}
    assert "values differ from the reference" in failing["correctness"], failing
    assert "seed #1" in failing["correctness"]  # at its first call: it found no record
    header = json.loads(out.read_text().splitlines()[0])
    assert header["points"] == 2


def test_a_sweep_keeps_nothing_on_a_gpu_and_at_most_a_quarter_of_the_host_on_a_cpu():
    import os

    from runners.harness.memo import CPU_LIMIT_BYTES, limit_bytes

    assert limit_bytes("cuda") == 0  # device memory the judge holds is the children's
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < limit_bytes("cpu") <= min(CPU_LIMIT_BYTES, host / 4)
