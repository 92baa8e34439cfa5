"""The judge's side of a collective op (Op.world_size > 1): an evaluation across ranks.

Each side, the baseline and the candidate, runs as a group of world_size processes
(runners.harness.rank_worker), one per rank (one per GPU on CUDA), all in one jail of
the side's own (runners.jail: the group shares its PID, network and IPC namespaces, and
its network holds only its loopback, where the group's process group meets), with the
harness's clean environment (multicast off), OS limits and the audit hook of every
candidate process. The judge draws the inputs, gives each rank its own share only on
its own pipe, checks every rank's output against the exact sum, and times the sides in
alternating rounds on its own clock (runners.harness.rank_timing), a round ending when
the last rank has replied: a collective is done when its slowest rank is. Then, in the
same rank groups, the end-to-end check (runners.harness.collective_endtoend): a
tensor-parallel decode step whose all-reduces between layers are the candidate's on
its side and the baseline's on the other, every rank's output checked against the
judge's own exact step, whole steps timed as the calls were (the `e2e` guard and the
result's `e2e`).

Guards beyond correctness:
- moves-data: no data crosses the jail's network once the group is set up (the
  namespace's own counters of data sent, read from outside by the judge, observe.
  network_data_sent), and no rank counts a collective of any process group in its
  forward: an all-reduce that falls back to torch.distributed's (on the group it was
  given, on one it made itself, or through a group object) sends its data through the
  process group's sockets, and is the baseline with extra steps. Once every rank has
  loaded the candidate (its setup(comm) may exchange handles over the group) the judge
  has the supervisor refuse every new network socket: a process group made later
  cannot connect (`jail`);
- config: the environment (the C library's, which NCCL reads: NCCL_*, the multicast
  switches) is as it was before the candidate was imported, on every rank;
- protected-settings: no line of the source, or of the shared code it imports, changes
  what the harness holds fixed (found by the static stage, which ran once before);
- sandbox: nothing the audit hook refused;
- jail: nothing the jail's supervisor refused once the candidate was imported (a write
  outside the group's folder, a program, a new namespace...).
- e2e: inside the tensor-parallel step, every rank's output near the exact step's (an
  all-reduce right on the fresh tensor of every op call, wrong on the one buffer a step
  gives it again and again: allreduce_stale_on_a_reused_buffer.py), and the step not
  significantly slower end to end where the kernel won.

The ranks' own words (the collectives counted, the environment) come from processes
that run candidate code, as the single-process worker's in-process watchers do, and a
candidate can rewrite them (allreduce_rewrites_its_report.py): they are evidence
against it, never for it. What decides comes from outside the ranks: the judge's
clock, its check of every output, the jail's network counters and the supervisor's
refusals, on the judge's own pipes.

Not yet here (CPU part only): stopping the jail between requests (the single-process
path's observe.Outside), CUDA-graph capture of the candidate, alone or in the
tensor-parallel step, and an A/A group (significance uses the device's fixed noise
floor, in the per-size timing and the step's alike).
"""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runners.e2e.tensor_parallel import TensorParallelShape, shard
from runners.harness import collective_endtoend, imports, wire
from runners.harness.candidate import shorten
from runners.harness.children import (
    BASELINE,
    CANDIDATE,
    CallFailed,
    ChildFailure,
    Limits,
    child_environment,
    jail_messages,
)
from runners.jail.plan import make_plan
from runners.jail.supervisor import CLOSE_NETWORK
from runners.harness.correctness import TIMED_OUTPUTS
from runners.harness.dispatch import SizedResult, dispatch_range
from runners.harness.observe import network_data_sent
from runners.harness.rank_timing import SAMPLES_PER_ROUND, Round, time_rounds
from runners.harness.result import EvaluationResult, Guard, WorkloadResult
from runners.harness.seeds import derive_seed
from runners.harness.stats import MIN_NOISE_FLOOR, compare
from runners.ops import DISTRIBUTIONS, Op, Workload

