"""Is the candidate right? Judged here, in the trusted process, from what it read of the child.

For every workload, both value distributions and three secret seeds, the judge makes the
inputs itself and writes them where the child reads them (runners.harness.arena), asks
for one call, and once the child is stopped reads the output and the inputs straight
from the child's memory (children.Child.read_output): nothing of the candidate runs
between the call and the reading, and nothing it says about the output is believed but
where to find it. The judge computes the reference on its own pristine copy (no
reference ever exists in the child) and checks in full: type, device, dtype and shape,
every value against the op's tolerance (NaN and inf fail), and every input byte against
the pristine copy. The first seed of each distribution runs twice in a row: the same
inputs must give the identical output, and an output read from stale memory meets the
child's poison. Then it runs a third time with a few of its values changed (op.nearly):
a kernel that recognises inputs by a sample of their values returns its old answer.

Besides the workloads asked for, every run checks secret sizes the candidate cannot
know (drawn from the secret seed inside the op's range, no multiple of any tile): a
kernel right only on the declared grid is caught there.
"""

from __future__ import annotations

import math

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runners.harness import arena
from runners.harness.candidate import one_line
from runners.harness.children import CallFailed, Reply, Requester, Unreadable
from runners.harness.memo import NO_MEMO, Memo
from runners.harness.result import Guard
from runners.harness.seeds import derive_seed
from runners.ops import DISTRIBUTIONS, Op, Workload

SEEDS_PER_DISTRIBUTION = 3
# Per distribution: the first seed; the same inputs again (identical output); those
# inputs with a few values changed; then the other seeds. Secret sizes get two seeds.
FIRST, REPEAT, NEARLY = "first", "repeat", "nearly"
CALL_ORDER = ((0, FIRST), (0, REPEAT), (0, NEARLY), (1, FIRST), (2, FIRST))
SECRET_CALL_ORDER = ((0, FIRST), (1, FIRST))

CORRECTNESS = "correctness"
OUTPUT_TYPE = "output-type"
INPUTS_UNCHANGED = "inputs-unchanged"
DETERMINISTIC = "deterministic"
TIMED_OUTPUTS = "timed-outputs"
CHECK_SLOT = "check"
# A checked call that went wrong on replay, captured again on its own inputs.
REPLAY_SLOT = "recheck"
# How long the judge's probe kernel may wait for the GPU after a reply before the GPU
# was still busy with the call's work: 0.11 ms idle on an H200, 1.25 ms behind a 1 ms
# kernel (bench/gpu_sharing.py).
GPU_BUSY_MS = 0.5


class Feed(Protocol):
    """Where the judge writes a call's inputs for the children to read (arena.Arena)."""

    def write(self, entries: list[arena.Entry], inputs: dict[str, Any]) -> None: ...


@dataclass
class Expected:
    """What the judge knows about one call, from its own pristine inputs."""

    inputs: dict[str, Any]
    entries: list[arena.Entry]
    reference: torch.Tensor
    max_bytes: int


@dataclass
class Observed:
    """What the judge read of one call, right after it and before the child ran again:
    the reply's description of the output, the output itself (None when it was larger
    than any right answer), the inputs as the child holds them, or why it could not."""

    facts: Any
    output: torch.Tensor | None = None
    inputs_now: dict[str, torch.Tensor] | None = None
    unreadable: str | None = None


def output_bound(inputs: dict[str, Any]) -> int:
    """More bytes than any right answer: twice the inputs, plus room for a small output."""
    size = sum(value.numel() * value.element_size() for value in inputs.values()
               if isinstance(value, torch.Tensor))
    return 2 * size + 2**20


def expect(op: Op, workload: Workload, seed: int, distribution: str,
           inputs: dict[str, Any] | None = None, *, memo: Memo = NO_MEMO,
           variant: str = "") -> Expected:
    """The inputs of `seed` and `distribution` (or `inputs`, which those and `variant`
    decide, e.g. the nearly repeated call's) and their reference."""
    inputs = memo.inputs(op, workload, seed, distribution) if inputs is None else inputs
    reference = memo.reference(op, workload, (seed, distribution, variant), inputs)
    return Expected(inputs, arena.layout(inputs), reference, output_bound(inputs))


def output_facts(reply: Reply, index: int = 0) -> Any:
    """Where the reply says the output of its request's call number `index` is (None
    when it does not say)."""
    outputs = reply.header.get("outputs")
    return outputs[index] if isinstance(outputs, list) and -len(outputs) <= index < len(outputs) else None


