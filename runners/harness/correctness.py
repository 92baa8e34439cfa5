"""Is the candidate right? Judged here, in the trusted process, from what its child sends back.

For every workload, both value distributions and three secret seeds, the child generates
the inputs from the seed, calls forward, and sends the output with a fingerprint of its
inputs after the call. The judge generates the same inputs itself, computes the
reference on them (no reference ever exists in the child, so none can be read there),
and checks in full: type, device, dtype and shape, every value against the op's
tolerance (NaN and inf fail), and the inputs' fingerprint against its own pristine copy.
The first seed of each distribution runs twice in a row: the same inputs must give the
identical output, and an output read from stale memory meets the child's poison.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runners.harness.candidate import one_line
from runners.harness.children import CallFailed, Reply, Requester
from runners.harness.digest import input_digest
from runners.harness.result import Guard
from runners.harness.seeds import derive_seed
from runners.ops import DISTRIBUTIONS, Op, Workload

SEEDS_PER_DISTRIBUTION = 3
# The first seed again, right after itself: same inputs, identical output.
CALL_ORDER = (0, 0, 1, 2)

CORRECTNESS = "correctness"
OUTPUT_TYPE = "output-type"
INPUTS_UNCHANGED = "inputs-unchanged"
DETERMINISTIC = "deterministic"
TIMED_OUTPUTS = "timed-outputs"
CHECK_SLOT = "check"


@dataclass
class Expected:
    """What the judge knows about one call, from its own pristine inputs."""

    inputs: dict[str, Any]
    reference: torch.Tensor
    max_bytes: int


@dataclass
class Fetched:
    """A call's output as the child sent it, and the key its input fingerprint used."""

    reply: Reply
    key: int


def fetch_output(child: Requester, during: str, max_bytes: int) -> Fetched:
    # A fresh key per fetch, drawn after the call: nothing to tune a change against.
    key = secrets.randbits(63)
    return Fetched(child.request("fetch", during, max_bytes=max_bytes, key=key), key)


def output_bound(inputs: dict[str, Any]) -> int:
    """More bytes than any right answer: twice the inputs, plus room for a small output."""
    size = sum(value.numel() * value.element_size() for value in inputs.values()
               if isinstance(value, torch.Tensor))
    return 2 * size + 2**20


def expect(op: Op, workload: Workload, seed: int, distribution: str) -> Expected:
    inputs = op.make_inputs(workload, seed, distribution)
    reference = op.reference({key: value.clone() if isinstance(value, torch.Tensor) else value
                              for key, value in inputs.items()})
    return Expected(inputs, reference, output_bound(inputs))


def _type_problem(facts: Any, device: str) -> str | None:
    """Catches lazy outputs: a tensor subclass can defer its work into the comparison."""
    if not isinstance(facts, dict):
        return "the child sent no description of the output"
    if facts.get("plain_tensor") is True:
        if facts.get("device") != device:
            return f"forward returned a tensor on {facts.get('device')}; the inputs are on {device}"
        if facts.get("layout") != "torch.strided":
            return f"forward returned a {facts.get('layout')} tensor; only a strided tensor is accepted"
        return None
    name = str(facts.get("type", "?")).rsplit(".", 1)[-1]
    if facts.get("tensor") is True:
        return f"forward returned a {name} (a torch.Tensor subclass); only a plain torch.Tensor is accepted"
    return f"forward returned {name}, not a torch.Tensor"


def judge_output(op: Op, expected: Expected, fetched: Fetched, device: str) -> dict[str, str | None]:
    """Each guard's failure for one fetched output, or None where it passed."""
    reply = fetched.reply
    header = reply.header
    outcome: dict[str, str | None] = {}
    if header.get("inputs_digest") == input_digest(expected.inputs, fetched.key):
        outcome[INPUTS_UNCHANGED] = None
    else:
        change = header.get("inputs_changed")
        outcome[INPUTS_UNCHANGED] = "inputs changed after the call: " + (
            str(change) if isinstance(change, str) and change
            else "their fingerprint no longer matches the pristine inputs'")
    facts = header.get("output")
    outcome[OUTPUT_TYPE] = _type_problem(facts, device)
    if outcome[OUTPUT_TYPE] is None:
        outcome[CORRECTNESS] = _value_problem(op, expected, facts, reply.tensors.get("output"), device)
    return outcome