SIZE_AXIS = "message_bytes"
STARTUP_S = 120.0  # the trusted part of the start: the interpreter, torch, the process group
# How long the supervisor may take to say it closed the network (it answers at once).
CLOSE_NETWORK_S = 10.0


class RankGroup:
    """One side's ranks, in one jail: started together, asked together, ended together.

    The jail (runners.jail, `ranks` = world_size) is every candidate process's, shared
    by the group: its own PID, mount, network and IPC namespaces, a read-only view of
    the system and the project, the group's folder the one place it may write, and a
    network namespace with nothing in it but its loopback, where the ranks' process
    group meets. The other side's group, the judge and the host are out of its sight.
    Each rank has its own pipe pair to the judge; what the jail refused comes on a
    third pipe, from the supervisor, which no rank holds. `lib`: the folder of shared
    kernel code the judge read and serves it (runners.harness.imports)."""

    def __init__(self, *, role: str, op: Op, path: Path, device: str, threads: int,
                 limits: Limits, deadline: float, lib: Path | None = None) -> None:
        self.role = role
        self.label = "candidate" if role == CANDIDATE else "baseline"
        self.limits, self.deadline = limits, deadline
        self.folder = Path(tempfile.mkdtemp(prefix="kernel-lab-group-"))
        self._root = Path(tempfile.mkdtemp(prefix="kernel-lab-root-"))
        self.world_size = op.world_size
        self.requests: list[int] = []
        self.replies: list[int] = []
        self.refused: list[str] = []
        self.startup_refused: list[str] = []
        self.jail_error: str | None = None
        self._report_buffer = b""
        # The jail's first process, as the judge's /proc names it (the supervisor says),
        # whose network namespace every rank shares; the supervisor's word that it
        # refuses new sockets; and the jail's count of data sent at the last reading.
        self.worker_pid: int | None = None
        self.network_closed = False
        self._data_sent: int | None = None
        theirs: list[int] = []
        for _ in range(self.world_size):
            requests_read, requests_write = os.pipe()
            replies_read, replies_write = os.pipe()
            theirs += [requests_read, replies_write]
            self.requests.append(requests_write)
            self.replies.append(replies_read)
        self._report, report_write = os.pipe()
        os.set_blocking(self._report, False)
        # gloo finds the address its pairs listen on by this interface: the jail has no other.
        env = child_environment(self.folder, threads=threads, extra={"GLOO_SOCKET_IFNAME": "lo"})
        cpu_seconds = math.ceil(limits.total_s * threads) + 10
        plan = make_plan(
            scratch=self.folder, root=self._root,
            argv=[sys.executable, "-s", "-m", "runners.jail.group", "runners.harness.rank_worker",
                  *map(str, theirs)],
            files=[path, *([lib] if lib is not None else [])], dsl="torch", device=device,
            environment=env, cpus=None,
            cpu_seconds=cpu_seconds, file_bytes=limits.file_bytes, ranks=self.world_size)
        self._log = open(self.folder / "ranks.log", "wb")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-s", "-m", "runners.jail", plan.to_json(), str(report_write),
                 str(os.getpid())],
                pass_fds=(*theirs, report_write), cwd=self.folder, env=env,
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                start_new_session=True)
        finally:
            for fd in (*theirs, report_write):
                os.close(fd)
        for rank, fd in enumerate(self.requests):
            wire.write_message(fd, {
                "rank": rank, "world_size": self.world_size, "device": device,
                "candidate": str(path), "threads": threads,
                "store": str(self.folder / "store"), "shared_dir": str(self.folder),
                "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
                "cpu_seconds": cpu_seconds, "lib": str(lib) if lib is not None else None,
            })

    def load(self) -> list[dict[str, Any]]:
        """Every rank's answer to importing the candidate (and its setup)."""
        self._receive_all(STARTUP_S, "starting (importing torch, joining the process group)")
        # Each rank replied once its start was done, and the supervisor records a call
        # before it answers it: every refusal so far was the harness's own start.
        self.read_jail_report()
        self.startup_refused, self.refused = self.refused, []
        for fd in self.requests:
            self._send(fd, {"do": "load"}, None, "importing the candidate")
        headers = [header for header, _ in self._receive_all(
            self.limits.import_s, "importing the candidate", guard="loads")]
        for rank, header in enumerate(headers):
            if not header.get("ok"):
                raise CallFailed("load", f"rank {rank}: {shorten(str(header.get('error')))}",
                                 self.role)
        self._close_network()
        self.traffic()  # what the start and setup(comm) sent is theirs to send
        return headers

    def _close_network(self) -> None:
        """Has the supervisor refuse every new network socket from now on, and waits for
        its word: the group's connections are made, and a group made later, which would
        need new ones, cannot connect."""
        try:
            os.kill(self.process.pid, CLOSE_NETWORK)
        except ProcessLookupError:
            raise self._failed("process", f"the {self.label}'s jail was gone before its "
                                          "first call") from None
        until = time.monotonic() + CLOSE_NETWORK_S
        while not self.network_closed and time.monotonic() < until:
            select.select([self._report], [], [], 0.05)
            self.read_jail_report()
        if not self.network_closed:
            raise self._failed("jail", f"the {self.label}'s jail did not close its network "
                                       f"within {CLOSE_NETWORK_S:g} s of the judge's word")

    def traffic(self) -> int | None:
        """Data segments and datagrams the group's jail has sent through its sockets since
        the last reading, read from outside it; None where they cannot be read."""
        now = network_data_sent(self.worker_pid) if self.worker_pid is not None else None
        if now is None:
            return None
        sent = 0 if self._data_sent is None else now - self._data_sent
        self._data_sent = now
        return sent

    def prepare(self, slot: int, shares: torch.Tensor) -> None:
        """Rank r is given row r of `shares`, and nothing of its peers'."""
        for rank, fd in enumerate(self.requests):
            self._send(fd, {"do": "prepare", "slot": slot}, {"x": shares[rank]}, "preparing inputs")
        self._receive_all(self.limits.call_s, "preparing inputs")

    def prepare_round(self, shares: torch.Tensor) -> None:
        """Rank r is given shares[r]: one fresh input of its own per call of the round."""
        for rank, fd in enumerate(self.requests):
            self._send(fd, {"do": "prepare_round"}, {"x": shares[rank]}, "preparing a round's inputs")
        self._receive_all(self.limits.call_s, "preparing a round's inputs")

    def build_step(self, shape: TensorParallelShape, weights: Mapping[str, torch.Tensor]) -> None:
        """Every rank builds the tensor-parallel decode step (runners.e2e.tensor_parallel)
        from its own shard of the judge's draw, sent on its own pipe: no rank holds a
        peer's shard, or the seed it was drawn from."""
        during = "building the tensor-parallel decode step"
        for rank, fd in enumerate(self.requests):
            self._send(fd, {"do": "build_step", "shape": shape.as_dict()},
                       shard(weights, shape, rank, self.world_size), during)
        self._all_ok(self._receive_all(self.limits.call_s, during), during)

    def ask(self, do: str, during: str, **fields: Any) -> list[tuple[dict[str, Any], dict]]:
        """The same request to every rank at once (a collective needs them all)."""
        for fd in self.requests:
            self._send(fd, {"do": do, **fields}, None, during)
        return self._all_ok(self._receive_all(self.limits.call_s, during), during)

    def _all_ok(self, answers: list[tuple[dict[str, Any], dict]], during: str
                ) -> list[tuple[dict[str, Any], dict]]:
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
                try:
                    code = self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = None
                self.read_jail_report()
                if self.jail_error is not None:
                    raise self._failed("jail", f"the {self.label}'s jail could not be built: "
                                               f"{self.jail_error}") from None
                raise self._failed(guard, f"{self.label} rank {rank} exited (the group's "
                                          f"status {code}) while {during}: "
                                          f"{self.log_tail()}") from None
            except wire.ProtocolError as error:
                raise self._failed("protocol", f"{self.label} rank {rank} broke the result "
                                               f"protocol while {during}: {error}") from None
        return answers

    def _failed(self, guard: str, detail: str) -> ChildFailure:
        self.kill()
        return ChildFailure(guard, detail, self.role)

    def read_jail_report(self) -> None:
        """Takes in what the jail's supervisor has said since the last reading."""
        messages, self._report_buffer = jail_messages(self._report, self._report_buffer)
        for said in messages:
            if isinstance(said.get("pid"), int) and self.worker_pid is None:
                self.worker_pid = said["pid"]
            if said.get("network") == "closed":
                self.network_closed = True
            if isinstance(said.get("refused"), str):
                self.refused.append(shorten(said["refused"]))
            if isinstance(said.get("jail_error"), str):
                self.jail_error = shorten(said["jail_error"])

    def log_tail(self) -> str:
        try:
            text = (self.folder / "ranks.log").read_text(errors="replace").strip()
        except OSError:
            return "no log"
        return shorten(text.splitlines()[-1]) if text else "no log"

    def kill(self) -> None:
        # The supervisor's group: the ranks die with it (their PID namespace ends with
        # its first process, which dies with the supervisor).
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def close(self) -> None:
        for fd in [*self.requests, *self.replies]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.kill()
        self.read_jail_report()
        os.close(self._report)
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self._root, ignore_errors=True)