def observe(child: Requester, reply: Reply, expected_entries: list[arena.Entry],
            max_bytes: int, index: int = 0) -> Observed:
    """Reads the output of a request's call number `index`, and its inputs, from the
    stopped child."""
    facts = output_facts(reply, index)
    observed = Observed(facts)
    if _type_problem(facts, None) is not None:
        return observed
    try:
        observed.output = child.read_output(facts, max_bytes)
        observed.inputs_now = child.read_inputs(expected_entries)
    except Unreadable as error:
        observed.unreadable = str(error)
    return observed


def _type_problem(facts: Any, device: str | None) -> str | None:
    """Catches lazy outputs: a tensor subclass can defer its work into the comparison."""
    if not isinstance(facts, dict):
        return "the child sent no description of the output"
    if facts.get("plain_tensor") is True:
        if device is not None and facts.get("device") != device:
            return f"forward returned a tensor on {facts.get('device')}; the inputs are on {device}"
        if facts.get("layout") != "torch.strided":
            return f"forward returned a {facts.get('layout')} tensor; only a strided tensor is accepted"
        return None
    name = str(facts.get("type", "?")).rsplit(".", 1)[-1]
    if facts.get("tensor") is True:
        return f"forward returned a {name} (a torch.Tensor subclass); only a plain torch.Tensor is accepted"
    return f"forward returned {name}, not a torch.Tensor"


def _input_change(expected: Expected, now: dict[str, torch.Tensor]) -> str | None:
    """What changed in the inputs, in words; None when every byte is as written."""
    for entry in expected.entries:
        if not entry.is_tensor:
            continue
        original = expected.inputs[entry.name].detach().contiguous()
        seen = now.get(entry.name)
        if seen is None:
            return f"{entry.name} could not be read back"
        if torch.equal(original.reshape(-1).view(torch.uint8), seen.reshape(-1).view(torch.uint8)):
            continue
        differ = int((original.reshape(-1) != seen.reshape(-1)).sum())
        return f"{differ:,} of {original.numel():,} elements of {entry.name} differ"
    return None


def judge_output(op: Op, expected: Expected, observed: Observed, device: str) -> dict[str, str | None]:
    """Each guard's failure for one observed call, or None where it passed."""
    outcome: dict[str, str | None] = {OUTPUT_TYPE: _type_problem(observed.facts, device)}
    if outcome[OUTPUT_TYPE] is not None:
        return outcome
    if observed.unreadable is not None:
        outcome[CORRECTNESS] = f"the output could not be read from the child: {observed.unreadable}"
        return outcome
    change = _input_change(expected, observed.inputs_now or {})
    outcome[INPUTS_UNCHANGED] = None if change is None else f"inputs changed after the call: {change}"
    outcome[CORRECTNESS] = _value_problem(op, expected, observed.facts, observed.output, device)
    return outcome


def _value_problem(op: Op, expected: Expected, facts: dict[str, Any],
                   output: torch.Tensor | None, device: str) -> str | None:
    if output is None:
        return (f"the output ({facts.get('dtype')} {facts.get('shape')}) is larger than any "
                f"right answer ({expected.max_bytes:,} bytes)")
    try:
        ok, detail = op.check(output.to(device), expected.reference, expected.inputs)
    except Exception as error:
        ok, detail = False, f"the output could not be compared: {one_line(error)}"
    return None if ok else detail


def _head(values: torch.Tensor, shown: int) -> str:
    return ", ".join(str(v) for v in values[:shown].tolist()) + (", …" if values.numel() > shown else "")


def metadata_change(before: dict[str, Any], after: dict[str, Any], shown: int = 4) -> str | None:
    """How the integer inputs (lengths, block tables: what a server changes between
    replays of one graph) differ between two input sets, in words."""
    changes = []
    for name, value in after.items():
        old = before.get(name)
        if (not isinstance(value, torch.Tensor) or value.is_floating_point()
                or not isinstance(old, torch.Tensor) or old.shape != value.shape
                or torch.equal(old, value)):
            continue
        if value.dim() == 1:
            changes.append(f"{name} {_head(old, shown)} → {_head(value, shown)}")
        else:
            differ = int((old != value).sum())
            changes.append(f"{name} differs in {differ:,} of {value.numel():,} entries")
    return "; ".join(changes) or None


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
    kind: str = FIRST

    @property
    def repeat(self) -> bool:
        return self.kind == REPEAT

    @property
    def where(self) -> str:
        return (f"{self.workload.name}, {self.distribution} inputs, seed #{self.index + 1}"
                + {FIRST: "", REPEAT: ", repeated", NEARLY: ", nearly repeated"}[self.kind])


