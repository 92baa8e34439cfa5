"""One rank of a collective op's evaluation, in a process of its own.

    python -m runners.harness.rank_worker REQUEST_FD REPLY_FD

The judge (runners.harness.collective) starts world_size of these per side, the
baseline and the candidate each in a jail of its own shared by its ranks (runners.jail,
`ranks` = world_size; runners.jail.group starts them). Every rank:
1. reads the setup from the judge's private pipe;
2. sets OS limits and threads, joins the side's process group (gloo on the CPU over the
   jail's loopback, NCCL on CUDA), and says it started;
3. on the judge's word, takes note of the environment (the C library's, which NCCL
   reads), installs the audit hook and the shared code the judge read, imports the
   candidate and calls its `setup(comm)` if it has one;
4. answers requests until the judge closes the pipe: one forward call per request, the
   judge's request to every rank being what lines the ranks up (the harness has no
   process group of its own, so the jail's network carries only the side's);
5. for the end-to-end check, builds the tensor-parallel decode step
   (runners.e2e.tensor_parallel) from the shard of its weights the judge sends it, with
   the forward as the all-reduce between its layers; a request then runs one call of
   the step (`run: "step"`) where it would run one forward call.

It is given its own rank's tensor only, never its peers' and never the seed: a rank can
have the sum only by moving data. Around every forward it counts the collectives of
every process group c10d knows, by the groups' own sequence numbers and by
torch.distributed's functions (which name them). That count is the rank's own word,
from a process that runs candidate code (which can reach the counter through its own
frames): the judge decides moves-data from the jail's network counters, read from
outside, and uses the count to name what ran. It does not time anything either: the
judge's clock times the group from outside.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import os
import resource
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from runners.e2e.tensor_parallel import TensorParallelDecode, TensorParallelShape
from runners.harness import imports, sandbox, wire
from runners.harness.candidate import CandidateError, load_candidate, one_line

# torch.distributed's functions that run a collective or point-to-point transfer.
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier",
)


@dataclass
class Comm:
    """What a rank's forward is given beside its tensor."""

    rank: int
    world_size: int
    group: Any  # the side's process group (torch.distributed.ProcessGroup)
    device: torch.device
    # A folder every rank of the group may write: where CPU ranks share memory.
    shared_dir: str


class CollectiveCounter:
    """Collectives run while counting: by name through torch.distributed's functions,
    and in total by the sequence number of every group c10d has made (the side's, and
    any made later by whatever name: c10d's registry holds them all)."""

    def __init__(self) -> None:
        self.named: Counter[str] = Counter()
        self.counting = False
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, function in self.originals.items():
            setattr(dist, name, self._counted(name, function))

    def _counted(self, name: str, function: Any) -> Any:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.named[name] += 1
            return function(*args, **kwargs)
        return counted

    @staticmethod
    def _sequence() -> dict[Any, int]:
        numbers = {}
        for group in list(distributed_c10d._world.pg_map):
            try:
                numbers[group] = int(group._get_sequence_number_for_group())
            except RuntimeError:  # a group this rank is not in
                numbers[group] = 0
        return numbers

    def around(self, call: Any) -> tuple[Any, dict[str, Any]]:
        """Runs call() and says what collectives it ran."""
        self.named.clear()
        before = self._sequence()
        self.counting = True
        try:
            result = call()
        finally:
            self.counting = False
        after = self._sequence()
        moved = sum(max(0, number - before.get(group, 0)) for group, number in after.items())
        return result, {"total": max(moved, sum(self.named.values())), "named": dict(self.named)}


def c_environment() -> dict[str, str]:
    """The process's environment as the C library holds it (what NCCL reads): os.putenv
    changes it without os.environ knowing."""
    libc = ctypes.CDLL(None)
    entries = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
    found = {}
    index = 0
    while entries[index] is not None:
        name, _, value = entries[index].decode(errors="replace").partition("=")
        found[name] = value
        index += 1
    return found


def environment() -> dict[str, dict[str, str]]:
    """Both views of the environment: Python's and the C library's, which can differ."""
    return {"os.environ": dict(os.environ), "C environment": c_environment()}


def environment_changes(before: dict[str, dict[str, str]]) -> list[str]:
    now = environment()
    changed = []
    for view, was in before.items():
        is_now = now[view]
        for name in sorted(set(was) | set(is_now)):
            if was.get(name) != is_now.get(name):
                changed.append(f"{name}: {was.get(name, '(unset)')} → "
                               f"{is_now.get(name, '(unset)')} (in the {view})")
    return changed