def evaluate(op: Op, path: Path, baseline_path: Path, workloads: list[Workload],
             result: EvaluationResult, *, budget_s: float, limits: Limits, deadline: float,
             say: Callable[[str], None], settings: tuple[str, str] | None,
             shared: imports.Served | None) -> EvaluationResult:
    """Fills `result` (made by runners.harness.evaluate.evaluate, whose static stage ran
    once for both paths) for a collective op. `settings`: that stage's protected-settings
    finding (None: nothing to say); `shared`: the shared code it read, served to each
    side's ranks."""
    say(f"{op.name} on {result.device}: {len(workloads)} workloads across {op.world_size} ranks")
    groups: dict[str, RankGroup] = {}
    # The baseline timed against itself (an A/A run) is the collective library's path.
    watch = RanksWatch(judged=path != baseline_path)
    libs = {BASELINE: shared.kept_folder if shared else None,
            CANDIDATE: shared.candidate_folder if shared else None}
    try:
        for role, file in ((BASELINE, baseline_path), (CANDIDATE, path)):
            groups[role] = RankGroup(role=role, op=op, path=file, device=result.device,
                                     threads=result.threads or 1, limits=limits, deadline=deadline,
                                     lib=libs[role])
        # `settings` fails here only where the caller went past the static stage: a
        # candidate it rejected is rejected already, and is not run through the
        # end-to-end step, as on the single-process path.
        _judge(op, groups, workloads, result, watch, budget_s=budget_s, say=say,
               end_to_end=settings is None or settings[0] != "fail")
        # Whatever the candidate's ranks sent once its last call had returned.
        watch.traffic(groups[CANDIDATE].traffic(), "after its last call")
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
        if CANDIDATE in groups:
            watch.jail_refused = groups[CANDIDATE].refused
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


