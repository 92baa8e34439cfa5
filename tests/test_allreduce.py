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
from pathlib import Path

import numpy as np
import pytest
import torch

from runners.harness.children import Limits, child_environment
from runners.harness.dispatch import SizedResult, dispatch_range
from runners.harness.evaluate import UsageError, evaluate
from runners.ops import WorkloadError, get_op

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

def _plain_rank(rank, store, shared, candidate, shares, answers):
    import torch.distributed as dist

    from runners.harness.rank_worker import Comm, c_environment

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    spec = importlib.util.spec_from_file_location(f"plain_{rank}", candidate)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    group = dist.group.WORLD
    before = group._get_sequence_number_for_group()
    comm = Comm(rank=rank, world_size=2, group=group, device=torch.device("cpu"),
                shared_dir=shared)
    output = module.forward(shares[rank].clone(), comm)
    # As numpy: a tensor would travel as a shared-memory handle its exited sender revokes.
    answers.put((rank, output.numpy().copy(), group._get_sequence_number_for_group() - before,
                 c_environment().get("NCCL_NVLS_ENABLE")))
    dist.barrier()
    dist.destroy_process_group()


def _two_plain_ranks(target, candidate: Path, shares: torch.Tensor, tmp_path: Path) -> dict[int, tuple]:
    """Runs target(rank, store, shared folder, candidate, shares, answers) as ranks 0 and 1
    in spawned processes; what each put in `answers` (its rank first), by rank."""
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    ranks = [context.Process(target=target, args=(
        rank, str(tmp_path / "store"), str(tmp_path), str(candidate), shares, answers))
        for rank in range(2)]
    for process in ranks:
        process.start()
    found = {}
    for _ in ranks:
        rank, *answer = answers.get(timeout=120)
        found[rank] = answer
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    return found


