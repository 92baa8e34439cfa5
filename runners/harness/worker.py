"""A child: one side of an evaluation, in a process of its own.

    python -m runners.harness.worker REQUEST_FD REPLY_FD   (started inside its jail, runners.jail)

The judge starts one per side (the baseline twice, the candidate once). In order:
1. read the setup from the judge's private pipe;
2. set OS limits, pin threads, build the clock and the CUDA timing pieces;
3. install the audit hook, then import the candidate (or the baseline file);
4. answer requests until the judge closes the pipe.

It makes no input and sends no output: the judge writes every call's inputs into memory
the child maps (runners.harness.arena) while the child is stopped, and reads the output
from the child's memory, from outside, before the child runs again. Over the channel it
says only where the output is and how long the call took; the judge bounds that time
by its own clock. It judges nothing: no reference ever exists in it. Its stdout is only
a log.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from runners.harness import arena, device_memory, imports, sandbox, timing, wire
from runners.harness.candidate import CandidateError, load_candidate, one_line
from runners.harness.configuration import ConfigurationWatch
from runners.ops import get_op


def _launch_counter(dsl_name: str) -> timing.LaunchCounter:
    if dsl_name == "torch":
        return timing.no_counter
    try:
        from runners.harness import dsl
    except ImportError:  # the DSL module is not there yet: launches are not counted
        return timing.no_counter
    return lambda: dsl.launch_counter(dsl_name)


def _kind(error: BaseException) -> str:
    """How the judge should read a failure: it picks the guard that reports it."""
    if isinstance(error, timing.CaptureError):
        return "capture"
    out_of_memory = getattr(torch, "OutOfMemoryError", MemoryError)
    text = str(error).lower()
    if isinstance(error, (MemoryError, out_of_memory)) or (
            isinstance(error, RuntimeError)
            and ("can't allocate memory" in text or "out of memory" in text)):
        return "memory"
    return "raised"


def output_facts(output: Any) -> dict[str, Any]:
    """What the judge needs to find an output in this process's memory and read it."""
    kind = type(output)
    facts: dict[str, Any] = {"type": f"{kind.__module__}.{kind.__qualname__}",
                             "tensor": isinstance(output, torch.Tensor),
                             "plain_tensor": kind is torch.Tensor}
    if kind is torch.Tensor:
        facts.update(device=output.device.type, dtype=wire.dtype_name(output.dtype),
                     shape=list(output.shape), nbytes=output.numel() * output.element_size(),
                     layout=str(output.layout))
        if output.layout == torch.strided:
            facts.update(address=output.data_ptr(), strides=list(output.stride()))
    return facts