class RanksWatch:
    """What the candidate's ranks were seen doing over the whole run: from outside (the
    data its jail sent, read by the judge) and in their own words (the collectives each
    rank counted, the environment)."""

    def __init__(self, judged: bool = True) -> None:
        self.judged = judged  # False for the baseline itself: its collectives are the point
        self.collectives: list[str] = []
        self.network: list[str] = []  # data the jail sent once set up, read from outside
        self.network_unread = False
        self.environment: dict[str, str] = {}
        self.refused: list[str] = []
        self.jail_refused: list[str] = []  # what the supervisor refused the candidate's ranks
        self.calls = 0
        self.loaded = False

    @property
    def moved_data_itself(self) -> bool:
        return not (self.collectives or self.network)

    def traffic(self, sent: int | None, during: str) -> None:
        """A reading of the jail's network counters (RankGroup.traffic)."""
        if sent is None:
            self.network_unread = True
        elif sent and self.judged:
            self.network.append(f"{sent} data segment(s) sent while {during}")

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
        if not self.moved_data_itself:
            seen = []
            if self.network:
                seen.append("its ranks sent data over the jail's network, where only a "
                            "process group's connections are (the jail's own counters, "
                            "read from outside): " + "; ".join(self.network[:2]))
            if self.collectives:
                seen.append("its ranks counted torch.distributed collectives: "
                            + "; ".join(self.collectives[:2]))
            found.append(Guard("moves-data", "fail", "the candidate did not move the data "
                               "itself: its forward took the collective library's path, the "
                               "baseline's own: " + "; and ".join(seen)))
        elif not self.judged:
            found.append(Guard("moves-data", "pass", "the baseline itself: its collectives are "
                               "the path candidates are timed against"))
        elif self.network_unread:
            found.append(Guard("moves-data", "warn", "the jail's network counters could not be "
                               "read from outside here: only the ranks' own count of "
                               f"collectives (none in {self.calls} forward calls) speaks, and a "
                               "candidate can rewrite it"))
        elif self.calls:
            found.append(Guard("moves-data", "pass", f"no data crossed the jail's network in "
                               f"{self.calls} forward calls, or between them (its counters, "
                               "read from outside), and no rank counted a collective of any "
                               "process group"))
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
        if self.jail_refused:
            counts = Counter(self.jail_refused)
            found.append(Guard("jail", "fail", "the jail refused: " + "; ".join(
                f"{item} (×{count})" if count > 1 else item for item, count in list(counts.items())[:6])))
        else:
            found.append(Guard("jail", "pass", "all ranks in one jail of their own: its own PID, "
                               "mount, network (its loopback only) and IPC namespaces, the "
                               "project read-only, the group's folder the only writable "
                               "place; nothing refused"))
        return found