def run_outside(candidate: Path, shares: torch.Tensor, tmp_path: Path) -> dict[int, tuple]:
    """Each rank's (output, collectives run, NCCL_NVLS_ENABLE after the call)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        found = _two_plain_ranks(_plain_rank, candidate, shares, tmp_path)
    finally:
        del os.environ["NCCL_NVLS_ENABLE"]
    return {rank: (torch.from_numpy(output), collectives, multicast)
            for rank, (output, collectives, multicast) in found.items()}


@pytest.fixture(scope="module")
def shares():
    return OP.make_inputs(OP.workloads("cpu", [4096])[0], seed=11, distribution="normal")["x"]


def test_outside_the_honest_kernel_sums_on_every_rank_without_a_collective(shares, tmp_path):
    found = run_outside(HONEST, shares, tmp_path)
    for rank in range(2):
        output, collectives, _ = found[rank]
        assert torch.allclose(output.double(), shares.double().sum(0), rtol=1e-6, atol=1e-6)
        assert collectives == 0


@pytest.mark.parametrize("name", ["allreduce_calls_all_reduce", "allreduce_calls_the_group"])
def test_outside_a_fallback_is_right_but_runs_the_collective_library(name, shares, tmp_path):
    found = run_outside(CANDIDATES / f"{name}.py", shares, tmp_path)
    for rank in range(2):
        output, collectives, _ = found[rank]
        assert torch.allclose(output.double(), shares.double().sum(0), rtol=1e-6, atol=1e-6)
        assert collectives == 1


def test_outside_rank0_only_is_right_on_rank_0_and_wrong_on_rank_1(shares, tmp_path):
    found = run_outside(CANDIDATES / "allreduce_rank0_only.py", shares, tmp_path)
    expected = shares.double().sum(0)
    assert torch.allclose(found[0][0].double(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(found[1][0].double(), expected, rtol=1e-2, atol=1e-2)


def test_outside_the_multicast_attack_is_right_but_turns_multicast_on(shares, tmp_path):
    found = run_outside(CANDIDATES / "allreduce_turns_on_multicast.py", shares, tmp_path)
    for rank in range(2):
        output, collectives, multicast = found[rank]
        assert torch.allclose(output.double(), shares.double().sum(0), rtol=1e-6, atol=1e-6)
        assert collectives == 0
        assert multicast == "1"  # NCCL would now read it on, though os.environ says "0"


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
    assert "no collective of any process group" in _guard(result, "moves-data").detail
    assert [w.name for w in result.workloads] == [w.name for w in OP.workloads("cpu", [4096, 1 << 20])]
    for workload in result.workloads:
        assert workload.samples >= 20 and workload.baseline_ms > 0 and workload.candidate_ms > 0
    assert (result.verdict == "win") == (result.dispatch is not None)


def test_the_baseline_against_itself_is_correct_and_passes_every_guard():
    # Its verdict is left to the timing: without an A/A group of its own the multi-rank
    # path has only the CPU's fixed noise floor, which a busy machine can exceed.
    result = _evaluate("baseline")
    assert result.correct and result.verdict != "rejected"
    assert all(guard.status == "pass" for guard in result.guards), result.guards
    assert "the baseline itself" in _guard(result, "moves-data").detail


@pytest.mark.parametrize("name, via", [
    ("allreduce_calls_all_reduce", "all_reduce ×1"),
    ("allreduce_calls_the_group", "on the process group directly"),
])
def test_inside_a_fallback_to_the_collective_library_is_rejected(name, via):
    result = _evaluate(str(CANDIDATES / f"{name}.py"))
    assert result.verdict == "rejected" and result.correct
    guard = _guard(result, "moves-data")
    assert guard.status == "fail" and via in guard.detail
    assert "rank 0" in guard.detail and "rank 1" in guard.detail
    assert not result.workloads[0].baseline_ms  # never timed


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
    help allreduce_reaches_network.py asks for."""

    def __init__(self, port: int, world_size: int = 2) -> None:
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.listener.settimeout(0.2)
        self.world_size, self.connections = world_size, 0
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        links, shares = [], []
        while not self.stopping:
            try:
                link, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            link.settimeout(30)
            size = struct.unpack("<Q", self._read(link, 8))[0]
            links.append(link)
            shares.append(np.frombuffer(self._read(link, size), dtype=np.float32))
            if len(links) == self.world_size:
                total = np.sum(shares, axis=0, dtype=np.float32).tobytes()
                for each in links:
                    each.sendall(total)
                    each.close()
                links, shares = [], []

    @staticmethod
    def _read(link: socket.socket, size: int) -> bytes:
        data = b""
        while len(data) < size:
            data += link.recv(size - len(data))
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
        output, collectives, _ = found[rank]
        assert torch.allclose(output.double(), shares.double().sum(0), rtol=1e-6, atol=1e-6)
        assert collectives == 0  # no data moved between the ranks


def test_inside_the_jail_a_rank_reaches_nothing_outside_its_own_loopback():
    helper = Helper(_module(NETWORK).HELPER_PORT)
    try:
        result = _evaluate(str(NETWORK))
    finally:
        helper.close()
    assert helper.connections == 0  # the host's loopback is not the jail's
    assert result.verdict == "rejected" and not result.correct
    guard = _guard(result, "correctness")
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
    module.setup(comm)
    x = shares[rank].clone()
    first = module.forward(x, comm).numpy().copy()
    x.mul_(2)  # every rank's share changes in place: the sum is now twice the first
    dist.barrier()
    again = module.forward(x, comm).numpy().copy()
    answers.put((rank, first, again))
    dist.barrier()
    dist.destroy_process_group()


def test_outside_the_caching_kernel_returns_a_stale_sum_for_a_changed_tensor(shares, tmp_path):
    found = _two_plain_ranks(_plain_rank_caching, CACHES, shares, tmp_path)
    expected = shares.double().sum(0)
    for rank in range(2):
        first, again = map(torch.from_numpy, found[rank])
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