def check_calls(workload: Workload, secret_seed: int,
                order: tuple[tuple[int, str], ...] = CALL_ORDER) -> list[CheckCall]:
    """The checked calls of one workload, in the order they run."""
    return [CheckCall(workload, distribution, index,
                      derive_seed(secret_seed, "correctness", workload.name, distribution, index), kind)
            for distribution in DISTRIBUTIONS for index, kind in order]


class CallInputs:
    """The inputs of each checked call and what the judge expects of it, made when the
    call comes (a candidate wrong at its first call is rejected after one reference, not a
    workload's worth) and let go once no call left needs them: a workload's input sets
    are the judge's largest memory, and on a GPU the children share the device with it
    (eight sets of a 64 x 256K paged cache held together were 32 GiB). The nearly
    repeated call's come from its seed's and the next seed's, at places drawn from the
    secret seed."""

    def __init__(self, op: Op, workload: Workload, secret_seed: int, calls: list[CheckCall],
                 memo: Memo = NO_MEMO) -> None:
        self.op, self.workload, self.secret_seed, self.memo = op, workload, secret_seed, memo
        self._left = list(calls)
        self._made: dict[tuple[str, int], dict[str, Any]] = {}
        self._nearly: dict[str, dict[str, Any]] = {}
        self._expected: dict[tuple[str, int, bool], Expected] = {}

    def _seeded(self, distribution: str, index: int) -> dict[str, Any]:
        key = (distribution, index)
        if key not in self._made:
            seed = derive_seed(self.secret_seed, "correctness", self.workload.name, distribution, index)
            self._made[key] = self.memo.inputs(self.op, self.workload, seed, distribution)
        return self._made[key]

    def of(self, call: CheckCall) -> dict[str, Any]:
        if call.kind != NEARLY:
            return self._seeded(call.distribution, call.index)
        if call.distribution not in self._nearly:
            places = torch.Generator()
            places.manual_seed(derive_seed(self.secret_seed, "nearly", self.workload.name,
                                           call.distribution))
            self._nearly[call.distribution] = self.op.nearly(
                self._seeded(call.distribution, call.index),
                self._seeded(call.distribution, call.index + 1), places)
        return self._nearly[call.distribution]

    def expected(self, call: CheckCall) -> Expected:
        key = _set_of(call)
        if key not in self._expected:
            self._expected[key] = expect(self.op, self.workload, call.seed, call.distribution,
                                         self.of(call), memo=self.memo,
                                         variant=NEARLY if call.kind == NEARLY else "")
        return self._expected[key]

    def done(self, call: CheckCall) -> None:
        """`call` has run: whatever only it still needed is let go."""
        self._left.remove(call)
        seeded: set[tuple[str, int]] = set()
        for later in self._left:
            if later.kind != NEARLY:
                seeded.add((later.distribution, later.index))
            elif later.distribution not in self._nearly:  # still to be made from these two
                seeded |= {(later.distribution, later.index), (later.distribution, later.index + 1)}
        nearly = {later.distribution for later in self._left if later.kind == NEARLY}
        sets = {_set_of(later) for later in self._left}
        self._made = {key: value for key, value in self._made.items() if key in seeded}
        self._nearly = {key: value for key, value in self._nearly.items() if key in nearly}
        self._expected = {key: value for key, value in self._expected.items() if key in sets}


def _set_of(call: CheckCall) -> tuple[str, int, bool]:
    """Which input set a call runs on: its seed's, or the nearly repeated one's."""
    return (call.distribution, call.index, call.kind == NEARLY)


def prepare(child: Requester, feed: Feed, slot: str, inputs: dict[str, Any], during: str,
            entries: list[arena.Entry] | None = None) -> Reply:
    """Writes a first input set (where `entries` say, by default at the arena's start)
    and has the child take the slot's arguments on it (on CUDA it captures the call there)."""
    entries = arena.layout(inputs) if entries is None else entries
    feed.write(entries, inputs)
    return child.request("prepare", during, slot=slot, layout=[entry.to_dict() for entry in entries],
                  output_bytes=output_bound(inputs))


def run_check_call(child: Requester, feed: Feed, expected: Expected, call: CheckCall) -> Reply:
    feed.write(expected.entries, expected.inputs)
    return child.request("run", f"running forward on {call.where}", slot=CHECK_SLOT)