def _value_problem(op: Op, expected: Expected, facts: dict[str, Any],
                   output: torch.Tensor | None, device: str) -> str | None:
    if output is None:
        return (f"the output ({facts.get('dtype')} {facts.get('shape')}) is larger than any "
                f"right answer ({expected.max_bytes:,} bytes)")
    if list(output.shape) != facts.get("shape") or str(output.dtype) != f"torch.{facts.get('dtype')}":
        return "the output's bytes do not match its own description"
    try:
        ok, detail = op.check(output.to(device), expected.reference, expected.inputs)
    except Exception as error:
        ok, detail = False, f"the output could not be compared: {one_line(error)}"
    return None if ok else detail


def identical(first: torch.Tensor | None, second: torch.Tensor | None) -> str | None:
    """Bit for bit, so NaN equals NaN and -0.0 differs from 0.0."""
    if first is None or second is None:
        return None
    if first.shape != second.shape or first.dtype != second.dtype:
        return "the same inputs gave outputs of different shapes or dtypes"
    a, b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (first, second))
    if torch.equal(a, b):
        return None
    differ = int((first.reshape(-1) != second.reshape(-1)).sum())
    return (f"the same inputs gave a different output the second time "
            f"({differ:,} of {first.numel():,} values differ)")


def call_failure(failure: CallFailed, guard: str, where: str) -> Guard:
    """A call the child said failed, as the guard that explains it."""
    if failure.kind == "memory":
        return Guard("resources", "fail", f"ran out of memory: {failure.error} ({where})")
    if failure.kind == "capture":
        return Guard("cuda-graph", "fail",
                     f"forward cannot be captured in a CUDA graph: {failure.error} ({where})")
    return Guard(guard, "fail", f"forward raised {failure.error} ({where})")


@dataclass
class _Tally:
    """How one guard fared: calls it passed, and the first failure if any."""

    passed: int = 0
    failure: str | None = None


@dataclass(frozen=True)
class CheckCall:
    workload: Workload
    distribution: str
    index: int
    seed: int
    repeat: bool

    @property
    def where(self) -> str:
        return (f"{self.workload.name}, {self.distribution} inputs, seed #{self.index + 1}"
                + (", repeated" if self.repeat else ""))


def check_calls(workload: Workload, secret_seed: int) -> list[CheckCall]:
    """The checked calls of one workload, in the order they run."""
    calls = []
    for distribution in DISTRIBUTIONS:
        seen: set[int] = set()
        for index in CALL_ORDER:
            seed = derive_seed(secret_seed, "correctness", workload.name, distribution, index)
            calls.append(CheckCall(workload, distribution, index, seed, repeat=index in seen))
            seen.add(index)
    return calls


def run_check_call(child: Requester, call: CheckCall) -> None:
    fields = {"slot": CHECK_SLOT}
    child.request("load", f"preparing {call.where}", workload=call.workload.to_dict(),
                  seed=call.seed, distribution=call.distribution, **fields)
    child.request("run", f"running forward on {call.where}", **fields)


def replay_checks(child: Requester, workloads: list[Workload], *, secret_seed: int) -> None:
    """The candidate's checked calls, run again in a baseline process, outputs unread.

    Gives the baseline processes the candidate's history: the same allocations in the
    same order leave the heap laid out alike, and where buffers sit relative to each
    other (4K aliasing, cache sets) moved CPU times by 10-15% between processes.
    """
    for workload in workloads:
        for call in check_calls(workload, secret_seed):
            run_check_call(child, call)
    child.request("drop", "freeing the checked inputs", slots=[CHECK_SLOT])