def load(group: RankGroup, watch: RanksWatch) -> None:
    """The candidate imported (and set up) on every rank of its group; CallFailed or
    ChildFailure when it is not."""
    for rank, header in enumerate(group.load()):
        watch.note(rank, header, "importing")
    watch.loaded = True


def check_correctness(op: Op, candidate: RankGroup, workloads: list[Workload], *,
                      secret_seed: int, watch: RanksWatch) -> list[Guard]:
    """Every rank's output of every workload, in every distribution, against the exact
    sum, and every rank's input unchanged: the `correctness` guard, then (when that
    passed) `inputs-unchanged`. Stops early once the candidate was seen falling back to
    the collective library (`watch`)."""
    failures: list[str] = []
    changed: list[str] = []
    checked = 0
    for slot, workload in enumerate(workloads):
        for distribution in DISTRIBUTIONS:
            inputs = op.make_inputs(workload, derive_seed(secret_seed, "inputs", workload.name,
                                                          distribution), distribution)
            reference = op.reference(inputs)
            candidate.prepare(slot, inputs["x"])
            during = f"checking {workload.name}"
            watch.traffic(candidate.traffic(), f"between requests, before {during}")
            answers = candidate.ask("check", during, slot=slot)
            watch.traffic(candidate.traffic(), during)
            for rank, (header, tensors) in enumerate(answers):
                watch.calls += 1
                watch.note(rank, header, during)
                output = tensors.get("output")
                ok, detail = (op.check(output, reference, inputs) if output is not None
                              else (False, "forward returned no tensor"))
                checked += 1
                if not ok:
                    failures.append(f"{workload.name}, {distribution}, rank {rank}: {detail}")
                if not torch.equal(tensors["x_after"], inputs["x"][rank]):
                    changed.append(f"{workload.name}, rank {rank}")
        candidate.ask("drop", "dropping inputs", slot=slot)
        if not watch.moved_data_itself:
            break
    if failures:
        more = f"; and {len(failures) - 1} more" if len(failures) > 1 else ""
        return [Guard("correctness", "fail", failures[0] + more)]
    return [Guard("correctness", "pass", f"every rank's output matches the exact sum: "
                  f"{checked} outputs over {len(workloads)} workloads and "
                  f"{len(DISTRIBUTIONS)} distributions"),
            Guard("inputs-unchanged", "fail", f"forward wrote its input x: {changed[0]}")
            if changed else Guard("inputs-unchanged", "pass",
                                  "every rank's input unchanged by the call")]


