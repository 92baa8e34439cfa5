"""A child: one side of an evaluation, in a process of its own.

    python -m runners.harness.worker REQUEST_FD REPLY_FD   (started through launch.py)

The judge starts one per side (the baseline twice, the candidate once). In order:
1. read the setup from the judge's private pipe;
2. set OS limits, pin threads, build the clock and the CUDA timing pieces;
3. install the audit hook, then import the candidate (or the baseline file);
4. answer requests until the judge closes the pipe.

It generates inputs itself from the seeds the judge sends, so only small messages cross
for timing, and it answers only what is asked: times, and on request the last call's
output with a fingerprint of that call's inputs. It judges nothing: the judge checks
every output against a reference the child never sees. Its stdout is only a log.
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

from runners.harness import sandbox, timing, wire
from runners.harness.candidate import CandidateError, load_candidate, one_line
from runners.harness.children import CallFailed, Reply
from runners.harness.configuration import ConfigurationWatch
from runners.harness.digest import describe_change, input_digest
from runners.ops import Workload, get_op


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


def _output_facts(output: Any) -> dict[str, Any]:
    kind = type(output)
    facts: dict[str, Any] = {"type": f"{kind.__module__}.{kind.__qualname__}",
                             "tensor": isinstance(output, torch.Tensor),
                             "plain_tensor": kind is torch.Tensor}
    if kind is torch.Tensor:
        facts.update(device=output.device.type, dtype=wire.dtype_name(output.dtype),
                     shape=list(output.shape), nbytes=output.numel() * output.element_size(),
                     layout=str(output.layout))
    return facts


class Worker:
    def __init__(self, device: str, runner: timing.Runner, box: sandbox.Sandbox | None,
                 integrity: timing.Integrity, op_name: str) -> None:
        self.device = device
        self.runner = runner
        self.box = box
        self.integrity = integrity
        self.op = get_op(op_name)
        self.inputs: dict[str, dict[str, Any]] = {}
        self.pristine: dict[str, dict[str, Any]] = {}
        self.threads_at_start = threading.active_count()
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
        # during a timed call is reported at the next load or fetch instead.
        watchdog = self.watchdog(configuration=request.get("do") != "run")
        return {**header, **watchdog, "seq": request.get("seq")}, tensors

    def watchdog(self, *, configuration: bool = True) -> dict[str, Any]:
        """What the judge should know whatever it asked: refused actions, replaced timing
        functions, threads still alive that the candidate started (work finishing after
        forward returned, off the clock), and settings changed since before the import."""
        refused = self.box.new_refusals() if self.box is not None else []
        found = {"refused": refused, "replaced": self.integrity.replaced(),
                 "extra_threads": threading.active_count() - self.threads_at_start}
        if configuration:
            found["config_changed"] = self.configuration.changes()
        return found

    def _load(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        slot = request["slot"]
        self._drop({"slots": [slot]})
        workload = Workload(**request["workload"])
        inputs = self.op.make_inputs(workload, request["seed"], request["distribution"])
        self.inputs[slot] = inputs
        self.pristine[slot] = {key: value.clone() if isinstance(value, torch.Tensor) else value
                               for key, value in inputs.items()}
        launches = self.runner.load(slot, tuple(inputs.values()))
        return {"launches": launches, "torch_ops": self.runner.last_torch_ops}, {}

    def _run(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        elapsed_ms, launches = self.runner.run(request["slot"])
        return {"ms": elapsed_ms, "launches": launches, "torch_ops": self.runner.last_torch_ops}, {}

    def _fetch(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        slot = self.runner.last_slot
        if slot is None:
            raise RuntimeError("there is no output of a last call to fetch")
        output = self.runner.last_output
        facts = _output_facts(output)
        tensors = {}
        # Larger than any right answer: say so instead of sending it.
        if facts["plain_tensor"] and facts["nbytes"] <= request["max_bytes"]:
            tensors["output"] = output
        inputs = self.inputs[slot]
        header = {"output": facts, "inputs_digest": input_digest(inputs, request["key"]),
                  "inputs_changed": describe_change(inputs, self.pristine[slot])}
        return header, tensors

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
                          seed=request["seed"])
        output = step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.runner.load_step(slot, step, output)
        return {}, {}

    def _drop(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        for slot in request["slots"]:
            self.runner.drop(slot)
            self.inputs.pop(slot, None)
            self.pristine.pop(slot, None)
        return {}, {}


class LocalWorker:
    """The worker's own handlers, called in this process: for trusted code only.

    The tests of the shipped kernels check every point of every SPACE; a process per
    point would cost a second each for nothing, since that code is the project's own.
    Candidates are never run this way.
    """

    def __init__(self, op_name: str, device: str, path: Path, dsl: str = "torch") -> None:
        runner = timing.make_runner(device, _launch_counter(dsl))
        runner.forward = load_candidate(path).forward
        self.worker = Worker(device, runner, None, timing.Integrity(), op_name)
        self._seq = 0

    def request(self, do: str, during: str, *, max_bytes: int = 0, **fields: Any) -> Reply:
        self._seq += 1
        header, tensors = self.worker.answer({"do": do, "seq": self._seq, "max_bytes": max_bytes,
                                              **fields})
        if not header["ok"]:
            raise CallFailed(header["kind"], header["error"])
        # The judge's side of a real channel would hold a copy, never the live tensor.
        return Reply(header, {name: tensor.detach().clone() for name, tensor in tensors.items()},
                     math.nan)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv if argv is None else argv
    requests, replies = int(args[1]), int(args[2])
    faulthandler.enable()  # a crash leaves a Python traceback in the log
    setup, _ = wire.read_message(requests)
    device = setup["device"]

    sandbox.limit_resources(cpu_seconds=setup["cpu_seconds"], file_bytes=setup["file_bytes"],
                            memory_bytes=setup["memory_bytes"] if device == "cpu" else None)
    if setup.get("cpus") and hasattr(os, "sched_setaffinity"):
        # Before the configuration watch's first reading: the pinning is the harness's.
        os.sched_setaffinity(0, setup["cpus"])
    torch.set_num_threads(setup["threads"])
    if device == "cuda":
        torch.cuda.init()
        torch.cuda.set_per_process_memory_fraction(setup["gpu_fraction"])
    runner = timing.make_runner(device, _launch_counter(setup["dsl"]))
    integrity = timing.Integrity()
    timing.watch_measurement(integrity, device)
    for module in (sys.modules[__name__], wire, sandbox):
        integrity.watch_module(module)
    sandbox.preload(setup["dsl"])
    box = sandbox.Sandbox(Path.cwd(), sandbox.allowed_programs(setup["dsl"]))
    worker = Worker(device, runner, box, integrity, setup["op"])
    wire.write_message(replies, {"ok": True, "stage": "started", "threads": torch.get_num_threads(),
                                 "cache": runner.describe()})

    box.install()
    try:
        candidate = load_candidate(Path(setup["candidate"]))
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
