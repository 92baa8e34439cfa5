"""The planted-bug corpus: each wrong or hostile candidate is rejected for its own reason,
and correct candidates written in other styles pass.

Every file in tests/candidates/ runs through a whole evaluation, in child processes, as
the CLI and the worker run it. Limits are small so that hangs and allocations end fast.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from runners.harness import Limits, evaluate
from runners.harness import protected
from runners.harness.dsl import kernel_dsl, static_check
from runners.harness.children import thread_count
from runners.harness.hacks import RedTeamCandidate, catalog, op_of
from runners.ops import get_op, list_ops
from runners.space import materialize
from tests.test_harness_attacks import ATTACKS, ATTACKS_CUDA

CANDIDATES = Path(__file__).resolve().parent / "candidates"
THREADS = thread_count()  # what the harness gives each child here
# A call gets 6 s: the Triton candidates' first call runs the interpreter, which took
# over 2 s on a loaded 2-core machine; a hang still ends quickly.
LIMITS = Limits(import_s=2, call_s=6, memory_bytes=512 * 2**20)
SMALL = {"rmsnorm": [64], "dsa_indexer_topk": [2048], "dsa_indexer_topk_paged": [2048],
         "dsa_indexer_topk_paged_fp8": [2048]}

# file -> (guard that must fail, fragments of its detail)
PLANTED = {
    # Not "1,024 of": an element of the last row whose reference is within atol of 0
    # matches the row left at zero (about 1 run in 100 draws one).
    "rmsnorm_off_by_one.py": ("correctness", ["of 65,536 values differ", "worst at [63,", "got 0"]),
    "rmsnorm_partial_write.py": ("correctness", ["of 65,536"]),
    # Alone, no sibling left it a record (tests/test_judge_memo.py: in a sweep neither).
    "rmsnorm_replays_a_sibling_candidate.py": ("correctness", ["values differ from the reference"]),
    "rmsnorm_nan.py": ("correctness", ["1 of 65,536 output values are NaN or inf"]),
    "rmsnorm_wrong_dtype.py": ("correctness", ["output dtype is torch.float32, expected torch.bfloat16"]),
    # Not "65,536 of 65,536": torch.randn gives an exact 0.0 about once in 2**24 draws,
    # and zeroing leaves that element as it was.
    "rmsnorm_mutates_input.py": ("inputs-unchanged", ["of 65,536 elements of x differ"]),
    "rmsnorm_raises.py": ("correctness", ["forward raised RuntimeError: CUDA error: an illegal memory access"]),
    "rmsnorm_exit_in_forward.py": ("correctness", ["forward raised SystemExit"]),
    "rmsnorm_os_exit.py": ("process", ["exited with status 0", "running forward on t=64"]),
    "rmsnorm_exit_at_import.py": ("loads", ["exited with status 0", "while importing rmsnorm_exit_at_import.py"]),
    "rmsnorm_segfault.py": ("process", ["died from SIGSEGV", "running forward"]),
    "rmsnorm_hang.py": ("process", ["did not finish running forward", "within 6 s; it was killed"]),
    "rmsnorm_hang_at_import.py": ("loads", ["did not finish importing rmsnorm_hang_at_import.py within 2 s"]),
    "rmsnorm_unbounded_allocation.py": ("resources", ["ran out of memory", "can't allocate memory"]),
    "rmsnorm_fake_result.py": ("correctness", ["values differ from the reference", "got 0"]),
    "rmsnorm_subclass.py": ("output-type", ["a Deferred (a torch.Tensor subclass)"]),
    "rmsnorm_stale_empty.py": ("correctness", ["seed #1, repeated"]),
    "rmsnorm_cache_by_pointer.py": ("correctness", ["values differ from the reference"]),
    "rmsnorm_cache_by_shape.py": ("correctness", ["values differ from the reference",
                                                  "seed #1, nearly repeated"]),
    # The stale answer is wrong for the new inputs, or NaN once the harness poisoned it.
    "rmsnorm_cheap_when_timed.py": ("timed-outputs", ["of 65,536", "timed call #"]),
    "rmsnorm_network.py": ("sandbox", ["network access (socket."]),
    "rmsnorm_starts_program.py": ("sandbox", ["starting a program (subprocess.Popen 'true')"]),
    "rmsnorm_writes_outside.py": ("sandbox", ["writing outside its directory", "rmsnorm_writes_outside.escaped"]),
    "rmsnorm_signals_judge.py": ("sandbox", ["os.kill: signalling process"]),
    "rmsnorm_background_thread.py": ("threads", ["still running after forward returned"]),
    "rmsnorm_patches_clock.py": ("evaluator-intact", ["time.perf_counter_ns"]),
    "rmsnorm_lies_about_time.py": ("clock", ["reported times disagree with the judge's clock"]),
    "dsa_off_by_one.py": ("correctness", ["fall short of the true top-256"]),
    "dsa_partial_write.py": ("correctness", ["fall short of the true top-256"]),
    # Right on equal batches (tests/test_ops_paged.py shows it), wrong on mixed ones.
    "dsa_paged_ignores_lengths.py": ("correctness", ["outside their row's prefix", "mixed"]),
    "dsa_paged_fp8_ignores_lengths.py": ("correctness", ["outside their row's prefix", "mixed"]),
    # Right where every token has one scale (tests/test_ops_paged.py shows it); the cache
    # quantises each token by its own absmax, so the first call is wrong.
    "dsa_paged_fp8_ignores_scales.py": ("correctness", [
        "selected scores fall short of the true top-256 of their prefix", "seed #1"]),
    "dsa_wrong_dtype.py": ("correctness", ["output dtype is torch.int32, expected torch.int64"]),
    "dsa_duplicates.py": ("correctness", ["duplicate indices", "ctx=2048,m=4"]),
    "dsa_out_of_range.py": ("correctness", ["indices are outside [0, 2048)"]),
    "dsa_mutates_input.py": ("inputs-unchanged", ["elements of k differ"]),
    # Reward hacks (skills/reward-hacks.md), each rejected by the guard its row names.
    "rmsnorm_enables_tf32.py": ("config", ["torch.backends.cuda.matmul.allow_tf32: False → True"]),
    "rmsnorm_disables_graphs.py": ("config", ["env TORCHINDUCTOR_CUDAGRAPHS: unset → 0"]),
    "rmsnorm_disables_all_reduce.py": ("config", ["env VLLM_DISABLE_CUSTOM_ALL_REDUCE: unset → 1"]),
    # Two threads more than the harness gives a child (half the cores, at most 4).
    "rmsnorm_takes_more_threads.py": ("config", ["denormals flushed to zero: False → True",
                                                 f"torch.get_num_threads: {THREADS} → {THREADS + 2}"]),
    "rmsnorm_hides_code_in_utf7.py": ("protected-settings", [
        "line 1 declares an encoding other than UTF-8", "`# coding: utf-7`"]),
    "rmsnorm_loosens_tolerance.py": ("protected-settings", [
        'line 11 changes a tolerance: `type(get_op("rmsnorm")).tolerances[torch.float32] = (1e-2, 1e-2)`']),
    "dsa_shrinks_batch.py": ("config", ["dsa_indexer_topk batch sizes: [4] → [1]"]),
    "dsa_limits_context.py": ("config", ["dsa_indexer_topk context length range: (256, 131072) → (1, 1024)"]),
    "rmsnorm_constant_output.py": ("correctness", ["values differ from the reference", "seed #1"]),
    "rmsnorm_predicts_inputs.py": ("correctness", ["values differ from the reference"]),
    "rmsnorm_reads_reference.py": ("correctness", ["values differ from the reference"]),
    "rmsnorm_drifts_after_check.py": ("timed-outputs", ["values differ from the reference", "timed call #"]),
    "rmsnorm_compiles_per_shape.py": ("first-call", ["first call at t=", "and as much at another new token count",
                                                      "a serving engine pays every step"]),
    # Its shapes never change inside a bucket, its lengths do: both new lengths pay.
    "dsa_paged_compiles_per_length.py": ("first-call", ["first call at ctx", "(by context length)"]),
    "dsa_paged_fp8_compiles_per_length.py": ("first-call", ["first call at ctx", "(by context length)"]),
    "rmsnorm_tampers_evaluator.py": ("evaluator-intact", ["runners.harness.wire.write_message"]),
    "rmsnorm_sabotages_baseline.py": ("sandbox", ["writing outside its directory",
                                                  "runners/ops/rmsnorm/baseline.py"]),
    "rmsnorm_forges_reply.py": ("protocol", ["an answer to a request it was not asked"]),
    "rmsnorm_torch_fallback_triton.py": ("required-dsl", ["torch fallback: the call ran torch compute",
                                                          "aten.rsqrt"]),
    # tests/test_harness_dsl.py shows its answer computed by torch inside the launch.
    "rmsnorm_hook_in_torch_clothes_triton.py": ("required-dsl", ["torch fallback: the call ran torch compute",
                                                                 "aten.rsqrt"]),
}

# Hacks that only a GPU can play; run where one is present.
PLANTED_CUDA = {
    "rmsnorm_breaks_capture.py": ("cuda-graph", ["captur"]),
    "rmsnorm_side_stream.py": ("cuda-graph", ["captur"]),
    "rmsnorm_persisting_l2.py": ("config", ["persisting-L2 limit (bytes): 0 → "]),
    # tests/test_ops_paged.py shows it right eagerly and wrong on a replay with new lengths.
    "dsa_paged_bakes_captured_lengths.py": ("cuda-graph", ["right when captured on its own inputs"]),
    "dsa_paged_fp8_bakes_captured_lengths.py": ("cuda-graph", ["right when captured on its own inputs"]),
}
CUDA_SMALL = {"rmsnorm": [1024], "dsa_indexer_topk": [4096], "dsa_indexer_topk_paged": [4096],
              "dsa_indexer_topk_paged_fp8": [4096]}

CORRECT = ["rmsnorm_correct_functional.py", "rmsnorm_correct_rows.py", "dsa_correct_per_head.py",
           # Compiled per shape, which the paged op buckets: once a bucket, as a server pays.
           "dsa_paged_correct_compiles_per_bucket.py"]




def _evaluate(path: Path, op: str, device: str = "cpu"):
    return evaluate(op, path, device=device, dsl=kernel_dsl(path),
                    context_lengths=(SMALL if device == "cpu" else CUDA_SMALL)[op],
                    time_budget_s=0.05, limits=LIMITS,
                    # Each runtime guard on its own, as if the line the static checks
                    # read were hidden from them (they stop it first: the test below).
                    stop_at_static=False)


def test_every_candidate_the_static_checks_reject_is_stopped_before_any_process():
    stopped = 0
    for path in sorted(CANDIDATES.glob("*.py")):
        if path.name in COLLECTIVE:  # tests/test_allreduce.py evaluates these across ranks
            continue
        op = get_op(op_of(path.name))
        dsl = kernel_dsl(path)
        source = path.read_text()
        if (protected.check(source, op.baseline_path.read_text()) or ("pass",))[0] != "fail" and (
                dsl == "torch" or static_check(source, dsl)[0] != "fail"):
            continue
        result = evaluate(op.name, path, dsl=dsl, context_lengths=SMALL[op.name], limits=LIMITS)
        assert result.verdict == "rejected" and result.stopped_at == "static", path.name
        assert result.duration_s < 1, (path.name, result.duration_s)
        stopped += 1
    assert stopped >= 2  # the tolerance loosener and the torch-patching attacks at least


# The collective op's candidates (allreduce_sum), evaluated by tests/test_allreduce.py
# across two ranks, each shown misbehaving outside the harness there: the guard each fails.
COLLECTIVE = {
    "allreduce_calls_all_reduce.py": "moves-data", "allreduce_calls_the_group.py": "moves-data",
    "allreduce_rank0_only.py": "correctness", "allreduce_turns_on_multicast.py": "config",
    "allreduce_rank_hangs.py": "process", "allreduce_reaches_network.py": "loads",
    "allreduce_rewrites_the_baseline.py": "jail",
    "allreduce_hides_its_own_group.py": "moves-data",
    "allreduce_makes_a_group_when_called.py": "jail",
    "allreduce_rewrites_its_report.py": "moves-data",
    "allreduce_slows_its_clock.py": "protected-settings",
    "allreduce_caches_its_result.py": "timed-outputs",
    "allreduce_stale_on_a_reused_buffer.py": "e2e",
}


def test_each_candidate_is_sent_to_the_op_whose_forward_it_defines():
    """op_of reads the op from a file name's prefix. The paged FP8 op's candidates begin
    with the bf16 paged op's prefix and take kv_scale besides: sent to the bf16 op, the
    harness would call them with one argument short."""
    assert op_of("dsa_paged_fp8_ignores_scales.py") == "dsa_indexer_topk_paged_fp8"
    assert op_of("dsa_paged_ignores_lengths.py") == "dsa_indexer_topk_paged"
    checked = 0
    for path in sorted(CANDIDATES.glob("*.py")):
        defined = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
                   if isinstance(node, ast.FunctionDef) and node.name == "forward"]
        if not defined:  # its forward is one of the op's own kernels, imported
            continue
        signature = get_op(op_of(path.name)).signature
        wanted = signature[signature.index("(") + 1:signature.index(")")].split(", ")
        assert [arg.arg for arg in defined[0].args.args] == wanted, path.name
        checked += 1
    assert checked > len(PLANTED)


def test_a_candidate_plays_on_the_devices_its_catalogue_mark_allows():
    """Read by the red team and by bench/mixed_sweep.py to pick what each device runs."""
    either = RedTeamCandidate("rmsnorm_drops_eps.py", cuda_only=False)
    gpu = RedTeamCandidate("dsa_paged_bakes_captured_lengths.py", cuda_only=True)
    cpu = RedTeamCandidate("dsa_paged_compiles_per_length.py", cuda_only=False, cpu_only=True)
    assert [(c.plays_on("cpu"), c.plays_on("cuda")) for c in (either, gpu, cpu)] == [
        (True, True), (False, True), (True, False)]


def test_every_file_in_the_corpus_is_listed():
    assert {path.name for path in CANDIDATES.glob("*.py")} == (
        set(PLANTED) | set(PLANTED_CUDA) | set(CORRECT) | set(ATTACKS) | set(ATTACKS_CUDA)
        | set(COLLECTIVE))


def test_every_hack_of_the_catalog_has_a_candidate_rejected_by_a_guard_it_names():
    for hack in catalog():
        assert hack.candidates, hack.title
        for candidate in hack.candidates:
            attacks = {**ATTACKS, **ATTACKS_CUDA}
            if candidate.file in attacks:  # tests/test_harness_attacks.py evaluates these
                assert attacks[candidate.file][1] in hack.guards, (hack.title, candidate.file)
                continue
            if candidate.file in COLLECTIVE:  # tests/test_allreduce.py evaluates these
                assert COLLECTIVE[candidate.file] in hack.guards, (hack.title, candidate.file)
                continue
            planted = PLANTED_CUDA if candidate.cuda_only else PLANTED
            assert candidate.file in planted, (hack.title, candidate.file)
            guard, _ = planted[candidate.file]
            assert guard in hack.guards, (hack.title, candidate.file, guard)


def test_the_catalog_names_a_guard_for_every_known_hack():
    # The rows of the catalogue the product started from: none may be dropped.
    titles = {hack.title for hack in catalog()}
    assert len(titles) >= 28
    for title in ("disable CUDA graphs", "limit the context window", "shrink max_num_seqs",
                  "torch fallback", "loosen the tolerance", "time warmup only",
                  "profile the client", "disable custom all-reduce", "stale output memory",
                  "work on a side CUDA stream", "persisting-L2 carve-out",
                  "sabotaging the baseline"):
        assert title in titles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU hack: needs CUDA to play it")
@pytest.mark.parametrize(("name", "guard", "fragments"),
                         [(name, guard, fragments) for name, (guard, fragments) in PLANTED_CUDA.items()])
def test_a_gpu_hack_is_rejected_for_its_reason(name, guard, fragments):
    result = _evaluate(CANDIDATES / name, op_of(name), device="cuda")
    assert result.verdict == "rejected"
    failing = {g.name: g.detail for g in result.guards if g.status == "fail"}
    assert guard in failing, result.guards
    for fragment in fragments:
        assert fragment in failing[guard], failing[guard]


@pytest.mark.parametrize(("name", "guard", "fragments"),
                         [(name, guard, fragments) for name, (guard, fragments) in PLANTED.items()])
def test_a_planted_bug_is_rejected_for_its_reason(name, guard, fragments):
    result = _evaluate(CANDIDATES / name, op_of(name))
    assert result.verdict == "rejected"
    failing = {g.name: g.detail for g in result.guards if g.status == "fail"}
    assert guard in failing, result.guards
    for fragment in fragments:
        assert fragment in failing[guard], failing[guard]
    assert "\n" not in failing[guard]
    if guard in ("correctness", "output-type", "inputs-unchanged", "loads", "timed-outputs"):
        assert result.correct is False
    # A candidate rejected before timing is never reported as timed.
    if result.correct is False and guard != "timed-outputs":
        assert all(w.baseline_ms is None and not w.significant for w in result.workloads)


def test_a_write_outside_its_directory_never_reaches_the_disk():
    escaped = (CANDIDATES / "rmsnorm_writes_outside.py").with_suffix(".escaped")
    try:
        _evaluate(CANDIDATES / "rmsnorm_writes_outside.py", "rmsnorm")
        assert not escaped.exists()
    finally:
        escaped.unlink(missing_ok=True)


@pytest.mark.parametrize("name", CORRECT)
def test_a_correct_candidate_in_another_style_passes(name):
    result = _evaluate(CANDIDATES / name, op_of(name))
    assert result.correct is True, result.guards
    assert result.verdict in ("no-gain", "win"), [g for g in result.guards if g.status == "fail"]
    assert all(w.candidate_ms and w.candidate_ms > 0 for w in result.workloads)


@pytest.mark.parametrize(("op_name", "point"), [
    ("rmsnorm", {"block_rows": 64, "formulation": "functional", "upcast": "normalize_only"}),
    ("dsa_indexer_topk", {"chunk": 1024, "merge": "collect", "heads": "loop"}),
])
def test_the_ops_own_kernels_pass_at_several_space_points(op_name, point, tmp_path):
    kernel = next(path for name, path in get_op(op_name).kernels().items()
                  if not name.endswith(("_triton", "_cute")))
    candidate = tmp_path / kernel.name
    candidate.write_text(materialize(kernel.read_text(), point))
    result = _evaluate(candidate, op_name)
    assert result.correct is True, result.guards
    assert result.verdict != "rejected", [g for g in result.guards if g.status == "fail"]
    assert result.params == point | {key: value for key, value in result.params.items()
                                     if key not in point}


def _script(relative: str):
    """A script of the project (not a package module), loaded by its path."""
    path = CANDIDATES.parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _red_team():
    return _script("scripts/red_team.py")


def test_a_legit_candidate_rejected_only_by_first_call_beside_others_is_judged_again_alone():
    red_team = _red_team()
    name = "rmsnorm_correct_rows.py"
    shared = {"file": name, "verdict": "rejected", "failed": {"first-call": "first call at t=67: 85 ms"}}
    found = red_team.confirmed_alone(("rmsnorm", CANDIDATES / name, "torch"), shared, "cpu")
    assert found["verdict"] != "rejected", found
    assert found["shared"] == {"verdict": "rejected", "failed": shared["failed"]}
    # Another guard's rejection stands as it was: only first-call's and clock's figures
    # move with sharing.
    wrong = {**shared, "failed": {"correctness": "max abs error 0.5"}}
    assert red_team.confirmed_alone(("rmsnorm", CANDIDATES / name, "torch"), wrong, "cpu") is wrong


def test_a_hack_stopped_by_first_call_beside_others_before_its_own_guard_is_judged_again_alone():
    """A first-call rejection ends the evaluation before the end-to-end step, so a hack
    only that step catches was missed beside others: alone its own guard decides."""
    red_team = _red_team()
    name = "rmsnorm_cuts_corners_in_the_step.py"
    hack = next(hack for hack in catalog() if name in {c.file for c in hack.candidates})
    assert not set(hack.guards) & red_team.CONFIRMED_ALONE
    shared = {"file": name, "verdict": "rejected", "failed": {"first-call": "first call at t=67: 85 ms"}}
    found = red_team.confirmed_alone(("rmsnorm", CANDIDATES / name, "torch"), shared, "cpu", set(hack.guards))
    assert found["shared"] == {"verdict": "rejected", "failed": shared["failed"]}
    assert set(found["failed"]) & set(hack.guards), found
    # Caught by its own guard beside the others: that verdict stands.
    caught = {**shared, "failed": {guard: "caught" for guard in hack.guards}}
    assert red_team.confirmed_alone(("rmsnorm", CANDIDATES / name, "torch"), caught, "cpu", set(hack.guards)) is caught


def test_every_known_rejection_of_the_red_team_is_a_shipped_kernel():
    """The red team expects these rejections; a name that no op ships would expect nothing."""
    red_team = _red_team()
    shipped = {path.name for name in list_ops() for path in get_op(name).kernels().values()}
    guards = {guard for hack in catalog() for guard in hack.guards}
    for device, known in red_team.KNOWN_REJECTIONS.items():
        assert set(known) <= shipped, (device, set(known) - shipped)
        assert set(known.values()) <= guards, device


def test_the_mixed_sweep_draws_its_good_candidates_from_kernels_the_device_can_keep(tmp_path):
    # On a GPU the eager paged kernels read the lengths on the host, which a CUDA graph
    # cannot (the red team's known rejections): drawn as "good" there, they were judged
    # rejected at their first check (H100, 2026-12-06). The CuTe ones launch only there.
    mixed_sweep = _script("bench/mixed_sweep.py")
    kernels = {}
    for device in ("cpu", "cuda"):
        folder = tmp_path / device
        folder.mkdir()
        kernels[device] = {path.name for path in mixed_sweep.good_pool("dsa_indexer_topk_paged_fp8", device, folder)}
    assert kernels == {"cpu": {"per_sequence_fp8.py"}, "cuda": {"logits_topk_paged_fp8_cute.py"}}
