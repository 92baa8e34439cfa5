"""The judge's side of a collective op (Op.world_size > 1): an evaluation across ranks.

Each side, the baseline and the candidate, runs as a group of world_size processes
(runners.harness.rank_worker), one per rank (one per GPU on CUDA), each a fresh
interpreter with the harness's clean environment (multicast off), OS limits and the
audit hook of every candidate process, joined in a process group of their own. The
judge draws the inputs, gives each rank its own share only, checks every rank's output
against the exact sum, and times the sides in alternating rounds, a sample being the
slowest rank's time for that call: a collective is done when its last rank is.

Guards beyond correctness:
- moves-data: the candidate's forward runs no collective of any process group (counted
  by the groups' own sequence numbers, so a call however made shows): an all-reduce
  that calls torch.distributed.all_reduce, or gathers through it to sum on the host, is
  the baseline with extra steps;
- config: the environment (the C library's, which NCCL reads: NCCL_*, the multicast
  switches) is as it was before the candidate was imported, on every rank;
- protected-settings: no line of the source changes what the harness holds fixed;
- sandbox: nothing the audit hook refused.

Not yet here (CPU part only): the namespace jail of runners.jail (it gives every
process its own network and IPC namespaces and refuses sockets, which a process group
needs; a group's ranks would share one jail), CUDA-graph capture of the candidate, and
the end-to-end tensor-parallel step.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runners.harness import protected, wire
from runners.harness.candidate import shorten
from runners.harness.children import (
    BASELINE,
    CANDIDATE,
    CallFailed,
    ChildFailure,
    Limits,
    child_environment,
)
from runners.harness.dispatch import SizedResult, dispatch_range
from runners.harness.result import EvaluationResult, Guard, WorkloadResult
from runners.harness.seeds import derive_seed
from runners.harness.stats import MIN_NOISE_FLOOR, compare
from runners.ops import DISTRIBUTIONS, Op, Workload

SIZE_AXIS = "message_bytes"
# Calls per timed request, per rank: each one lined up behind a barrier of its own.
SAMPLES_PER_ROUND = 5
MIN_ROUNDS, MAX_ROUNDS = 4, 60


class RankGroup:
    """One side's ranks: started together, asked together, ended together."""

    def __init__(self, *, role: str, op: Op, path: Path, device: str, threads: int,
                 limits: Limits, deadline: float) -> None:
        self.role = role
        self.label = "candidate" if role == CANDIDATE else "baseline"
        self.limits, self.deadline = limits, deadline
        self.folder = Path(tempfile.mkdtemp(prefix="kernel-lab-group-"))
        self.world_size = op.world_size
        self.processes: list[subprocess.Popen] = []
        self.requests: list[int] = []
        self.replies: list[int] = []
        env = child_environment(self.folder, threads=threads, extra={})
        for rank in range(self.world_size):
            requests_read, requests_write = os.pipe()
            replies_read, replies_write = os.pipe()
            log = open(self.folder / f"rank{rank}.log", "wb")
            try:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-s", "-m", "runners.harness.rank_worker",
                     str(requests_read), str(replies_write)],
                    pass_fds=(requests_read, replies_write), cwd=self.folder, env=env,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True))
            finally:
                log.close()
                os.close(requests_read)
                os.close(replies_write)
            self.requests.append(requests_write)
            self.replies.append(replies_read)
            wire.write_message(requests_write, {
                "rank": rank, "world_size": self.world_size, "device": device,
                "candidate": str(path), "threads": threads,
                "store": str(self.folder / "store"), "shared_dir": str(self.folder),
                "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
                "cpu_seconds": math.ceil(limits.total_s * threads) + 10,
            })

    def load(self) -> list[dict[str, Any]]:
        """Every rank's answer to importing the candidate (and its setup)."""
        headers = [header for header, _ in self._receive_all(
            self.limits.import_s + 120, "starting and importing the candidate", guard="loads")]
        for rank, header in enumerate(headers):
            if not header.get("ok"):
                raise CallFailed("load", f"rank {rank}: {shorten(str(header.get('error')))}",
                                 self.role)
        return headers

    def prepare(self, slot: int, shares: torch.Tensor) -> None:
        """Rank r is given row r of `shares`, and nothing of its peers'."""
        for rank, fd in enumerate(self.requests):
            self._send(fd, {"do": "prepare", "slot": slot}, {"x": shares[rank]}, "preparing inputs")
        self._receive_all(self.limits.call_s, "preparing inputs")

    def ask(self, do: str, during: str, **fields: Any) -> list[tuple[dict[str, Any], dict]]:
        """The same request to every rank at once (a collective needs them all)."""
        for fd in self.requests:
            self._send(fd, {"do": do, **fields}, None, during)
        answers = self._receive_all(self.limits.call_s, during)
        for rank, (header, _) in enumerate(answers):
            if not header.get("ok"):
                raise CallFailed("raised", f"rank {rank}: {shorten(str(header.get('error')))}",
                                 self.role, during)
        return answers

    def _send(self, fd: int, header: dict[str, Any], tensors: dict | None, during: str) -> None:
        try:
            wire.write_message(fd, header, tensors)
        except OSError:
            raise self._failed("process", f"a {self.label} rank was gone while {during}") from None

    def _receive_all(self, timeout_s: float, during: str, guard: str = "process"):
        answers = []
        for rank, fd in enumerate(self.replies):
            limit = min(timeout_s, self.deadline - time.monotonic())
            try:
                answers.append(wire.read_message(fd, deadline=time.monotonic() + limit,
                                                 max_bytes=1 << 40))
            except wire.ChannelTimeout:
                raise self._failed(guard, f"{self.label} rank {rank} did not finish {during} "
                                          f"within {limit:.3g} s (a peer waiting on a rank that "
                                          "never joined it, or a hang); the group was killed") from None
            except wire.ChannelClosed:
                code = self.processes[rank].wait(timeout=5)
                raise self._failed(guard, f"{self.label} rank {rank} exited (status {code}) "
                                          f"while {during}: {self.log_tail(rank)}") from None
            except wire.ProtocolError as error:
                raise self._failed("protocol", f"{self.label} rank {rank} broke the result "
                                               f"protocol while {during}: {error}") from None
        return answers

    def _failed(self, guard: str, detail: str) -> ChildFailure:
        self.kill()
        return ChildFailure(guard, detail, self.role)

    def log_tail(self, rank: int) -> str:
        try:
            text = (self.folder / f"rank{rank}.log").read_text(errors="replace").strip()
        except OSError:
            return "no log"
        return shorten(text.splitlines()[-1]) if text else "no log"

    def kill(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for process in self.processes:
            process.wait()

    def close(self) -> None:
        for fd in [*self.requests, *self.replies]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Each call's time is its slowest rank's: the collective is done when it is."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def evaluate(op: Op, path: Path, baseline_path: Path, workloads: list[Workload],
             result: EvaluationResult, *, budget_s: float, limits: Limits, deadline: float,
             say: Callable[[str], None]) -> EvaluationResult:
    """Fills `result` (made by runners.harness.evaluate.evaluate) for a collective op."""
    source = path.read_text(encoding="utf-8", errors="replace")
    settings = protected.check(source, baseline_path.read_text(encoding="utf-8", errors="replace"))
    say(f"{op.name} on {result.device}: {len(workloads)} workloads across {op.world_size} ranks")
    groups: dict[str, RankGroup] = {}
    # The baseline timed against itself (an A/A run) is the collective library's path.
    watch = _Watch(judged=path != baseline_path)
    try:
        for role, file in ((BASELINE, baseline_path), (CANDIDATE, path)):
            groups[role] = RankGroup(role=role, op=op, path=file, device=result.device,
                                     threads=result.threads or 1, limits=limits, deadline=deadline)
        _judge(op, groups, workloads, result, watch, budget_s=budget_s, say=say)
    except ChildFailure as failure:
        blamed = "the baseline" if failure.role == BASELINE else "the candidate"
        result.guards.append(Guard(failure.guard, "fail", failure.detail))
        result.error = None if failure.role == CANDIDATE else f"{blamed} failed: {failure.detail}"
    except CallFailed as failure:
        guard = "loads" if failure.kind == "load" else "correctness"
        result.guards.append(Guard(guard, "fail", (f"the candidate could not be loaded: {failure.error}"
                                                   if guard == "loads" else
                                                   f"forward failed while {failure.during}: {failure.error}")))
        if failure.role == BASELINE:
            result.error = f"the baseline failed: {failure.error}"
    finally:
        for group in groups.values():
            group.close()
    result.guards += watch.guards()
    if settings is not None:
        result.guards.append(Guard("protected-settings", *settings))
    failed = any(guard.status == "fail" for guard in result.guards)
    if result.correct and not failed:
        result.dispatch = dispatch_range(SIZE_AXIS, [
            SizedResult(workload.params[SIZE_AXIS], found.speedup, found.significant)
            for workload, found in zip(workloads, result.workloads)])
    result.verdict = ("rejected" if failed or not result.correct else
                      "win" if result.dispatch and result.timing_meaningful else "no-gain")
    say(f"verdict: {result.verdict}")
    return result