# The checked calls each timing process runs before its first timed one.
REPLAY_ORDER = ((0, FIRST),)


def replay_checks(children: list[Requester], feed: Feed, op: Op, workloads: list[Workload], *,
                  secret_seed: int, memo: Memo = NO_MEMO) -> None:
    """One checked call of every workload, run in each timing process in turn, outputs
    unread: the three processes start timing from one history (the same allocations in
    the same order leave the heap laid out alike, and where buffers sit relative to each
    other, 4K aliasing and cache sets, moved CPU times by 10-15% between processes), and
    each has run every workload once. Each call's inputs are made and written once."""
    for workload in workloads:
        calls = check_calls(workload, secret_seed, REPLAY_ORDER)
        made = CallInputs(op, workload, secret_seed, calls, memo)
        first = made.of(calls[0])
        entries, output_bytes = arena.layout(first), output_bound(first)
        feed.write(entries, first)
        del first
        for child in children:
            child.request("prepare", f"preparing the checked calls of {workload.name}", slot=CHECK_SLOT,
                          layout=[entry.to_dict() for entry in entries], output_bytes=output_bytes)
        for index, call in enumerate(calls):
            if index:  # the first call's inputs are in place since the prepare
                feed.write(entries, made.of(call))
            for child in children:
                child.request("run", f"running forward on {call.where}", slot=CHECK_SLOT)
            made.done(call)
    for child in children:
        child.request("drop", "freeing the checked inputs", slots=[CHECK_SLOT])


def check_correctness(
    op: Op,
    child: Requester,
    workloads: list[Workload],
    *,
    feed: Feed,
    secret_seed: int,
    progress: Callable[[str], None],
    secret: list[Workload] = (),
    first_passed: Callable[[], None] | None = None,
    memo: Memo = NO_MEMO,
) -> list[Guard]:
    """Guards for output type, untouched inputs, determinism and correctness; stops at
    the first failure. A failed call becomes the guard that explains it. `secret` are
    the secret sizes, checked after the workloads asked for. `first_passed` is called
    once the first call (the first workload's, its smallest) has passed every check: the
    cheap check that most wrong candidates fail, after which the rest of the matrix runs."""
    tallies = {name: _Tally() for name in (CORRECTNESS, OUTPUT_TYPE, INPUTS_UNCHANGED, DETERMINISTIC)}
    failed: Guard | None = None
    pending = [first_passed] if first_passed is not None else []
    for workload, order in [*((w, CALL_ORDER) for w in workloads),
                            *((w, SECRET_CALL_ORDER) for w in secret)]:
        failed = _check_workload(op, child, feed, workload, secret_seed, tallies, order, pending, memo)
        if workload.device == "cuda":
            # The workload's sets back to the device, not only to the judge's allocator
            # cache: the judge held 29 GiB of an H100's 80 so through the paged ops' timing
            # at 256K, and a baseline process's allocation failed.
            torch.cuda.empty_cache()
        broken = failed is not None or any(tally.failure for tally in tallies.values())
        progress(f"correctness {workload.name}: {'FAILED' if broken else 'ok'}")
        if broken:
            break
    else:
        child.request("drop", "freeing the checked inputs", slots=[CHECK_SLOT])

    clean = failed is None and not any(tally.failure for tally in tallies.values())
    scope = (f" (all: {len(workloads)} workloads × {len(DISTRIBUTIONS)} distributions × "
             f"{SEEDS_PER_DISTRIBUTION} seeds, the first twice and once nearly; and "
             f"{len(secret)} secret sizes)" if clean else "")
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