def _judge(op: Op, groups: dict[str, RankGroup], workloads: list[Workload],
           result: EvaluationResult, watch: RanksWatch, *, budget_s: float,
           say: Callable[[str], None], end_to_end: bool) -> None:
    groups[BASELINE].load()
    load(groups[CANDIDATE], watch)
    result.guards.append(Guard("loads", "pass", f"imported on all {op.world_size} ranks"))
    checked = check_correctness(op, groups[CANDIDATE], workloads, secret_seed=result.seed,
                                watch=watch)
    result.guards += checked
    if any(guard.status == "fail" for guard in checked):
        return  # wrong, or it wrote its input: result.correct stays False
    result.correct = True
    if not watch.moved_data_itself or watch.environment:
        return  # rejected already: nothing to time

    result.workloads = []
    for workload in workloads:
        times, wrong = _time(op, groups, workload, watch, result.seed, budget_s=budget_s)
        if wrong:
            more = f"; and {len(wrong) - 1} more" if len(wrong) > 1 else ""
            result.guards.append(Guard(TIMED_OUTPUTS, "fail", wrong[0] + more))
            result.correct = False
            return
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
        low, high = timed.speedup_ci
        say(f"timing {workload.name}: baseline {timed.baseline_ms:.4g} ms, candidate "
            f"{timed.candidate_ms:.4g} ms (slowest of {op.world_size} ranks), speedup "
            f"{timed.speedup:.3f}x [{low:.3f}, {high:.3f}], p={timed.p_value:.2g}"
            + (" (significant)" if timed.significant else ""))
        if not watch.moved_data_itself or watch.environment:
            return  # it behaved otherwise once timed: rejected, no more to time
    if not end_to_end:
        return
    # The end-to-end check, in the same rank groups: a tensor-parallel decode step.
    result.e2e, guard = collective_endtoend.check(
        op, groups, watch, workloads=workloads, kernel_results=result.workloads,
        device=result.device, secret_seed=result.seed, budget_s=budget_s,
        meaningful=result.timing_meaningful, say=say)
    result.guards.append(guard)
    say(f"end to end: {guard.detail}")


def _time(op: Op, groups: dict[str, RankGroup], workload: Workload, watch: RanksWatch,
          secret_seed: int, *, budget_s: float) -> tuple[dict[str, list[float]], list[str]]:
    """The op's own calls at one workload, in alternating rounds (rank_timing): each
    call's input drawn from the secret seed, new every round, and every output read
    checked against its exact sum. Returns the times and what was wrong in the timed
    outputs read."""
    def draw(round_number: int) -> Round:
        calls = [op.make_inputs(workload, derive_seed(secret_seed, "timing", workload.name,
                                                      round_number, call), DISTRIBUTIONS[0])
                 for call in range(SAMPLES_PER_ROUND)]

        def check(call: int, output: Any) -> tuple[bool, str]:
            inputs = calls[call]
            return (op.check(output, op.reference(inputs), inputs) if output is not None
                    else (False, "forward returned no tensor"))

        return Round(torch.stack([inputs["x"] for inputs in calls], dim=1), check)  # (rank, call, ...)

    # The judge's own draw of the rounds it reads, from a seed the ranks never see.
    picker = np.random.default_rng(derive_seed(secret_seed, "timed outputs", workload.name))
    return time_rounds(groups, watch, label=workload.name, budget_s=budget_s, draw=draw,
                       picker=picker)