class _Watch:
    """What the candidate's ranks were seen doing over the whole run."""

    def __init__(self, judged: bool = True) -> None:
        self.judged = judged  # False for the baseline itself: its collectives are the point
        self.collectives: list[str] = []
        self.environment: dict[str, str] = {}
        self.refused: list[str] = []
        self.calls = 0
        self.loaded = False

    def note(self, rank: int, header: dict[str, Any], during: str) -> None:
        counted = header.get("collectives") or {}
        total = counted.get("total", 0) if isinstance(counted, dict) else 0
        if total and self.judged:
            named = counted.get("named") or {}
            which = ", ".join(f"{name} ×{count}" for name, count in named.items()) or \
                "on the process group directly"
            self.collectives.append(f"rank {rank} ran {total} collective(s) while {during} ({which})")
        for change in header.get("environment") or []:
            self.environment.setdefault(str(change).split(":", 1)[0],
                                        f"rank {rank}: {shorten(str(change))}")
        self.refused += [shorten(str(item)) for item in (header.get("refused") or [])]

    def guards(self) -> list[Guard]:
        if not self.loaded:
            return []
        found = []
        if self.collectives:
            found.append(Guard("moves-data", "fail", "the candidate did not move the data "
                               "itself: its forward ran torch.distributed collectives, the "
                               "baseline's own path: " + "; ".join(self.collectives[:2])))
        elif not self.judged:
            found.append(Guard("moves-data", "pass", "the baseline itself: its collectives are "
                               "the path candidates are timed against"))
        elif self.calls:
            found.append(Guard("moves-data", "pass", f"no collective of any process group ran "
                               f"inside {self.calls} forward calls (counted by the groups' "
                               "sequence numbers on every rank)"))
        if self.environment:
            changes = list(self.environment.values())
            found.append(Guard("config", "fail", "the candidate changed the environment the "
                               "collective library reads: " + "; ".join(changes[:3])
                               + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")))
        else:
            found.append(Guard("config", "pass", "environment (NCCL_*, multicast switches) "
                               "unchanged on every rank since before the import"))
        if self.refused:
            counts = Counter(self.refused)
            found.append(Guard("sandbox", "fail", "refused: " + "; ".join(
                f"{item} (×{count})" if count > 1 else item for item, count in list(counts.items())[:3])))
        else:
            found.append(Guard("sandbox", "pass", "no network, program, signal or outside write attempted"))
        return found


def _judge(op: Op, groups: dict[str, RankGroup], workloads: list[Workload],
           result: EvaluationResult, watch: _Watch, *, budget_s: float,
           say: Callable[[str], None]) -> None:
    baseline, candidate = groups[BASELINE], groups[CANDIDATE]
    baseline.load()
    for rank, header in enumerate(candidate.load()):
        watch.note(rank, header, "importing")
    watch.loaded = True
    result.guards.append(Guard("loads", "pass", f"imported on all {op.world_size} ranks"))

    failures: list[str] = []
    changed: list[str] = []
    checked = 0
    for slot, workload in enumerate(workloads):
        for distribution in DISTRIBUTIONS:
            inputs = op.make_inputs(workload, derive_seed(result.seed, "inputs", workload.name,
                                                          distribution), distribution)
            reference = op.reference(inputs)
            candidate.prepare(slot, inputs["x"])
            for rank, (header, tensors) in enumerate(candidate.ask("check", f"checking {workload.name}",
                                                                   slot=slot)):
                watch.calls += 1
                watch.note(rank, header, f"checking {workload.name}")
                output = tensors.get("output")
                ok, detail = (op.check(output, reference, inputs) if output is not None
                              else (False, "forward returned no tensor"))
                checked += 1
                if not ok:
                    failures.append(f"{workload.name}, {distribution}, rank {rank}: {detail}")
                if not torch.equal(tensors["x_after"], inputs["x"][rank]):
                    changed.append(f"{workload.name}, rank {rank}")
        if watch.collectives:
            break
    if failures:
        more = f"; and {len(failures) - 1} more" if len(failures) > 1 else ""
        result.guards.append(Guard("correctness", "fail", failures[0] + more))
        return
    result.guards.append(Guard("correctness", "pass", f"every rank's output matches the exact "
                               f"sum: {checked} outputs over {len(workloads)} workloads and "
                               f"{len(DISTRIBUTIONS)} distributions"))
    result.guards.append(Guard("inputs-unchanged", "fail", f"forward wrote its input x: {changed[0]}")
                         if changed else Guard("inputs-unchanged", "pass",
                                               "every rank's input unchanged by the call"))
    result.correct = not changed
    if changed or watch.collectives or watch.environment:
        return  # rejected already: nothing to time

    result.workloads = []
    for slot, workload in enumerate(workloads):
        inputs = op.make_inputs(workload, derive_seed(result.seed, "inputs", workload.name,
                                                      DISTRIBUTIONS[0]), DISTRIBUTIONS[0])
        baseline.prepare(slot, inputs["x"])
        candidate.prepare(slot, inputs["x"])
        times = _time(groups, slot, workload, watch, budget_s=budget_s)
        rng = np.random.default_rng(derive_seed(result.seed, "bootstrap", workload.name))
        floor = MIN_NOISE_FLOOR[result.device]
        found = compare(times[BASELINE], times[CANDIDATE], rng=rng, noise=floor)
        timed = WorkloadResult(
            name=workload.name, baseline_ms=found.baseline_ms, candidate_ms=found.candidate_ms,
            speedup=found.speedup, significant=found.significant and result.timing_meaningful,
            speedup_ci=list(found.speedup_ci), p_value=found.p_value,
            samples=len(times[CANDIDATE]), baseline_ci_ms=list(found.baseline_ci_ms),
            candidate_ci_ms=list(found.candidate_ci_ms), noise_floor=floor,
            calls_per_request=SAMPLES_PER_ROUND)
        result.workloads.append(timed)
        for group in groups.values():
            group.ask("drop", "dropping inputs", slot=slot)
        low, high = timed.speedup_ci
        say(f"timing {workload.name}: baseline {timed.baseline_ms:.4g} ms, candidate "
            f"{timed.candidate_ms:.4g} ms (slowest of {op.world_size} ranks), speedup "
            f"{timed.speedup:.3f}x [{low:.3f}, {high:.3f}], p={timed.p_value:.2g}"
            + (" (significant)" if timed.significant else ""))
        if watch.collectives or watch.environment:
            return  # it behaved otherwise once timed: rejected, no more to time


def _time(groups: dict[str, RankGroup], slot: int, workload: Workload, watch: _Watch, *,
          budget_s: float) -> dict[str, list[float]]:
    """Alternating rounds, baseline then candidate, until the budget is spent: whatever
    slows the machine meanwhile slows both sides alike."""
    times: dict[str, list[float]] = {BASELINE: [], CANDIDATE: []}
    started = time.monotonic()
    rounds = 0
    while rounds < MIN_ROUNDS or (time.monotonic() - started < budget_s and rounds < MAX_ROUNDS):
        for role, group in groups.items():
            answers = group.ask("time", f"timing {workload.name}", slot=slot,
                                samples=SAMPLES_PER_ROUND)
            if role == CANDIDATE:
                for rank, (header, _) in enumerate(answers):
                    watch.calls += SAMPLES_PER_ROUND
                    watch.note(rank, header, f"timing {workload.name}")
            times[role] += slowest_rank([header["times_ms"] for header, _ in answers])
        rounds += 1
    return times