def _check_workload(op: Op, child: Requester, feed: Feed, workload: Workload, secret_seed: int,
                    tallies: dict[str, _Tally],
                    order: tuple[tuple[int, str], ...] = CALL_ORDER,
                    first_passed: list[Callable[[], None]] | None = None,
                    memo: Memo = NO_MEMO) -> Guard | None:
    """`first_passed`: callbacks to call (and empty) once a call passed every check."""
    first_output: dict[str, torch.Tensor | None] = {}
    calls = check_calls(workload, secret_seed, order)
    made = CallInputs(op, workload, secret_seed, calls, memo)
    first_inputs = made.of(calls[0])
    # What a replay with new metadata is told apart by (metadata_change): the first set's
    # integers, kept small after the set itself is let go.
    captured = {name: value for name, value in first_inputs.items()
                if isinstance(value, torch.Tensor) and not value.is_floating_point()}
    try:
        prepare(child, feed, CHECK_SLOT, first_inputs, f"preparing the checked calls of {workload.name}")
    except CallFailed as failure:
        return call_failure(failure, CORRECTNESS, f"{workload.name}, preparing its calls")
    del first_inputs
    for call in calls:
        this = made.expected(call)
        try:
            reply = run_check_call(child, feed, this, call)
        except CallFailed as failure:
            return call_failure(failure, CORRECTNESS, call.where)
        observed = observe(child, reply, this.entries, this.max_bytes)
        outcome = judge_output(op, this, observed, workload.device)
        if call.kind == FIRST:
            first_output.setdefault(call.distribution, observed.output)
        elif call.kind == REPEAT and outcome.get(CORRECTNESS, "") is None:
            outcome[DETERMINISTIC] = identical(first_output.get(call.distribution), observed.output)
        for name, problem in outcome.items():
            if problem is None:
                tallies[name].passed += 1
            elif tallies[name].failure is None:
                tallies[name].failure = f"{problem} ({call.where})"
        if any(problem is not None for problem in outcome.values()):
            if (workload.device == "cuda" and outcome.get(CORRECTNESS) is not None
                    and _set_of(call) != _set_of(calls[0])):
                baked = _replay_problem(op, child, feed, this, calls[0], call, captured,
                                        outcome[CORRECTNESS], gpu_wait_ms=reply.idle_ms)
                if baked is not None:
                    tallies[CORRECTNESS].failure = None
                    return baked
            return None
        del this, observed
        made.done(call)
        while first_passed:
            first_passed.pop()()
    return None


def _replay_problem(op: Op, child: Requester, feed: Feed, expected: Expected, captured: CheckCall,
                    call: CheckCall, captured_inputs: dict[str, Any], problem: str, *,
                    gpu_wait_ms: float = math.nan) -> Guard | None:
    """A replay that went wrong, run again in a graph captured on its own inputs. Right
    there, it kept something of the call it was captured on (a length, a shape, a
    schedule read on the host) that a server's replay changes: the graph is to blame,
    not the arithmetic. None when it is wrong there too, or cannot be run again."""
    try:
        prepare(child, feed, REPLAY_SLOT, expected.inputs, f"capturing {call.where} on its own inputs")
        reply = child.request("run", f"running forward on {call.where}, captured on its own inputs",
                              slot=REPLAY_SLOT)
        observed = observe(child, reply, expected.entries, expected.max_bytes)
        child.request("drop", "freeing the recaptured call", slots=[REPLAY_SLOT])
    except CallFailed:
        return None
    if any(judge_output(op, expected, observed, "cuda").values()):
        return None
    changed = metadata_change(captured_inputs, expected.inputs)
    if gpu_wait_ms > GPU_BUSY_MS:
        # Wrong when read, with the GPU still busy: the graph is not to blame, the work
        # that was still running when the judge read the output is.
        return Guard("cuda-graph", "fail", (
            f"wrong when the graph captured on {captured.where} is replayed on the inputs of "
            f"{call.where}: {problem}, with work left running on the GPU past the reply (the "
            f"judge's own kernel waited {gpu_wait_ms:.3g} ms for the GPU after it); the output "
            "was read before the call's work was done"))
    return Guard("cuda-graph", "fail", (
        f"right when captured on its own inputs, wrong when the graph captured on "
        f"{captured.where} is replayed on the inputs of {call.where}"
        f"{f' ({changed})' if changed else ''}: {problem}; it keeps something of the "
        "captured call (a length, a shape or a schedule read on the host), and a server "
        "replays one graph with new metadata every step"))


def revalidate(op: Op, workload: Workload, observed: list[tuple[int, int, str, Observed]],
               memo: Memo = NO_MEMO) -> list[Guard]:
    """Outputs of timed calls, read at calls the child could not predict: each checked
    against its own inputs' reference. (input seed, call number, distribution, reading)."""
    problems: list[Guard] = []
    for seed, call, distribution, reading in observed:
        expected = expect(op, workload, seed, distribution, memo=memo)
        outcome = judge_output(op, expected, reading, workload.device)
        where = f"{workload.name}, timed call #{call + 1}"
        for name, problem in outcome.items():
            if problem is not None:
                guard = INPUTS_UNCHANGED if name == INPUTS_UNCHANGED else TIMED_OUTPUTS
                problems.append(Guard(guard, "fail", f"{problem} ({where})"))
        if problems:
            break
    return problems
