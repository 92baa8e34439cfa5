"""The collective op allreduce_sum and the harness's multi-rank path, on the CPU (gloo).

Each attack candidate is first run outside the harness, two ranks in plain processes,
to show it misbehaves; then inside, where it must be rejected by the guard for its hack.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from runners.e2e.tensor_parallel import SHAPES as TP_SHAPES
from runners.e2e.tensor_parallel import (
    TensorParallelDecode, TensorParallelShape, draw_tokens, draw_weights, exact_outputs, shard,
)
from runners.harness.children import CANDIDATE, Limits, child_environment
from runners.harness.collective import RankGroup, RanksWatch, check_correctness, load
from runners.harness.collective_endtoend import step_output_matches
from runners.harness.dispatch import SizedResult, dispatch_range
from runners.harness.evaluate import UsageError, evaluate
from runners.ops import WorkloadError, get_op
from runners.space import grid_points, materialize, read_literals

CANDIDATES = Path(__file__).parent / "candidates"
OP = get_op("allreduce_sum")
HONEST = OP.kernels()["shared_memory_one_shot"]
LIMITS = Limits(import_s=60, call_s=60, total_s=300)


# -- the op ---------------------------------------------------------------------------

def test_workloads_are_message_sizes_in_both_dtypes():
    names = [workload.name for workload in OP.workloads("cpu", [4096, 65536])]
    assert names == ["bytes=4096,dtype=float32", "bytes=4096,dtype=bfloat16",
                     "bytes=65536,dtype=float32", "bytes=65536,dtype=bfloat16"]
    sizes = {w.params["message_bytes"] for w in OP.workloads("cuda")}
    assert min(sizes) == 4096 and max(sizes) == 64 * 2**20
    assert OP.workloads("cpu", [65536])[1].params["elements"] == 32768


@pytest.mark.parametrize("sizes, batches, message", [
    ([2048], None, "message size 2048 is below allreduce_sum's minimum of 4,096 on cpu"),
    ([128 * 2**20], None, "above allreduce_sum's maximum of 67,108,864"),
    ([4098], None, "message size 4,098 is not a multiple of 4 bytes"),
    ([4096], [2], "batch size 2 is above allreduce_sum's maximum of 1"),
])
def test_sizes_outside_the_declared_range_are_refused_clearly(sizes, batches, message):
    with pytest.raises(WorkloadError, match=message):
        OP.workloads("cpu", sizes, batches)


def test_the_reference_is_the_exact_sum_and_every_element_is_checked():
    workload = OP.workloads("cpu", [4096])[1]  # bfloat16
    inputs = OP.make_inputs(workload, seed=3, distribution="uniform_outliers")
    x = inputs["x"]
    assert x.shape == (2, 2048) and x.dtype == torch.bfloat16
    reference = OP.reference(inputs)
    assert torch.equal(reference, x.double().sum(0))
    assert OP.check((x[0].float() + x[1].float()).to(torch.bfloat16), reference, inputs)[0]
    half = x.sum(0)
    half[-1] = x[0, -1]  # one element left unsummed
    ok, detail = OP.check(half, reference, inputs)
    assert not ok and "1 of 2,048 values differ" in detail
    assert not OP.check(x[0], reference, inputs)[0]


# -- the harness pieces -----------------------------------------------------------------

def test_the_dispatch_range_is_over_message_size():
    found = dispatch_range("message_bytes", [
        SizedResult(4096, 3.0, True), SizedResult(65536, 1.5, True),
        SizedResult(1 << 20, 0.8, True)])
    assert (found["min"], found["max"]) == (4096, 65536)
    assert found["summary"] == ("candidate for message size 4 KB–64 KB, "
                                "kept kernel beyond 64 KB")


def test_every_child_starts_with_multicast_off_whatever_the_judge_has(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    env = child_environment(tmp_path, threads=1, extra={"NVSHMEM_DISABLE_NVLS": "0"})
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
            env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")


# -- outside the harness: two ranks in plain processes ------------------------------------

@dataclass
class Plain:
    """What one rank of a plain run (no harness) saw of its forward call."""

    output: torch.Tensor
    on_the_given_group: int  # collectives, by the given group's own sequence number
    on_any_group: int  # by the sequence numbers of every group c10d made, read by the test
    counted: int  # what the harness's counter (rank_worker.CollectiveCounter) said
    multicast: str | None  # NCCL_NVLS_ENABLE in the C environment after the call


def _sequence_numbers() -> dict:
    from torch.distributed import distributed_c10d

    return {group: group._get_sequence_number_for_group() for group in distributed_c10d._world.pg_map}


def _plain_rank(rank, store, shared, candidate, shares, answers):
    import torch.distributed as dist

    from runners.harness.rank_worker import CollectiveCounter, Comm, c_environment

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    spec = importlib.util.spec_from_file_location(f"plain_{rank}", candidate)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    group = dist.group.WORLD
    comm = Comm(rank=rank, world_size=2, group=group, device=torch.device("cpu"),
                shared_dir=shared)
    if hasattr(module, "setup"):
        module.setup(comm)
    counter = CollectiveCounter()
    before = _sequence_numbers()
    output, counted = counter.around(lambda: module.forward(shares[rank].clone(), comm))
    after = _sequence_numbers()
    # As numpy: a tensor would travel as a shared-memory handle its exited sender revokes.
    answers.put((rank, output.numpy().copy(), after[group] - before[group],
                 sum(number - before.get(each, 0) for each, number in after.items()),
                 counted["total"], c_environment().get("NCCL_NVLS_ENABLE")))
    dist.barrier()
    dist.destroy_process_group()


def run_outside(candidate: Path, shares: torch.Tensor, tmp_path: Path) -> dict[int, Plain]:
    """Two ranks in plain processes, each calling setup(comm) if the candidate has it,
    then forward once on its share."""
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        ranks = [context.Process(target=_plain_rank, args=(
            rank, str(tmp_path / "store"), str(tmp_path), str(candidate), shares, answers))
            for rank in range(2)]
        for process in ranks:
            process.start()
        found = {}
        for _ in ranks:
            rank, output, *seen = answers.get(timeout=120)
            found[rank] = Plain(torch.from_numpy(output), *seen)
        for process in ranks:
            process.join(timeout=60)
            assert process.exitcode == 0
    finally:
        del os.environ["NCCL_NVLS_ENABLE"]
    return found


@pytest.fixture(scope="module")
def shares():
    return OP.make_inputs(OP.workloads("cpu", [4096])[0], seed=11, distribution="normal")["x"]


def test_outside_the_honest_kernel_sums_on_every_rank_without_a_collective(shares, tmp_path):
    found = run_outside(HONEST, shares, tmp_path)
    for rank in range(2):
        assert _is_the_sum(found[rank].output, shares)
        assert found[rank].on_any_group == 0 and found[rank].counted == 0


def _is_the_sum(output: torch.Tensor, shares: torch.Tensor) -> bool:
    return torch.allclose(output.double(), shares.double().sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["allreduce_calls_all_reduce", "allreduce_calls_the_group"])
def test_outside_a_fallback_is_right_but_runs_the_collective_library(name, shares, tmp_path):
    found = run_outside(CANDIDATES / f"{name}.py", shares, tmp_path)
    for rank in range(2):
        assert _is_the_sum(found[rank].output, shares)
        assert found[rank].on_the_given_group == 1


@pytest.mark.parametrize("name", ["allreduce_hides_its_own_group",
                                  "allreduce_makes_a_group_when_called"])
def test_outside_a_group_of_its_own_hides_the_fallback_from_the_given_group(name, shares, tmp_path):
    found = run_outside(CANDIDATES / f"{name}.py", shares, tmp_path)
    for rank in range(2):
        assert _is_the_sum(found[rank].output, shares)
        assert found[rank].on_the_given_group == 0  # the group it was given ran nothing
        assert found[rank].on_any_group == 1  # its own group ran the library's all-reduce


def test_outside_a_rank_rewrites_what_the_harness_counter_says(shares, tmp_path):
    found = run_outside(CANDIDATES / "allreduce_rewrites_its_report.py", shares, tmp_path)
    for rank in range(2):
        assert _is_the_sum(found[rank].output, shares)
        assert found[rank].on_the_given_group == 1  # all_reduce ran, by the group's own count
        assert found[rank].counted == 0  # and the worker's counter says nothing did


def test_outside_rank0_only_is_right_on_rank_0_and_wrong_on_rank_1(shares, tmp_path):
    found = run_outside(CANDIDATES / "allreduce_rank0_only.py", shares, tmp_path)
    expected = shares.double().sum(0)
    assert torch.allclose(found[0].output.double(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(found[1].output.double(), expected, rtol=1e-2, atol=1e-2)


def test_outside_the_multicast_attack_is_right_but_turns_multicast_on(shares, tmp_path):
    found = run_outside(CANDIDATES / "allreduce_turns_on_multicast.py", shares, tmp_path)
    for rank in range(2):
        assert _is_the_sum(found[rank].output, shares)
        assert found[rank].on_any_group == 0
        assert found[rank].multicast == "1"  # NCCL would now read it on, though os.environ says "0"


# -- inside the harness -------------------------------------------------------------------

def _evaluate(candidate, sizes=(4096,), budget_s=0.2, **options):
    return evaluate("allreduce_sum", candidate, context_lengths=list(sizes),
                    time_budget_s=budget_s, limits=LIMITS, **options)


def _guard(result, name):
    return next(guard for guard in result.guards if guard.name == name)


def test_the_honest_kernel_is_correct_on_every_rank_and_every_guard_passes():
    result = _evaluate(str(HONEST), sizes=(4096, 1 << 20))
    assert result.correct and result.verdict in ("win", "no-gain")
    assert all(guard.status == "pass" for guard in result.guards), result.guards
    assert "16 outputs over 4 workloads" in _guard(result, "correctness").detail
    moves_data = _guard(result, "moves-data").detail
    assert "no data crossed the jail's network" in moves_data
    assert "no rank counted a collective of any process group" in moves_data
    assert [w.name for w in result.workloads] == [w.name for w in OP.workloads("cpu", [4096, 1 << 20])]
    for workload in result.workloads:
        assert workload.samples >= 20 and workload.baseline_ms > 0 and workload.candidate_ms > 0
    assert (result.verdict == "win") == (result.dispatch is not None)
    _assert_the_step_was_checked_and_timed(result)


def _assert_the_step_was_checked_and_timed(result):
    """The tensor-parallel step's report, in the fields of any op's end-to-end check."""
    shape = TP_SHAPES["cpu"]
    e2e = result.e2e
    assert e2e["baseline_ms"] > 0 and e2e["candidate_ms"] > 0 and e2e["delta_pct"] is not None
    assert e2e["tensor_parallel"] == {**shape.as_dict(), "world_size": 2, "message_bytes": 4096,
                                      "all_reduces_per_call": 12}
    (point,) = e2e["points"]
    assert (point["context_length"], point["batch"], point["decode_steps"]) == (32, 8, 3)
    assert point["samples"] >= 20 and point["noise_floor_pct"] == 50.0
    assert point["candidate_tokens_per_s"] == pytest.approx(8 * 3 / (point["candidate_ms"] / 1e3))
    guard = _guard(result, "e2e")
    assert guard.detail.startswith("tensor-parallel decode step (2 ranks) "), guard.detail
    assert "ctx=32, batch 8" in guard.detail and "tokens/s" in guard.detail


def test_the_baseline_against_itself_is_correct_and_passes_every_guard():
    # Its verdict is left to the timing: without an A/A group of its own the multi-rank
    # path has only the CPU's fixed noise floor, which a busy machine can exceed.
    result = _evaluate("baseline")
    assert result.correct and result.verdict != "rejected"
    assert all(guard.status == "pass" for guard in result.guards), result.guards
    assert "the baseline itself" in _guard(result, "moves-data").detail
    _assert_the_step_was_checked_and_timed(result)


@pytest.mark.parametrize("name, via", [
    ("allreduce_calls_all_reduce", "all_reduce ×1"),
    ("allreduce_calls_the_group", "on the process group directly"),
    ("allreduce_hides_its_own_group", "on the process group directly"),
])
def test_inside_a_fallback_to_the_collective_library_is_rejected(name, via):
    result = _evaluate(str(CANDIDATES / f"{name}.py"))
    assert result.verdict == "rejected" and result.correct
    guard = _guard(result, "moves-data")
    assert guard.status == "fail" and via in guard.detail
    # Seen from outside the ranks: the data went through the jail's network.
    assert "data segment(s) sent while checking bytes=4096,dtype=float32" in guard.detail
    assert "rank 0" in guard.detail and "rank 1" in guard.detail
    assert not result.workloads[0].baseline_ms  # never timed


def test_inside_a_rewritten_report_does_not_hide_the_data_the_fallback_sent():
    result = _evaluate(str(CANDIDATES / "allreduce_rewrites_its_report.py"))
    assert result.verdict == "rejected" and result.correct
    guard = _guard(result, "moves-data")
    assert guard.status == "fail"
    assert "data segment(s) sent while checking" in guard.detail
    # The ranks' own count was rewritten to nothing: the judge did not need it.
    assert "counted torch.distributed collectives" not in guard.detail, guard.detail
    assert not result.workloads[0].baseline_ms


def test_inside_a_group_made_after_setup_cannot_connect():
    result = _evaluate(str(CANDIDATES / "allreduce_makes_a_group_when_called.py"))
    assert result.verdict == "rejected" and not result.correct
    jail = _guard(result, "jail")
    assert jail.status == "fail"
    assert "once the group was set up: no new network socket" in jail.detail, jail.detail
    assert _guard(result, "correctness").status == "fail"  # its forward could not run
    assert not result.workloads[0].baseline_ms


def test_inside_a_sum_on_rank_0_only_fails_correctness_on_rank_1():
    result = _evaluate(str(CANDIDATES / "allreduce_rank0_only.py"))
    assert result.verdict == "rejected" and not result.correct
    guard = _guard(result, "correctness")
    assert guard.status == "fail" and ", rank 1:" in guard.detail and ", rank 0:" not in guard.detail


def test_inside_turning_multicast_on_fails_the_config_guard_at_run_time():
    # Past the static stage, which stops it first, to show the run-time guard.
    result = _evaluate(str(CANDIDATES / "allreduce_turns_on_multicast.py"), stop_at_static=False)
    assert result.verdict == "rejected" and result.correct
    guard = _guard(result, "config")
    assert guard.status == "fail"
    assert "NCCL_NVLS_ENABLE: 0 → 1 (in the C environment)" in guard.detail
    assert _guard(result, "protected-settings").status == "fail"


def test_a_candidate_that_cannot_load_is_rejected_on_every_rank(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def forward(x, comm):\n    return x +\n")
    result = _evaluate(str(broken))
    assert result.verdict == "rejected"
    assert "not valid Python" in _guard(result, "loads").detail


def test_a_rank_that_hangs_is_killed_and_reported():
    result = evaluate("allreduce_sum", str(CANDIDATES / "allreduce_rank_hangs.py"),
                      context_lengths=[4096], time_budget_s=0.2,
                      limits=Limits(import_s=60, call_s=5, total_s=120))
    assert result.verdict == "rejected"
    guard = _guard(result, "process")
    assert "did not finish checking" in guard.detail and "killed" in guard.detail


def test_the_multi_rank_path_refuses_what_it_does_not_run_yet():
    with pytest.raises(UsageError, match="spans 2 ranks"):
        evaluate("allreduce_sum", str(HONEST), dsl="triton")


# -- the jail around a group of ranks: an attack per boundary ------------------------------

class Helper:
    """A server on the host's loopback that sums what every rank sends it: the outside
    help allreduce_reaches_network.py asks for. Each rank keeps one connection (made in
    its setup); each call, every rank sends its share and gets the total back."""

    def __init__(self, port: int, world_size: int = 2) -> None:
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.listener.settimeout(0.2)
        self.world_size, self.connections = world_size, 0
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        links = []
        while not self.stopping and len(links) < self.world_size:
            try:
                link, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            link.settimeout(0.2)
            links.append(link)
        while not self.stopping:
            shares = []
            for link in links:
                header = self._read(link, 8)
                share = header and self._read(link, struct.unpack("<Q", header)[0])
                if not share:
                    return  # a rank hung up, or the helper is stopping
                shares.append(np.frombuffer(share, dtype=np.float32))
            total = np.sum(shares, axis=0, dtype=np.float32).tobytes()
            for link in links:
                link.sendall(total)

    def _read(self, link: socket.socket, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            try:
                chunk = link.recv(size - len(data))
            except TimeoutError:
                if self.stopping:
                    return None
                continue
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.stopping = True
        self.thread.join()
        self.listener.close()


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"attack_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NETWORK = CANDIDATES / "allreduce_reaches_network.py"


def test_outside_a_rank_has_a_helper_on_the_host_do_the_sum(shares, tmp_path):
    helper = Helper(_module(NETWORK).HELPER_PORT)
    try:
        found = run_outside(NETWORK, shares, tmp_path)
    finally:
        helper.close()
    assert helper.connections == 2
    for rank in range(2):
        assert _is_the_sum(found[rank].output, shares)
        assert found[rank].on_any_group == 0  # no data moved between the ranks


def test_inside_the_jail_a_rank_reaches_nothing_outside_its_own_loopback():
    helper = Helper(_module(NETWORK).HELPER_PORT)
    try:
        result = _evaluate(str(NETWORK))
    finally:
        helper.close()
    assert helper.connections == 0  # the host's loopback is not the jail's
    assert result.verdict == "rejected" and not result.correct
    guard = _guard(result, "loads")  # its setup(comm) could not connect
    assert guard.status == "fail" and "ConnectionRefusedError" in guard.detail, guard.detail


REWRITES = CANDIDATES / "allreduce_rewrites_the_baseline.py"


def test_outside_a_rank_rewrites_the_baseline_in_the_project_tree(tmp_path):
    # A copy of the tree's layout: the attack writes relative to its own file.
    target = tmp_path / "runners" / "ops" / "allreduce_sum" / "baseline.py"
    target.parent.mkdir(parents=True)
    target.write_text("fast")
    copy = tmp_path / "tests" / "candidates" / REWRITES.name
    copy.parent.mkdir(parents=True)
    shutil.copy(REWRITES, copy)
    _module(copy)
    assert "time.sleep(0.05)" in target.read_text()


def test_inside_the_jail_the_project_tree_is_read_only_and_the_write_is_named():
    baseline = OP.baseline_path.read_bytes()
    # Past the static stage (its source imports the harness's kernel) to the jail.
    result = _evaluate(str(REWRITES), stop_at_static=False)
    assert OP.baseline_path.read_bytes() == baseline
    assert result.verdict == "rejected"
    guard = _guard(result, "jail")
    assert guard.status == "fail"
    assert f"writing outside its directory: {OP.baseline_path}" in guard.detail, guard.detail


SLOW_CLOCK = CANDIDATES / "allreduce_slows_its_clock.py"


def test_outside_a_rank_timing_itself_would_report_a_slow_call_as_fast(tmp_path):
    program = textwrap.dedent(f"""
        import importlib.util, time, torch
        from runners.harness.rank_worker import Comm
        spec = importlib.util.spec_from_file_location("c", {str(SLOW_CLOCK)!r})
        c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
        comm = Comm(rank=0, world_size=1, group=None, device=torch.device("cpu"),
                    shared_dir={str(tmp_path)!r})
        x = torch.ones(1024)
        wall, said = time.monotonic(), time.perf_counter_ns()
        assert torch.equal(c.forward(x, comm), x)
        print((time.perf_counter_ns() - said) / 1e6, (time.monotonic() - wall) * 1e3)
    """)
    said_ms, wall_ms = map(float, subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}).stdout.split())
    assert wall_ms >= 20 and said_ms < 1


def test_inside_the_judges_clock_times_the_group_and_the_slow_call_shows():
    result = _evaluate(str(SLOW_CLOCK), stop_at_static=False)
    # Timed all the same: the judge's clock, which the ranks' processes do not hold.
    for workload in result.workloads:
        assert workload.candidate_ms >= 20 and workload.speedup < 1
    # And its source says what it did to the clock.
    assert result.correct and result.verdict == "rejected"
    assert "time.perf_counter_ns = " in _guard(result, "protected-settings").detail


# -- the cascade's static stage and the timed outputs --------------------------------------

def test_a_source_the_static_stage_rejects_starts_no_rank_group(tmp_path):
    source = tmp_path / "imports_the_harness.py"
    source.write_text("import runners.harness.timing  # noqa: F401\n"
                      "from runners.ops.allreduce_sum.kernels.shared_memory_one_shot import forward\n")
    result = _evaluate(str(source))
    assert result.verdict == "rejected" and result.stopped_at == "static"
    guard = _guard(result, "protected-settings")
    assert guard.status == "fail" and result.error == guard.detail
    assert "runners.harness" in guard.detail, guard.detail
    assert not any(workload.baseline_ms for workload in result.workloads)  # nothing ran
    assert [g.name for g in result.guards] == ["protected-settings"]


CACHES = CANDIDATES / "allreduce_caches_its_result.py"


def _plain_rank_caching(rank, store, shared, candidate, shares, answers):
    import torch.distributed as dist

    from runners.harness.rank_worker import Comm

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    spec = importlib.util.spec_from_file_location(f"plain_{rank}", candidate)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    comm = Comm(rank=rank, world_size=2, group=dist.group.WORLD, device=torch.device("cpu"),
                shared_dir=shared)
    x = shares[rank].clone()
    first = module.forward(x, comm).numpy().copy()
    x.mul_(2)  # every rank's share changes in place: the sum is now twice the first
    dist.barrier()
    again = module.forward(x, comm).numpy().copy()
    answers.put((rank, first, again))
    dist.barrier()
    dist.destroy_process_group()


def test_outside_the_caching_kernel_returns_a_stale_sum_for_a_changed_tensor(shares, tmp_path):
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    ranks = [context.Process(target=_plain_rank_caching, args=(
        rank, str(tmp_path / "store"), str(tmp_path), str(CACHES), shares, answers))
        for rank in range(2)]
    for process in ranks:
        process.start()
    found = {}
    for _ in ranks:
        rank, first, again = answers.get(timeout=120)
        found[rank] = (torch.from_numpy(first), torch.from_numpy(again))
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    expected = shares.double().sum(0)
    for rank in range(2):
        first, again = found[rank]
        assert torch.allclose(first.double(), expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(again, first)  # the stored sum, not the new one
        assert not torch.allclose(again.double(), 2 * expected, rtol=1e-2, atol=1e-2)


def test_inside_the_caching_kernel_is_checked_right_and_then_caught_timed():
    result = _evaluate(str(CACHES))
    assert _guard(result, "correctness").status == "pass"  # the checked calls did the work
    assert result.verdict == "rejected" and not result.correct and result.dispatch is None
    guard = _guard(result, "timed-outputs")
    assert guard.status == "fail" and "timed round" in guard.detail, guard.detail
    assert "rank 0" in guard.detail and "values differ" in guard.detail, guard.detail


# -- the end-to-end check: a tensor-parallel decode step across the two ranks -------------

def test_the_steps_all_reduces_are_messages_of_the_ops_declared_range():
    for device, shape in TP_SHAPES.items():
        low, high = OP.context_length_range(device)
        assert low <= shape.message_bytes <= high, (device, shape.message_bytes)
    # On the CPU, the smallest size the op is timed at: a decode step's hidden vectors.
    assert TP_SHAPES["cpu"].message_bytes == min(OP.default_context_lengths("cpu")) == 4096


def test_each_rank_holds_its_own_heads_and_columns_and_a_wrong_shard_is_refused_clearly():
    shape = TP_SHAPES["cpu"]
    weights = draw_weights(shape, seed=5)
    halves = [shard(weights, shape, rank, 2) for rank in range(2)]
    # Column-parallel by heads, row-parallel by the matching rows, the cache by heads:
    # the two halves are the whole, with nothing in both.
    assert torch.equal(torch.cat([half["query"] for half in halves], dim=2), weights["query"])
    assert torch.equal(torch.cat([half["down"] for half in halves], dim=1), weights["down"])
    assert torch.equal(torch.cat([half["keys"] for half in halves], dim=2), weights["keys"])
    assert halves[0]["query"].shape == (2, 256, 128) and halves[0]["keys"].shape == (2, 8, 2, 32, 64)
    with pytest.raises(ValueError, match="the shard's 'query' is shape \\[2, 256, 256\\], not of "
                                         "shape \\[2, 256, 128\\] \\(one of 2 ranks\\)"):
        TensorParallelDecode(shape, weights, world_size=2, all_reduce=lambda partial: partial)
    with pytest.raises(ValueError, match="heads 3 cannot be split evenly across 2 ranks"):
        shard(weights, TensorParallelShape(layers=2, hidden=255, heads=3, ffn=512,
                                           context_length=32, batch=8, decode_steps=3), 0, 2)
    with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
        shard(weights, shape, 2, 2)
    step = TensorParallelDecode(shape, weights, world_size=1, all_reduce=lambda partial: partial)
    with pytest.raises(ValueError, match="starts from a token batch of shape \\[8, 256\\] in "
                                         "torch.bfloat16, not \\[8, 256\\] in torch.float32"):
        step(torch.zeros(8, 256))


def test_every_call_starts_from_the_same_cache_so_each_has_an_answer_of_its_own():
    shape = TP_SHAPES["cpu"]
    weights = draw_weights(shape, seed=5)
    step = TensorParallelDecode(shape, weights, world_size=1, all_reduce=lambda partial: partial)
    first, second = draw_tokens(shape, seed=6, calls=2)
    once = step(first)
    step(second)  # writes its own keys and values at the decode positions
    assert torch.equal(step(first), once)
    assert once.shape == (3, 8, 256)
    # Even its last decode step is its own tokens': each step feeds the next.
    assert not torch.equal(step(second)[-1], once[-1])
    assert step_output_matches(once, exact_outputs(shape, weights, first)) == (True, "")


STALE = CANDIDATES / "allreduce_stale_on_a_reused_buffer.py"
STEP_CANDIDATES = {"honest": HONEST, "baseline": OP.baseline_path, "stale": STALE}


def _plain_rank_stepping(rank, store, shared, candidates, share, weights, tokens, answers):
    import torch.distributed as dist

    from runners.harness.rank_worker import Comm

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    comm = Comm(rank=rank, world_size=2, group=dist.group.WORLD, device=torch.device("cpu"),
                shared_dir=shared)
    shape = TP_SHAPES["cpu"]
    found = {}
    for name, path in candidates.items():
        spec = importlib.util.spec_from_file_location(f"plain_{name}_{rank}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        # One op call on a fresh tensor, as the harness's checks make it; then the step,
        # which gives the all-reduce one buffer, call after call.
        op_call = module.forward(share.clone(), comm)
        step = TensorParallelDecode(shape, shard(weights, shape, rank, 2), world_size=2,
                                    all_reduce=lambda partial, module=module: module.forward(partial, comm))
        # As numpy (float32 holds every bfloat16): a tensor would travel as a handle the
        # exited sender revokes.
        found[name] = (op_call.numpy().copy(), step(tokens).float().numpy())
    answers.put((rank, found))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def plain_steps(shares, tmp_path_factory):
    """Each of STEP_CANDIDATES in two ranks of plain processes (no harness): rank r's op
    call on its share, and its outputs of the step from the same weights and tokens."""
    folder = tmp_path_factory.mktemp("plain-steps")
    shape = TP_SHAPES["cpu"]
    weights = draw_weights(shape, seed=21)
    tokens = draw_tokens(shape, seed=22, calls=1)[0]
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    ranks = [context.Process(target=_plain_rank_stepping, args=(
        rank, str(folder / "store"), str(folder), {k: str(v) for k, v in STEP_CANDIDATES.items()},
        shares[rank], weights, tokens, answers)) for rank in range(2)]
    for process in ranks:
        process.start()
    found = {}
    for _ in ranks:
        rank, outputs = answers.get(timeout=120)
        found[rank] = {name: (torch.from_numpy(op_call), torch.from_numpy(step).to(torch.bfloat16))
                       for name, (op_call, step) in outputs.items()}
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    return found, exact_outputs(shape, weights, tokens)


@pytest.mark.parametrize("name", ["honest", "baseline"])
def test_outside_the_step_on_two_ranks_matches_the_exact_step_on_each(name, plain_steps):
    found, exact = plain_steps
    for rank in range(2):
        assert step_output_matches(found[rank][name][1], exact) == (True, "")
    # Every rank goes on with the same activations after every all-reduce.
    assert torch.equal(found[0][name][1], found[1][name][1])


def test_outside_the_stale_all_reduce_sums_a_fresh_tensor_but_not_the_steps_buffer(plain_steps, shares):
    found, exact = plain_steps
    for rank in range(2):
        op_call, step = found[rank]["stale"]
        assert _is_the_sum(op_call, shares)
        ok, detail = step_output_matches(step, exact)
        assert not ok and "24 of 24 sequence outputs" in detail, detail
        # The first decode step's output already: its first all-reduce's sum came back
        # for every later one.
        assert not torch.allclose(step[0].double(), exact[0], rtol=0.05, atol=0.05)


def test_inside_the_stale_all_reduce_passes_the_op_checks_and_fails_the_step():
    result = _evaluate(str(STALE))
    # Right in every call the op's checks and timing made: every one a fresh tensor.
    assert _guard(result, "correctness").status == "pass"
    assert not any(guard.name == "timed-outputs" for guard in result.guards)
    assert all(workload.candidate_ms > 0 for workload in result.workloads)
    assert result.verdict == "rejected" and result.dispatch is None and result.e2e is None
    guard = _guard(result, "e2e")
    assert guard.status == "fail"
    assert guard.detail.startswith("wrong output of the tensor-parallel decode step: call 1, rank 0: "
                                   "24 of 24 sequence outputs"), guard.detail
    assert "the same buffer with new contents" in guard.detail
    assert [g.name for g in result.guards if g.status == "fail"] == ["e2e"]


# -- every point of the shipped kernels' spaces, across two ranks on the CPU path ---------

# Messages of one partial chunk and of several chunks with a partial last one, for every
# chunk size of the shipped space: 4 KB, and 2 MB + 4 KB (525,312 float32 elements,
# 1,050,624 bfloat16, past the largest chunk of 1,048,576).
SPACE_SIZES = [4096, 2 * 2**20 + 4096]


def _space_points():
    for kernel, path in OP.kernels().items():
        for point in grid_points(read_literals(path.read_text())[1]):
            label = ",".join(f"{key}={value}" for key, value in point.items())
            yield pytest.param(path, point, id=f"{kernel}-{label}")


@pytest.mark.parametrize(("path", "point"), list(_space_points()))
def test_every_point_of_every_shipped_space_is_correct_on_every_rank(path, point, tmp_path):
    candidate = tmp_path / path.name
    candidate.write_text(materialize(path.read_text(), point))
    # The judge's own rank group and check, as an evaluation runs them (no timing).
    group = RankGroup(role=CANDIDATE, op=OP, path=candidate, device="cpu", threads=1,
                      limits=LIMITS, deadline=time.monotonic() + LIMITS.total_s)
    watch = RanksWatch()
    try:
        load(group, watch)
        guards = check_correctness(OP, group, OP.workloads("cpu", SPACE_SIZES),
                                   secret_seed=2024, watch=watch)
    finally:
        group.close()
    assert [(guard.name, guard.status) for guard in guards] == [
        ("correctness", "pass"), ("inputs-unchanged", "pass")], guards
    assert "16 outputs over 4 workloads" in guards[0].detail
    assert watch.moved_data_itself and not watch.network_unread
    assert not group.refused, group.refused


# -- the static stage: the same checks, once, as for one process ---------------------------

def _lib_with(tmp_path: Path, name: str, source: str) -> Path:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / name).write_text(source)
    return lib


@pytest.mark.parametrize(("lib_source", "guard", "fragment"), [
    # A shared file that loosens the op's tolerance: named with its path.
    ("from runners.ops import get_op\nget_op('allreduce_sum').tolerances = {}\n"
     "def forward(x, comm):\n    return x\n",
     "protected-settings", "runners/kernel_lib/sums.py: the candidate changes"),
    # A shared file that imports by a name built at run time, which no judge can read.
    ("import importlib\nforward = importlib.import_module('runners.kernel_lib.' + 'x').forward\n",
     "imports", "runners/kernel_lib/sums.py line 2: importlib.import_module() with a name computed"),
], ids=["loosens-the-tolerance", "imports-by-a-computed-name"])
def test_shared_code_a_collective_candidate_imports_is_checked_before_any_rank(
        tmp_path, lib_source, guard, fragment):
    lib = _lib_with(tmp_path, "sums.py", lib_source)
    candidate = tmp_path / "candidate.py"
    candidate.write_text("from runners.kernel_lib.sums import forward  # noqa: F401\n")
    result = _evaluate(str(candidate), lib=str(lib))
    assert result.verdict == "rejected" and result.stopped_at == "static"
    found = _guard(result, guard)
    assert found.status == "fail" and fragment in found.detail, found.detail
    if guard == "protected-settings":
        assert "changes a tolerance" in found.detail
    assert not any(workload.baseline_ms for workload in result.workloads)  # no rank ran


def test_a_declared_encoding_other_than_utf8_stops_a_collective_candidate_statically(tmp_path):
    candidate = tmp_path / "latin.py"
    candidate.write_bytes(b"# -*- coding: latin-1 -*-\n" + HONEST.read_bytes())
    result = _evaluate(str(candidate))
    assert result.verdict == "rejected" and result.stopped_at == "static"
    assert "encoding" in _guard(result, "protected-settings").detail


def test_the_ranks_run_the_shared_code_the_judge_read_and_hashed(tmp_path):
    lib = _lib_with(tmp_path, "one_shot.py", HONEST.read_text())
    candidate = tmp_path / "candidate.py"
    candidate.write_text("from runners.kernel_lib.one_shot import forward  # noqa: F401\n")
    result = _evaluate(str(candidate), lib=str(lib))
    assert result.correct and result.verdict != "rejected", result.guards
    assert [file["path"] for file in result.lib_files] == ["one_shot.py"]
    assert "one_shot.py" in _guard(result, "imports").detail
    assert _guard(result, "moves-data").status == "pass"