class Worker:
    def __init__(self, device: str, runner: timing.Runner, box: sandbox.Sandbox | None,
                 integrity: timing.Integrity, op_name: str,
                 inputs: arena.Mapped | device_memory.DeviceInputs) -> None:
        self.device = device
        self.runner = runner
        self.box = box
        self.integrity = integrity
        self.op = get_op(op_name)
        self.inputs = inputs
        self.threads_at_start = threading.active_count()
        # Kernels of other ops the decode step dispatches in this process (a stage of
        # runners.harness.compound), loaded with the candidate; empty for an evaluation.
        self.others: dict[str, Any] = {}
        # Read before any candidate code runs: the worker is built before the import.
        self.configuration = ConfigurationWatch(self.op, device)

    def answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        try:
            header, tensors = getattr(self, f"_{request['do']}")(request)
            header = {"ok": True, **header}
        except BaseException as error:  # SystemExit too: a candidate may not end the child
            message = str(error) if isinstance(error, timing.CaptureError) else one_line(error)
            header, tensors = {"ok": False, "kind": _kind(error), "error": message}, {}
        # Reading the configuration takes about half a millisecond: a change made
        # during a timed call is reported at the next request of another kind instead.
        watchdog = self.watchdog(configuration=request.get("do") != "run")
        return {**header, **watchdog, "seq": request.get("seq")}, tensors

    def watchdog(self, *, configuration: bool = True) -> dict[str, Any]:
        """What the judge should know whatever it asked: refused actions, replaced timing
        functions, threads still alive that the candidate started (work finishing after
        forward returned, off the clock), and settings changed since before the import.
        Evidence, read in the candidate's own process: the judge's boundary is outside."""
        refused = self.box.new_refusals() if self.box is not None else []
        found = {"refused": refused, "replaced": self.integrity.replaced(),
                 "extra_threads": threading.active_count() - self.threads_at_start}
        if configuration:
            found["config_changed"] = self.configuration.changes()
        return found

    def _prepare(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The slot's arguments, on the inputs the judge wrote (on CUDA, captured)."""
        slot = request["slot"]
        self._drop({"slots": [slot]})
        entries = [arena.Entry.from_dict(entry) for entry in request["layout"]]
        found: dict[str, Any] = {}
        if self.device == "cuda":
            # Where each call's output is copied for the judge to read, once the call is
            # timed (a graph's output lives in its own pool, which cannot be shared).
            staging, fd = device_memory.Shared.create(max(1, int(request["output_bytes"])))
            self.runner.staging[slot] = staging
            found.update(staging_fd=fd, staging_size=staging.size)
        launches = self.runner.prepare(slot, self.inputs.arguments(entries))
        return {"launches": launches, "torch_ops": self.runner.last_torch_ops, **found}, {}

    def _run(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """One call per slot named (a batch: request["slots"]), their total time, and
        where each call's output is."""
        slots = request["slots"] if "slots" in request else [request["slot"]]
        elapsed_ms, launches = self.runner.run(slots, poison=request.get("poison", True) is not False)
        outputs = []
        for slot, output in zip(self.runner.last_slots, self.runner.last_outputs, strict=True):
            facts = output_facts(output)
            if self.device == "cuda" and "strides" in facts:
                # The judge reads the staged copy, which is contiguous.
                facts.update(slot=slot, strides=list(torch.empty(facts["shape"], device="meta").stride()))
            outputs.append(facts)
        return {"ms": elapsed_ms, "launches": launches, "torch_ops": self.runner.last_torch_ops,
                "outputs": outputs}, {}

    def _e2e_prepare(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Builds the decode step for one end-to-end point with this process's forward
        (the candidate's, or the kept kernel's in a baseline process) dispatched in, and
        runs it once: on CUDA a replay of the graph build_step captured, on the CPU an
        eager step, so a kernel that fails only inside the step fails here. Afterwards
        `run` with the same slot times one step, on the clock that times forward calls."""
        from runners.e2e.step import build_step  # only when asked: most runs never need it

        slot = request["slot"]
        self._drop({"slots": [slot]})
        step = build_step(self.op.name, self.runner.forward, device=self.device,
                          context_length=request["context_length"], batch=request["batch"],
                          seed=request["seed"], others=self.others)
        output = step()
        found: dict[str, Any] = {}
        if self.device == "cuda":
            torch.cuda.synchronize()
            if type(output) is torch.Tensor:
                # Where each timed step's output is copied for the judge, who compares it
                # with the kept kernel's step.
                staging, fd = device_memory.Shared.create(max(1, output.numel() * output.element_size()))
                self.runner.staging[slot] = staging
                found.update(staging_fd=fd, staging_size=staging.size)
        self.runner.load_step(slot, step, output)
        return found, {}

    def _drop(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        for slot in request["slots"]:
            self.runner.drop(slot)
        return {}, {}


class LocalWorker:
    """The worker's own handlers, called in this process: for trusted code only.

    The tests of the shipped kernels check every point of every SPACE; a process per
    point would cost a second each for nothing, since that code is the project's own.
    Candidates are never run this way. It maps its own arena, as a child maps the judge's.
    """

    role = "candidate"
    label = "candidate (in this process)"

    def __init__(self, op_name: str, device: str, path: Path, dsl: str = "torch",
                 capacity: int = 2**26) -> None:
        runner = timing.make_runner(device, _launch_counter(dsl))
        runner.forward = load_candidate(path).forward
        self.arena = arena.Arena(capacity)
        self.worker = Worker(device, runner, None, timing.Integrity(), op_name,
                             arena.Mapped(self.arena.fd, self.arena.capacity))
        self._seq = 0

    def request(self, do: str, during: str, **fields: Any) -> Any:
        from runners.harness.children import CallFailed, Reply

        self._seq += 1
        header, _ = self.worker.answer({"do": do, "seq": self._seq, **fields})
        if not header["ok"]:
            raise CallFailed(header["kind"], header["error"])
        return Reply(header, {}, math.nan)

    def read_output(self, facts: dict[str, Any], max_bytes: int) -> torch.Tensor | None:
        outputs = self.worker.runner.last_outputs
        output = outputs[-1] if outputs else None
        if type(output) is not torch.Tensor or output.numel() * output.element_size() > max_bytes:
            return None
        # The judge's side of a real child holds a copy, never the live tensor.
        return output.detach().clone()

    def read_inputs(self, entries: list[arena.Entry]) -> dict[str, torch.Tensor]:
        arguments = self.worker.inputs.arguments(entries)
        return {entry.name: value.clone() for entry, value in zip(entries, arguments, strict=True)
                if entry.is_tensor}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv if argv is None else argv
    requests, replies = int(args[1]), int(args[2])
    faulthandler.enable()  # a crash leaves a Python traceback in the log
    setup, _ = wire.read_message(requests)
    device = setup["device"]

    # The jail set the CPU time, file size and process count already, and let torch's
    # import use every core of the start; from here on the child keeps to its own.
    if setup.get("cpus"):
        # Named by its own process id, which is how the jail's supervisor knows the harness
        # narrowed it, and lets no later call widen it again (runners.jail.supervisor).
        os.sched_setaffinity(os.getpid(), setup["cpus"])
    if device == "cpu":
        sandbox.limit_memory(setup["memory_bytes"])
    torch.set_num_threads(setup["threads"])
    inputs: arena.Mapped | device_memory.DeviceInputs
    if device == "cuda":
        torch.cuda.init()
        torch.cuda.set_per_process_memory_fraction(setup["gpu_fraction"])
        inputs = device_memory.DeviceInputs(setup["input_capacity"])
        where = {"device_inputs_fd": inputs.fd, "device_inputs_size": inputs.memory.size}
    else:
        inputs = arena.Mapped(setup["arena_fd"], setup["input_capacity"])
        where = {"arena_address": inputs.address}
    runner = timing.make_runner(device, _launch_counter(setup["dsl"]))
    integrity = timing.Integrity()
    timing.watch_measurement(integrity, device)
    for module in (sys.modules[__name__], wire, sandbox):
        integrity.watch_module(module)
    sandbox.preload(setup["dsl"])
    box = sandbox.Sandbox(Path.cwd(), sandbox.allowed_programs(setup["dsl"]))
    worker = Worker(device, runner, box, integrity, setup["op"], inputs)
    wire.write_message(replies, {"ok": True, "stage": "started", "threads": torch.get_num_threads(),
                                 "cache": runner.describe(), **where})

    # The judge files what the jail refused so far as the harness's own start; the
    # candidate's code runs only once it has (else a refusal made while importing it
    # could be read as the start's, and forgiven).
    go, _ = wire.read_message(requests)
    if go.get("do") != "load":
        return 0
    box.install()
    if setup.get("lib"):
        # The shared code as the judge read and hashed it, never the project's copy.
        imports.install(Path(setup["lib"]))
    try:
        candidate = load_candidate(Path(setup["candidate"]))
        worker.others = {op: load_candidate(Path(path)).forward
                         for op, path in (setup.get("others") or {}).items()}
    except CandidateError as error:
        wire.write_message(replies, {"ok": False, "kind": "load", "error": str(error),
                                     **worker.watchdog()})
        return 0
    runner.forward = candidate.forward
    wire.write_message(replies, {"ok": True, "stage": "loaded", **worker.watchdog()})

    while True:
        try:
            request, _ = wire.read_message(requests)
        except wire.ChannelClosed:
            return 0
        header, tensors = worker.answer(request)
        wire.write_message(replies, header, tensors)


if __name__ == "__main__":
    sys.exit(main())
