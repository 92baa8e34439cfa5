"""Attacks by a candidate that has read the harness's source, one or more per property of
docs/threat-model.md: each is first shown to misbehave outside the harness (in a plain
Python process of its own: some patch torch or leave processes behind), then evaluated,
and must be rejected by the guard its row in skills/reward-hacks.md names, with that
guard's evidence.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from runners.harness import Limits, evaluate, measure
from runners.harness.dsl import kernel_dsl
from runners.harness.hacks import catalog, op_of

ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ROOT / "tests" / "candidates"
LIMITS = Limits(import_s=20, call_s=20, memory_bytes=1024 * 2**20)

# file -> (property, guard that must fail, fragments of its detail, context lengths)
ATTACKS = {
    "rmsnorm_caches_by_fingerprint.py": (1, "correctness", ["nearly repeated"], [64]),
    "rmsnorm_works_at_load.py": (1, "correctness", ["values differ from the reference"], [64]),
    "rmsnorm_works_on_resume.py": (3, "clock", ["reported times disagree with the judge's clock",
                                                "longer beyond their reported times"],
                                   [4096]),
    "rmsnorm_finishes_on_raw_thread.py": (2, "correctness", ["seed #1"], [64]),
    "rmsnorm_fills_on_read.py": (2, "correctness", ["seed #1"], [64]),
    "rmsnorm_defers_to_timer.py": (2, "correctness", ["seed #1"], [64]),
    "rmsnorm_aliases_its_outputs.py": (2, "aliasing", ["shares memory with the output of call"], [64]),
    "rmsnorm_finishes_after_replying.py": (2, "timed-outputs", [], [64]),
    "rmsnorm_works_after_writing_its_reply.py": (3, "clock", ["reported times disagree with the judge's clock",
                                                              "work the reported times do not show"], [64]),
    "rmsnorm_cuts_corners_in_the_step.py": (2, "e2e", ["the output of the decode step",
                                                       "away from the kept kernel's"], [64]),
    # At T=64 half a call is ~0.08 ms, inside one request's margin: caught because short
    # calls are timed in batches.
    "rmsnorm_rewrites_its_clock.py": (3, "clock", ["reported times disagree with the judge's clock",
                                                   "the candidate's requests of"], [64]),
    "rmsnorm_more_threads_in_call.py": (4, "config", ["threads during a call"], [4096]),
    "rmsnorm_widens_cores_in_call.py": (4, "jail", ["sched_setaffinity"], [64]),
    "rmsnorm_writes_with_libc.py": (5, "jail", ["writing outside its directory",
                                                "runners/ops/rmsnorm/baseline.py (openat)"], [64]),
    "rmsnorm_leaves_a_helper.py": (5, "jail", ["starting a process"], [64]),
    "rmsnorm_saves_outside_with_torch.py": (5, "jail", ["writing outside its directory",
                                                        "kernel-lab-answers.pt"], [64]),
    "rmsnorm_counts_the_judges_reads.py": (2, "timed-outputs", ["values differ from the reference"], [64]),
    "rmsnorm_rewrites_the_baselines_inputs.py": (5, "jail", ["writing outside its directory",
                                                             "/proc/self/fd/", "/task/"], [64]),
    "rmsnorm_skips_one_slot.py": (2, "timed-outputs", ["values differ from the reference"], [64]),
    "rmsnorm_tile_multiples_only.py": (6, "correctness", ["secret size"], [64]),
    "dsa_chunks_of_2048_only.py": (6, "correctness", ["secret size"], [2048]),
    "rmsnorm_bakes_in_eps.py": (6, "correctness", ["secret size", ",eps="], [64]),
    "rmsnorm_drops_eps.py": (6, "correctness", ["NaN"], [64]),
}

# Attacks that need a run long enough to play: the read counter must see four reads
# before it cheats, and then be read again; one wrong slot of a batch, read in turn.
BUDGETS_S = {"rmsnorm_counts_the_judges_reads.py": 3.0, "rmsnorm_skips_one_slot.py": 3.0}

# Attacks only a GPU can play: (property, guard, fragments, context lengths). A time the
# GPU did not report, or work left running on it, is seen by whichever comes first: the
# judge's clock or its probe waiting on the GPU (clock), the output read before the work
# ended (correctness), or a reported time below the hardware's floor (roofline).
ATTACKS_CUDA = {
    "rmsnorm_leaves_gpu_work.py": (3, "clock", [], [65536]),
    "rmsnorm_halves_gpu_time.py": (3, "clock", [], [65536]),
    "rmsnorm_skips_the_harness_work.py": (3, "timed-outputs", [], [1024, 65536]),
}
GPU_WORK_GUARDS = {"clock": "judge's",
                   "correctness": "values differ from the reference",
                   "cuda-graph": "work left running on the GPU past the reply",
                   "roofline": "is below the physical floor"}
# An attack on the harness's own work is seen by the output it did not copy for the judge.
SKIPPED_WORK_GUARDS = {"timed-outputs": "values differ from the reference"}
# Work left for after the reply: the judge's clock runs until the worker waits on its
# next request and the jail is stopped then, so the handler's rows are unfinished when
# the output is read (values wrong, or the memory's NaN), or, when the stop came before
# the handler started, it runs once the jail is resumed, inside the next request, and the
# judge's clock sees it.
AFTER_REPLY_GUARDS = {"timed-outputs": "", "clock": "work the reported times do not show"}
EITHER = {"rmsnorm_finishes_after_replying.py": AFTER_REPLY_GUARDS}

# What each does outside the harness, as a script that exits 0 when it misbehaved.
# CANDIDATE is the candidate's path; `load()` imports it as a module.
PRELUDE = """
import importlib.util, os, sys, time, torch
sys.path.insert(0, ROOT)
def load(path=None):
    spec = importlib.util.spec_from_file_location("candidate", path or CANDIDATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
def rmsnorm(x, weight, eps=1e-6):
    hidden = x.float()
    return (hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
torch.manual_seed(0)
x, weight = torch.randn(256, 1024), torch.randn(1024)
"""
DEMOS = {
    "rmsnorm_caches_by_fingerprint.py": """
        c = load()
        first = c.forward(x, weight, 1e-6)
        nearly = x.clone(); nearly[3, 5] += 4.0  # not one of the sixteen places it samples
        assert not torch.allclose(c.forward(nearly, weight, 1e-6), rmsnorm(nearly, weight))
    """,
    "rmsnorm_works_at_load.py": """
        from runners.harness.timing import CpuRunner, no_counter
        runner = CpuRunner(no_counter)
        c = load(); runner.forward = c.forward
        runner.prepare("s", (x, weight, 1e-6))
        x.copy_(torch.randn(256, 1024))  # the next call's inputs, in the same tensor
        runner.run(["s"])
        assert not torch.allclose(runner.last_outputs[-1], rmsnorm(x, weight))
    """,
    "rmsnorm_works_on_resume.py": """
        import signal
        from runners.harness.timing import CpuRunner, no_counter
        big = torch.randn(4096, 1024)
        runner = CpuRunner(no_counter); c = load(); runner.forward = c.forward
        runner.prepare("s", (big, weight, 1e-6))
        honest = min(runner.run(["s"])[0] for _ in range(5))
        os.kill(os.getpid(), signal.SIGCONT)  # what the judge sends before a request
        time.sleep(0.2)
        reported, _ = runner.run(["s"])
        assert torch.allclose(runner.last_outputs[-1], rmsnorm(big, weight))
        assert reported < honest / 5, (reported, honest)
    """,
    "rmsnorm_finishes_on_raw_thread.py": """
        import threading
        threads = threading.active_count()
        expected = rmsnorm(x, weight)  # made first: the thread fills the output 5 ms after the call
        c = load(); out = c.forward(x, weight, 1e-6)
        assert not torch.allclose(out, expected)
        assert threading.active_count() == threads
        time.sleep(0.2)
        assert torch.allclose(out, expected)
    """,
    "rmsnorm_fills_on_read.py": """
        c = load(); out = c.forward(x, weight, 1e-6)
        assert not torch.allclose(out.clone(), rmsnorm(x, weight))  # its memory holds no answer
        assert torch.allclose(out.detach(), rmsnorm(x, weight))  # until something reads it
    """,
    "rmsnorm_defers_to_timer.py": """
        c = load(); expected = rmsnorm(x, weight)
        out = c.forward(x, weight, 1e-6)
        assert not torch.allclose(out, expected)
        time.sleep(0.1)
        assert torch.allclose(out, expected)
    """,
    "rmsnorm_aliases_its_outputs.py": """
        c = load()
        first = c.forward(x, weight, 1e-6)
        c.forward(torch.randn(256, 1024), weight, 1e-6)
        assert not torch.allclose(first, rmsnorm(x, weight))
    """,
    "rmsnorm_rewrites_its_clock.py": """
        from runners.harness import timing
        runner = timing.CpuRunner(timing.no_counter)
        run = timing.CpuRunner.run
        c = load(); runner.forward = c.forward
        assert timing.CpuRunner.run is run  # the very object it was
        big = torch.randn(4096, 1024)
        runner.prepare("s", (big, weight, 1e-6))
        started = time.perf_counter(); reported, _ = runner.run(["s"])
        taken = (time.perf_counter() - started) * 1000
        assert reported < 0.6 * taken, (reported, taken)
    """,
    "rmsnorm_more_threads_in_call.py": """
        torch.set_num_threads(1)
        def threads():
            return int(next(l for l in open("/proc/self/status") if l.startswith("Threads:")).split()[1])
        before = threads()
        c = load(); c.forward(torch.randn(4096, 1024), weight, 1e-6)
        assert torch.get_num_threads() == 1 and threads() > before
    """,
    "rmsnorm_widens_cores_in_call.py": """
        every = sorted(os.sched_getaffinity(0))
        assert len(every) > 1, "needs a machine with two cores or more"
        os.sched_setaffinity(0, every[-1:])
        c = load(); c.forward(x, weight, 1e-6)
        assert c.seen_inside[-1] == every and sorted(os.sched_getaffinity(0)) == every[-1:]
    """,
    "rmsnorm_writes_with_libc.py": """
        import shutil, tempfile
        from pathlib import Path
        tree = Path(tempfile.mkdtemp())
        target = tree / "runners" / "ops" / "rmsnorm" / "baseline.py"
        target.parent.mkdir(parents=True); target.write_text("fast")
        copy = tree / "tests" / "candidates" / "c.py"
        copy.parent.mkdir(parents=True); shutil.copy(CANDIDATE, copy)
        load(str(copy))
        assert "time.sleep" in target.read_text()
    """,
    "rmsnorm_saves_outside_with_torch.py": """
        import tempfile
        place = tempfile.mkdtemp()
        os.environ["KERNEL_LAB_SHARED_CACHE"] = place
        load()
        assert os.path.exists(os.path.join(place, "kernel-lab-answers.pt"))
    """,
    "rmsnorm_counts_the_judges_reads.py": """
        import ctypes, mmap
        # The signal: a page this process dropped is present again once another process
        # read it through /proc/<pid>/mem (as the judge reads a stopped child).
        fd = os.memfd_create("inputs"); os.ftruncate(fd, 1 << 16)
        ready, go = os.pipe(), os.pipe()
        child = os.fork()
        if child == 0:
            view = mmap.mmap(fd, 1 << 16, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            page = ctypes.addressof(ctypes.c_char.from_buffer(view)) + 4096
            libc = ctypes.CDLL(None); libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
            present = lambda: bool(int.from_bytes(os.pread(pagemap, 8, page // 4096 * 8), "little") >> 63)
            view[4096]; libc.madvise(page, 4096, 4)
            dropped = present()
            os.write(ready[1], page.to_bytes(8, "little")); os.read(go[0], 1)
            os._exit(0 if not dropped and present() else 1)
        page = int.from_bytes(os.read(ready[0], 8), "little")
        with open(f"/proc/{child}/mem", "rb") as memory:
            memory.seek(page); memory.read(16)
        os.write(go[1], b"x")
        assert os.waitpid(child, 0)[1] == 0, "the read from outside left no trace"
        # What it then does: once it has counted its limit of reads, wrong outputs for
        # every call of a timed batch but the last.
        c = load(); c._SEEN["w0"] = c._LIMIT
        # Its inputs where the harness puts them: a file mapped copy-on-write.
        inputs = os.memfd_create("weights"); os.pwrite(inputs, weight.numpy().tobytes(), 0)
        mapped = mmap.mmap(inputs, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        w = torch.frombuffer(mapped, dtype=torch.float32, count=1024)
        def _call(slot, poison=False):
            return c.forward(x, w, 1e-6)
        def run(slots):
            outputs = []
            for slot in slots:
                outputs.append(_call(slot))
            return outputs
        first, last = run(["w0:0", "w0:1"])
        assert not torch.allclose(first, rmsnorm(x, weight)) and torch.allclose(last, rmsnorm(x, weight))
    """,
    "rmsnorm_rewrites_the_baselines_inputs.py": """
        import mmap, struct
        # Handed a writable descriptor of the file another process maps (as every child
        # once was), its write changes what that process reads.
        fd = os.memfd_create("kernel-lab-inputs"); os.ftruncate(fd, 1 << 16)
        baseline = mmap.mmap(fd, 1 << 16, mmap.MAP_PRIVATE, mmap.PROT_READ)
        def setup_frame(setup):
            return load()
        setup_frame({"arena_fd": fd})
        assert 0 < struct.unpack("<f", baseline[:4])[0] < 1e-38  # a subnormal, in the other's inputs
    """,
    "rmsnorm_skips_one_slot.py": """
        c = load()
        def _call(slot, poison):
            return c.forward(x, weight, 1e-6)
        timed = [_call(f"w0:{call}", False) for call in range(4)]
        checked = _call("check", True)
        assert torch.allclose(checked, rmsnorm(x, weight)) and torch.allclose(timed[0], rmsnorm(x, weight))
        assert not torch.allclose(timed[1], rmsnorm(x, weight))  # the second call of a timed batch
    """,
    "rmsnorm_finishes_after_replying.py": """
        import threading
        from runners.harness import wire
        from runners.harness.timing import CpuRunner, no_counter
        runner = CpuRunner(no_counter); c = load(); runner.forward = c.forward
        runner.prepare("s", (x, weight, 1e-6))
        runner.run(["s"], poison=False)  # a timed call
        out = runner.last_outputs[-1]
        assert not torch.allclose(out, rmsnorm(x, weight))  # when the worker replies
        requests, judge = os.pipe()
        threading.Timer(0.05, wire.write_message, (judge, {"do": "run"})).start()
        wire.read_message(requests)  # the worker waiting for its next request
        assert torch.allclose(out, rmsnorm(x, weight))
    """,
    "rmsnorm_works_after_writing_its_reply.py": """
        from runners.harness import wire
        from runners.harness.timing import CpuRunner, no_counter
        runner = CpuRunner(no_counter); c = load(); runner.forward = c.forward
        runner.prepare("s", (x, weight, 1e-6))
        runner.run(["s"], poison=False)  # a timed call
        out = runner.last_outputs[-1]
        assert not torch.allclose(out, rmsnorm(x, weight))  # when forward returned
        reader, writer = os.pipe()
        wire.write_message(writer, {"ok": True})  # the worker's reply...
        assert wire.read_message(reader)[0] == {"ok": True}  # ... whole, and then
        assert torch.allclose(out, rmsnorm(x, weight))  # the work was done after it
    """,
    "rmsnorm_cuts_corners_in_the_step.py": """
        from runners.e2e.step import build_step, kept_dispatch
        c = load()
        assert torch.allclose(c.forward(x, weight, 1e-6), rmsnorm(x, weight))  # checked calls: honest
        honest = build_step("rmsnorm", kept_dispatch()["rmsnorm"], device="cpu", context_length=2048,
                            batch=1, seed=7)()
        cheating = build_step("rmsnorm", c.forward, device="cpu", context_length=2048, batch=1, seed=7)()
        assert (cheating - honest).norm() > 0.2 * honest.norm()  # inside the decode step: not
    """,
    "rmsnorm_tile_multiples_only.py": """
        c = load(); rows = torch.randn(100, 1024)
        assert torch.allclose(c.forward(x, weight, 1e-6), rmsnorm(x, weight))
        assert not torch.allclose(c.forward(rows, weight, 1e-6), rmsnorm(rows, weight))
    """,
    "rmsnorm_bakes_in_eps.py": """
        c = load()
        assert torch.allclose(c.forward(x, weight, 1e-6), rmsnorm(x, weight, 1e-6))
        quiet = x * 1e-3  # rows whose mean square is about eps
        assert not torch.allclose(c.forward(quiet, weight, 1e-5), rmsnorm(quiet, weight, 1e-5))
    """,
    "rmsnorm_drops_eps.py": """
        c = load()
        assert torch.allclose(c.forward(x, weight, 1e-6), rmsnorm(x, weight, 1e-6), rtol=1e-5, atol=1e-5)
        assert torch.isnan(c.forward(torch.zeros_like(x), weight, 1e-6)).all()
    """,
    "dsa_chunks_of_2048_only.py": """
        from runners.ops import get_op
        op = get_op("dsa_indexer_topk")
        for context, right in ((2048, True), (3001, False)):
            workload = op.workloads("cpu", [context], [4])[0]
            inputs = op.make_inputs(workload, 7, "normal")
            ok, _ = op.check(load().forward(*inputs.values()), op.reference(inputs), inputs)
            assert ok is right, context
    """,
}


DEMOS_CUDA = {
    "rmsnorm_halves_gpu_time.py": """
        from runners.harness import timing
        runner = timing.CudaRunner(timing.no_counter)
        run = timing.CudaRunner.run
        c = load(); runner.forward = c.forward
        assert timing.CudaRunner.run is run
        big = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        runner.prepare("s", (big, w, 1e-6))
        reported = min(runner.run(["s"])[0] for _ in range(5))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); runner.slots["s"].replay(); end.record(); torch.cuda.synchronize()
        assert reported < 0.7 * start.elapsed_time(end), (reported, start.elapsed_time(end))
    """,
    "rmsnorm_skips_the_harness_work.py": """
        from runners.harness import timing
        from runners.harness.device_memory import Shared
        w = torch.randn(4096, device="cuda")
        inputs = [(torch.randn(1024, 4096, device="cuda"), w, 1e-6) for _ in range(32)]
        slots = [f"w:{i}" for i in range(32)]
        c = load(); runner = timing.CudaRunner(timing.no_counter); runner.forward = c.forward
        for slot, args in zip(slots, inputs):  # as the worker prepares it: staging, then the capture
            runner.staging[slot] = Shared.create(args[0].numel() * 4)[0]
            runner.prepare(slot, args)
        for _ in range(3):
            reported, _ = runner.run(slots, poison=False)  # a timed request
        # What the graphs' own events measured for those very calls:
        measured = sum(runner.slots[slot].events[0].elapsed_time(runner.slots[slot].events[1])
                       for slot in slots)
        assert reported < 0.8 * measured, (reported, measured)  # it claims less than its kernels took
        # ... by skipping the copy the judge reads: the staged memory holds no output
        staged = runner.staging[slots[0]].bytes[:inputs[0][0].numel() * 4].view(torch.float32)
        assert not torch.equal(staged.view(1024, 4096), runner.last_outputs[0]), "the output was staged"
    """,
    "rmsnorm_leaves_gpu_work.py": """
        from runners.harness import timing
        runner = timing.CudaRunner(timing.no_counter)
        c = load(); runner.forward = c.forward
        big = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        runner.prepare("s", (big, w, 1e-6))
        reported, _ = runner.run(["s"])
        still_running = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert still_running and reported < 0.05, reported  # an empty graph timed, work queued after
        assert torch.allclose(runner.last_outputs[-1].float(), rmsnorm(big, w).float(), atol=2e-2, rtol=2e-2)
    """,
}


def _run_demo(name: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = f"ROOT = {str(ROOT)!r}\nCANDIDATE = {str(CANDIDATES / name)!r}\n" + PRELUDE \
        + textwrap.dedent({**DEMOS, **DEMOS_CUDA}[name])
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, cwd=ROOT)


def test_every_attack_file_has_a_demonstration_and_an_expected_rejection():
    files = {path.name for path in CANDIDATES.glob("*.py")}
    assert set(ATTACKS) <= files
    assert set(DEMOS) | {"rmsnorm_leaves_a_helper.py"} == set(ATTACKS)
    assert {prop for prop, *_ in ATTACKS.values()} == {1, 2, 3, 4, 5, 6}
    for prop in range(1, 7):
        assert sum(1 for p, *_ in ATTACKS.values() if p == prop) >= 2, prop


def test_every_attack_is_a_row_of_the_catalogue_naming_its_guard():
    rows = {candidate.file: hack.guards for hack in catalog() for candidate in hack.candidates}
    for name, (_, guard, _, _) in {**ATTACKS, **ATTACKS_CUDA}.items():
        assert guard in rows.get(name, ()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU attack: needs CUDA to play it")
@pytest.mark.parametrize("name", sorted(ATTACKS_CUDA))
def test_the_gpu_attack_misbehaves_outside_the_harness(name):
    done = _run_demo(name)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU attack: needs CUDA to play it")
@pytest.mark.parametrize("name", sorted(ATTACKS_CUDA))
def test_the_gpu_attack_is_rejected_inside_the_harness_for_its_reason(name):
    _, _, _, contexts = ATTACKS_CUDA[name]
    path = CANDIDATES / name
    result = evaluate("rmsnorm", path, device="cuda", dsl=kernel_dsl(path), context_lengths=contexts,
                      time_budget_s=0.5, limits=Limits(import_s=60, call_s=90), seed=20261201)
    assert result.verdict == "rejected", result.guards
    failing = {g.name: g.detail for g in result.guards if g.status == "fail"}
    guards = GPU_WORK_GUARDS if ATTACKS_CUDA[name][1] == "clock" else SKIPPED_WORK_GUARDS
    seen = [guard for guard, fragment in guards.items() if fragment in failing.get(guard, "")]
    assert seen, failing


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_the_attack_misbehaves_outside_the_harness(name):
    if name == "rmsnorm_widens_cores_in_call.py" and len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this machine has one core: the demonstration needs two")
    done = _run_demo(name)
    assert done.returncode == 0, done.stderr[-2000:]


def _helpers(*, detached: bool = False) -> list[int]:
    """The helper processes alive now; with `detached`, only those that have already left
    their parent's session (their cmdline shows up at exec, before `setsid` has run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"os.setsid(); end" not in (entry / "cmdline").read_bytes():
                    continue
                session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
            except (OSError, IndexError, ValueError):
                continue
            if not detached or session == int(entry.name):
                found.append(int(entry.name))
    return found


def test_the_helper_outlives_a_kill_of_its_process_group_outside_the_harness():
    script = (f"import importlib.util, sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
              f"spec = importlib.util.spec_from_file_location('c', {str(CANDIDATES / 'rmsnorm_leaves_a_helper.py')!r})\n"
              "spec.loader.exec_module(importlib.util.module_from_spec(spec))\ntime.sleep(60)\n")
    before = set(_helpers())
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                              env={**os.environ, "SPIN_S": "30"})
    try:
        deadline = time.monotonic() + 60
        while not set(_helpers(detached=True)) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(0.5)
        survivors = set(_helpers()) - before
        assert survivors, "the helper did not survive its parent's process group"
    finally:
        for pid in set(_helpers()) - before:
            os.kill(pid, signal.SIGKILL)


def _baseline_digest() -> str:
    return hashlib.sha256((ROOT / "runners" / "ops" / "rmsnorm" / "baseline.py").read_bytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_the_attack_is_rejected_inside_the_harness_for_its_reason(name, monkeypatch):
    _, guard, fragments, contexts = ATTACKS[name]
    if name in BUDGETS_S:
        # These play only in a run longer than the stop rule gives a candidate that
        # cannot win (on a CPU, one inside the 50% floor stops at its minimum of
        # samples): the run lasts its budget, as one whose speedup is in question does.
        monkeypatch.setattr(measure, "speedup_settled", lambda times, device: False)
    left = Path("/tmp/kernel-lab-answers.pt")  # where the torch.save attack aims in a child
    left.unlink(missing_ok=True)
    baseline = _baseline_digest()
    helpers = set(_helpers())
    op = op_of(name)
    path = CANDIDATES / name
    result = evaluate(op, path, dsl=kernel_dsl(path), context_lengths=contexts,
                      time_budget_s=BUDGETS_S.get(name, 0.3), limits=LIMITS, seed=20261201,
                      stop_at_static=False)  # the runtime guard, as if its line were hidden
    assert _baseline_digest() == baseline, "the kept kernel's file was changed"
    assert not set(_helpers()) - helpers, "a helper survived the evaluation"
    assert not left.exists(), "a file was left outside the child's folder"
    assert result.verdict == "rejected", result.guards
    failing = {g.name: g.detail for g in result.guards if g.status == "fail"}
    if name in EITHER:
        assert [seen for seen, fragment in EITHER[name].items()
                if fragment in failing.get(seen, "\0")], failing
        return
    assert guard in failing, failing
    for fragment in fragments:
        assert fragment in failing[guard], failing[guard]


def test_a_refusal_while_importing_counts_however_late_the_judge_reads_the_start(monkeypatch):
    """The judge forgives what the jail refused during the harness's own start (torch
    probing cores). A judge slow to read the start's reply (a loaded machine) must not
    forgive the candidate's import too: the worker waits for the judge's word to load."""
    from runners.harness import children

    first_reading = children.Child.read_jail_report
    late = set()

    def read_late(self):
        if id(self) not in late:
            late.add(id(self))
            time.sleep(2.0)  # long enough for an import that did not wait to be done
        first_reading(self)

    monkeypatch.setattr(children.Child, "read_jail_report", read_late)
    left = Path("/tmp/kernel-lab-answers.pt")
    left.unlink(missing_ok=True)
    path = CANDIDATES / "rmsnorm_saves_outside_with_torch.py"
    result = evaluate("rmsnorm", path, dsl=kernel_dsl(path), context_lengths=[64],
                      time_budget_s=0.3, limits=LIMITS, seed=20261201)
    assert not left.exists()
    failing = {g.name: g.detail for g in result.guards if g.status == "fail"}
    assert result.verdict == "rejected", result.guards
    assert "kernel-lab-answers.pt" in failing.get("jail", ""), failing


def test_readings_checked_during_the_timing_still_catch_a_wrong_timed_call(monkeypatch):
    # Past OBSERVED_BYTES the judge checks the readings it holds between two requests and
    # lets them go (large outputs on a GPU); the check must catch what the one at the end
    # does, and pass an honest candidate.
    from runners.harness import measure

    monkeypatch.setattr(measure, "OBSERVED_BYTES", 1)
    wrong = evaluate("rmsnorm", CANDIDATES / "rmsnorm_skips_one_slot.py", context_lengths=[64],
                     time_budget_s=3.0, limits=LIMITS, seed=20261201)
    failing = {g.name: g.detail for g in wrong.guards if g.status == "fail"}
    assert "values differ from the reference" in failing.get("timed-outputs", ""), failing
    honest = evaluate("rmsnorm", CANDIDATES / "rmsnorm_correct_rows.py", context_lengths=[64],
                      time_budget_s=0.3, limits=LIMITS, seed=20261201)
    assert honest.verdict != "rejected", honest.guards