def check_correctness(
    op: Op,
    child: Requester,
    workloads: list[Workload],
    *,
    secret_seed: int,
    progress: Callable[[str], None],
) -> list[Guard]:
    """Guards for output type, untouched inputs, determinism and correctness; stops at
    the first failure. A failed call becomes the guard that explains it."""
    tallies = {name: _Tally() for name in (CORRECTNESS, OUTPUT_TYPE, INPUTS_UNCHANGED, DETERMINISTIC)}
    failed: Guard | None = None
    for workload in workloads:
        failed = _check_workload(op, child, workload, secret_seed, tallies)
        broken = failed is not None or any(tally.failure for tally in tallies.values())
        progress(f"correctness {workload.name}: {'FAILED' if broken else 'ok'}")
        if broken:
            break
    else:
        child.request("drop", "freeing the checked inputs", slots=[CHECK_SLOT])

    clean = failed is None and not any(tally.failure for tally in tallies.values())
    scope = (f" (all: {len(workloads)} workloads × {len(DISTRIBUTIONS)} distributions × "
             f"{SEEDS_PER_DISTRIBUTION} seeds, the first twice)" if clean else "")
    passing = {
        CORRECTNESS: "matched the reference",
        OUTPUT_TYPE: "returned a plain torch.Tensor on the inputs' device",
        INPUTS_UNCHANGED: "left the inputs identical to pristine copies",
        DETERMINISTIC: "gave identical outputs for identical inputs",
    }
    guards = [failed] if failed else []
    for name, tally in tallies.items():
        if tally.failure is not None:
            guards.append(Guard(name, "fail", tally.failure))
        elif tally.passed and not any(guard.name == name for guard in guards):
            calls_text = "1 call" if tally.passed == 1 else f"{tally.passed} calls"
            guards.append(Guard(name, "pass", f"{passing[name]} in {calls_text}{scope}"))
    return guards


def _check_workload(op: Op, child: Requester, workload: Workload, secret_seed: int,
                    tallies: dict[str, _Tally]) -> Guard | None:
    expected: dict[tuple[str, int], Expected] = {}
    first_output: dict[str, torch.Tensor | None] = {}
    for call in check_calls(workload, secret_seed):
        key = (call.distribution, call.index)
        if key not in expected:
            expected[key] = expect(op, workload, call.seed, call.distribution)
        try:
            run_check_call(child, call)
            fetched = fetch_output(child, f"sending the output of {call.where}", expected[key].max_bytes)
        except CallFailed as failure:
            return call_failure(failure, CORRECTNESS, call.where)
        outcome = judge_output(op, expected[key], fetched, workload.device)
        output = fetched.reply.tensors.get("output")
        if not call.repeat:
            first_output.setdefault(call.distribution, output)
        elif outcome.get(CORRECTNESS, "") is None:
            outcome[DETERMINISTIC] = identical(first_output.get(call.distribution), output)
        for name, problem in outcome.items():
            if problem is None:
                tallies[name].passed += 1
            elif tallies[name].failure is None:
                tallies[name].failure = f"{problem} ({call.where})"
        if any(problem is not None for problem in outcome.values()):
            return None
    return None


def revalidate(op: Op, workload: Workload, fetched: list[tuple[int, int, str, Fetched]],
               ) -> list[Guard]:
    """Outputs of timed calls, fetched at calls the child could not predict: each checked
    against its own inputs' reference. (slot seed, call number, distribution, reply)."""
    problems: list[Guard] = []
    cache: dict[tuple[int, str], Expected] = {}
    for seed, call, distribution, output in fetched:
        key = (seed, distribution)
        if key not in cache:
            cache[key] = expect(op, workload, seed, distribution)
        outcome = judge_output(op, cache[key], output, workload.device)
        where = f"{workload.name}, timed call #{call + 1}"
        for name, problem in outcome.items():
            if problem is not None:
                guard = INPUTS_UNCHANGED if name == INPUTS_UNCHANGED else TIMED_OUTPUTS
                problems.append(Guard(guard, "fail", f"{problem} ({where})"))
        if problems:
            break
    return problems