class Rank:
    def __init__(self, requests: int, replies: int) -> None:
        self.requests, self.replies = requests, replies
        self.inputs: dict[int, torch.Tensor] = {}
        # A timing round's own inputs, one per timed call, and what those calls returned:
        # the judge may ask for the outputs after any round, and cannot be told apart
        # from one it does not ask after.
        self.round_inputs: list[torch.Tensor] = []
        self.round_outputs: dict[int, Any] = {}
        self.step: TensorParallelDecode | None = None

    def reply(self, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        header = {**header, "refused": self.sandbox.new_refusals() if hasattr(self, "sandbox") else []}
        wire.write_message(self.replies, header, tensors)

    def start(self) -> None:
        setup, _ = wire.read_message(self.requests)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (setup["file_bytes"], setup["file_bytes"]))
        resource.setrlimit(resource.RLIMIT_CPU, (setup["cpu_seconds"], setup["cpu_seconds"] + 5))
        torch.set_num_threads(setup["threads"])
        self.rank, world = setup["rank"], setup["world_size"]
        cuda = setup["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(self.rank)
        device = torch.device("cuda", self.rank) if cuda else torch.device("cpu")
        store = dist.FileStore(setup["store"], world)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank,
                                world_size=world, device_id=device if cuda else None)
        self.comm = Comm(rank=self.rank, world_size=world, group=dist.group.WORLD,
                         device=device, shared_dir=setup["shared_dir"])
        self.device = device
        self.counter = CollectiveCounter()
        if not cuda:
            sandbox.limit_memory(setup["memory_bytes"])
        # What the jail refused so far was the harness's own start: the judge tells it
        # apart from the candidate's by this reply, and only then asks for the import.
        self.reply({"ok": True, "started": True})
        try:
            request, _ = wire.read_message(self.requests)
        except wire.ChannelClosed:
            return
        if request.get("do") != "load":
            self.reply({"ok": False, "error": f"expected the load request, not {request.get('do')!r}"})
            return
        self.environment = environment()
        self.sandbox = sandbox.Sandbox(setup["shared_dir"], frozenset())
        self.sandbox.install()
        if setup.get("lib"):
            # The shared code as the judge read and hashed it, never the project's copy.
            imports.install(Path(setup["lib"]))
        try:
            candidate = load_candidate(Path(setup["candidate"]))
            self.forward = candidate.forward
            prepare = getattr(candidate.module, "setup", None)
            if callable(prepare):
                # Allowed its collectives: a custom all-reduce swaps its buffers'
                # handles with its peers once, as vLLM's does when it is built.
                prepare(self.comm)
        except CandidateError as error:
            self.reply({"ok": False, "error": str(error)})
            return
        except BaseException as error:
            self.reply({"ok": False, "error": f"setup(comm) raised {one_line(error)}"})
            return
        self.reply({"ok": True, "environment": environment_changes(self.environment)})
        self.serve()

    def call(self, x: torch.Tensor, run: str = "forward") -> tuple[Any, dict[str, Any]]:
        """One forward call on x, or (`run` "step") one call of the decode step from the
        token batch x, with the collectives it ran."""
        def once() -> Any:
            if run == "forward":
                output = self.forward(x, self.comm)
            elif run == "step" and self.step is not None:
                output = self.step(x)
            else:
                raise RuntimeError(f"no {run!r} to run (forward, or step once it is built)")
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return output
        return self.counter.around(once)

    def serve(self) -> None:
        while True:
            try:
                request, tensors = wire.read_message(self.requests, max_bytes=1 << 40)
            except wire.ChannelClosed:
                return
            do, slot = request.get("do"), request.get("slot")
            if do == "prepare":
                self.inputs[slot] = tensors["x"].to(self.device)
                self.reply({"ok": True})
                continue
            if do == "prepare_round":
                # Each call of the round its own storage: none is a tensor seen before.
                self.round_inputs = [row.clone() for row in tensors["x"].to(self.device)]
                self.round_outputs = {}
                self.reply({"ok": True})
                continue
            if do == "outputs":
                self.reply({"ok": True, "count": len(self.round_outputs)},
                           {f"output_{index}": output.detach().cpu()
                            for index, output in self.round_outputs.items()
                            if isinstance(output, torch.Tensor)})
                continue
            if do == "drop":
                self.inputs.pop(slot, None)
                self.reply({"ok": True})
                continue
            if do == "build_step":
                self.build_step(request, tensors)
                continue
            try:
                if do == "check":
                    x = self.inputs[slot]
                    output, collectives = self.call(x, request.get("run", "forward"))
                    self.reply({"ok": True, "collectives": collectives,
                                "environment": environment_changes(self.environment),
                                "is_tensor": isinstance(output, torch.Tensor)},
                               {"output": output.detach().cpu(), "x_after": x.cpu()}
                               if isinstance(output, torch.Tensor) else {"x_after": x.cpu()})
                elif do == "time":
                    # One timed call of the round: its own input, its output kept for the
                    # judge, who may read the round's outputs once it is over.
                    index = request.get("index")
                    output, collectives = self.call(self.round_inputs[index],
                                                    request.get("run", "forward"))
                    self.round_outputs[index] = output
                    self.reply({"ok": True, "collectives": collectives,
                                "environment": environment_changes(self.environment)})
                else:
                    self.reply({"ok": False, "error": f"unknown request {do!r}"})
            except BaseException as error:
                self.reply({"ok": False, "error": f"forward raised {one_line(error)}"})

    def build_step(self, request: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """The decode step from this rank's shard alone: every all-reduce between its
        layers is the forward loaded (the candidate's, or the baseline's)."""
        try:
            self.step = TensorParallelDecode(
                TensorParallelShape(**request["shape"]),
                {name: tensor.to(self.device) for name, tensor in tensors.items()},
                world_size=self.comm.world_size,
                all_reduce=lambda partial: self.forward(partial, self.comm))
        except (KeyError, TypeError, ValueError) as error:
            self.reply({"ok": False, "error": f"the decode step could not be built: {one_line(error)}"})
            return
        self.reply({"ok": True})


def main() -> None:
    faulthandler.enable()
    requests, replies = int(sys.argv[1]), int(sys.argv[2])
    Rank(requests, replies).start()
    os._exit(0)  # a process group's threads must not hold the exit


if __name__ == "__main__":
    main()
