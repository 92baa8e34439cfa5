"""Kernels compound: the decode loop's tokens per second with every kept kernel of a
hardware class stacked in, one stage per keep or undo, against the machine's roofline.

    python -m runners.harness compound STAGES.json --device cuda --json

STAGES.json names the loop (the indexer op it serves; rmsnorm serves every loop) and
its stages, oldest first: the shipped baselines, then the kernels that served after each
keep or undo. Paths are relative to the file's folder:

    {"loop": "dsa_indexer_topk_paged_fp8",
     "stages": [{"label": "shipped baselines",
                 "kernels": {"rmsnorm": "0/rmsnorm.py", "dsa_indexer_topk_paged_fp8": "0/indexer.py"}},
                {"label": "keep of #12-3 (rows_triton)", "kernels": {...}}]}

Every stage is a child of its own, started and jailed like a candidate's process (a
kept kernel passed four eyes, not a jail), and the first stage runs twice, the second
process the A/A control that measures this run's noise floor. The judge times the
stages' loops in interleaved rounds through its own timing loop (measure.measure_step),
so every stage meets the same machine state, and each stage's change over the one
before is a comparison with a confidence interval, significant only beyond that floor.
Nothing here is a verdict: the kernels were judged when they were kept.

The roofline is the loop's own: what it must read per step (weights, the indexer's keys
over every sequence's context, the attention's selected cache rows) at the datasheet
bandwidth, or its arithmetic at the datasheet peak, whichever takes longer. Decode is
memory-bound, so the first decides. On the CPU the peaks are generous bounds, not a
roofline (skills/hardware/peaks.toml): no roofline is given there.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runners.e2e import model as e2e_model
from runners.e2e.step import DISPATCHED_OPS, PAGED_OPS
from runners.harness import arena as inputs_arena
from runners.harness import dsl as dsls
from runners.harness import imports
from runners.harness.children import CallFailed, Child, ChildFailure, Limits, thread_count
from runners.harness.machine import machine_state
from runners.harness.measure import measure_step
from runners.harness.observe import GpuProbe
from runners.harness.roofline import load_peaks
from runners.harness.seeds import derive_seed, draw_secret_seed
from runners.harness.stats import MIN_NOISE_FLOOR, compare, median_ci, noise_floors
from runners.ops import get_op

# The loops a waterfall can measure: each serves one indexer op, and rmsnorm in all.
LOOPS = tuple(op for op in DISPATCHED_OPS if op != "rmsnorm")
# The serving loop: DeepSeek-V3.2's indexer on a paged e4m3 cache. A hardware class
# whose keeps touch only rmsnorm is measured on this loop.
SERVING_LOOP = "dsa_indexer_topk_paged_fp8"
CONTROL = "control"
# One point per device: a long context (a waterfall is about serving long prompts) that
# still leaves room on one H200 for a loop per stage, each holding its own caches.
CONTEXT_LENGTH = {"cpu": 8192, "cuda": 65536}
CPU_BUDGET_S = 2.0
# Every stage's process gets an equal share of the device, never more than an
# evaluation's child (runners.harness.children.Limits).
GPU_SHARE = 0.9


class CompoundError(Exception):
    """The stages could not be measured: a bad stages file, or a stage that failed."""


@dataclass(frozen=True)
class Stage:
    label: str
    kernels: dict[str, Path]  # op -> kernel file, for the loop's ops


def loop_ops(loop: str) -> tuple[str, str]:
    if loop not in LOOPS:
        raise CompoundError(f"no decode loop serves {loop!r} (loops: {', '.join(LOOPS)})")
    return ("rmsnorm", loop)


def read_stages(path: Path) -> tuple[str, list[Stage]]:
    """The loop and its stages from a stages file; CompoundError names what is wrong."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise CompoundError(f"cannot read {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CompoundError(f"{path} is not JSON: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("stages"), list):
        raise CompoundError(f"{path} holds no \"stages\" list")
    loop = document.get("loop")
    wanted = loop_ops(str(loop))
    stages = []
    for index, entry in enumerate(document["stages"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("kernels"), dict):
            raise CompoundError(f"stage {index} has no \"kernels\" object")
        kernels = entry["kernels"]
        if set(kernels) != set(wanted):
            raise CompoundError(f"stage {index} names kernels for {', '.join(sorted(map(str, kernels)))}; "
                                f"the {loop} loop needs exactly {', '.join(wanted)}")
        files = {}
        for op, name in kernels.items():
            file = (Path(path).parent / str(name)).resolve()
            if not file.is_file():
                raise CompoundError(f"stage {index}: {op}'s kernel {name} is not a file")
            files[op] = file
        stages.append(Stage(label=str(entry.get("label") or f"stage {index}")[:200], kernels=files))
    if not stages:
        raise CompoundError(f"{path} has no stages")
    return loop, stages


def point(loop: str, device: str) -> tuple[int, int]:
    """The (context length, batch) the loop runs at on `device`."""
    return CONTEXT_LENGTH[device], max(get_op(loop).default_batch_sizes(device))


def steps_per_call(loop: str, device: str) -> int:
    declared = get_op(loop).decode_steps
    return declared[device] if declared else 1


def roofline_tokens_per_s(loop: str, device: str, hardware: str | None) -> float | None:
    """The most decode tokens a second the loop could make on `hardware` (a peaks.toml
    key), from what one step must read and compute; None without a roofline there."""
    peaks = load_peaks().get(hardware or "")
    if not peaks or not peaks.get("report_fraction"):
        return None
    context_length, batch = point(loop, device)
    read, flops = step_cost(loop, device, context_length, batch)
    seconds = max(read / (float(peaks["hbm_gbps"]) * 1e9), flops / (float(peaks["bf16_tflops"]) * 1e12))
    return batch / seconds


def step_cost(loop: str, device: str, context_length: int, batch: int) -> tuple[int, int]:
    """(bytes read, flops) of one decode step of the synthetic model at this point, the
    least any implementation must do: every weight once (the MoE runs densely), every
    indexer key of every sequence's context, the selected cache rows."""
    s = e2e_model.SHAPES[device]
    weights = e2e_model.layer_weights_meta(s).values()
    weight_bytes = sum(tensor.numel() * tensor.element_size() for tensor in weights)
    weight_flops = 2 * batch * sum(tensor.numel() for tensor in weights if tensor.dim() > 1)
    fp8 = loop.endswith("_fp8")
    key_bytes = s.index_dim * (1 if fp8 else 2) + (4 if fp8 else 0)
    if loop in PAGED_OPS:
        # The paged loop's sequences have mixed lengths; together they hold `tokens`.
        tokens = get_op(loop).workload(device, context_length, batch, "mixed", 1).params["tokens"]
        keys_read = tokens
    else:
        tokens = batch * context_length  # one key matrix, scored against every query
        keys_read = context_length
    index_flops = 2 * s.index_heads * s.index_dim * tokens
    attention_bytes = batch * s.topk * s.cache_width * 2
    attention_flops = 2 * 2 * batch * s.heads * s.topk * s.cache_width
    layer_bytes = weight_bytes + keys_read * key_bytes + attention_bytes
    layer_flops = weight_flops + index_flops + attention_flops
    return s.layers * layer_bytes, s.layers * layer_flops


def stage_dsl(files: list[Path]) -> tuple[str, list[str]]:
    """The DSL the stage's process is set up for (its compilers, Triton's preload) and
    every DSL its kernels launch, by reading their sources (never their names)."""
    found = [dsls.written_in(file.read_text(encoding="utf-8", errors="replace")) for file in files]
    for dsl in ("triton", "cute"):
        if dsl in found:
            return dsl, found
    return "torch", found


def measure(
    loop: str,
    stages: list[Stage],
    *,
    device: str,
    budget_s: float = 10.0,
    seed: int | None = None,
    hardware: str | None = None,
    limits: Limits | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Times the loop with each stage's kernels dispatched; the waterfall's JSON."""
    say = progress or (lambda message: None)
    started = time.monotonic()
    wanted = loop_ops(loop)
    seed = draw_secret_seed() if seed is None else seed
    context_length, batch = point(loop, device)
    steps = steps_per_call(loop, device)
    roles = [f"stage {index}" for index in range(len(stages))]
    sides = [(roles[0], stages[0]), (CONTROL, stages[0]), *zip(roles[1:], stages[1:])]
    dsls_of = {role: stage_dsl([stage.kernels[op] for op in wanted]) for role, stage in sides}
    meaningful = all(dsls.timings_meaningful(dsl, device) for _, found in dsls_of.values() for dsl in found)
    limits = limits or Limits(gpu_fraction=min(Limits.gpu_fraction, GPU_SHARE / len(sides)))
    deadline = started + limits.total_s
    capacity = 2**20  # the loop makes its own inputs: the arena only has to exist
    arena = inputs_arena.Arena(capacity) if device == "cpu" else None
    gpu = GpuProbe() if device == "cuda" else None
    threads = thread_count()
    children: dict[str, Child] = {}
    served: list[imports.Served] = []
    try:
        for role, stage in sides:
            dsl, found = dsls_of[role]
            try:
                shared = imports.resolve_files(list(stage.kernels.values()))
            except imports.ImportRefused as refusal:
                raise CompoundError(f"stage {stage.label!r}: {refusal}") from None
            setup = {
                "op": loop, "device": device, "dsl": dsl, "candidate": str(stage.kernels[loop]),
                "others": {op: str(stage.kernels[op]) for op in wanted if op != loop},
                "threads": threads, "cpus": None, "start_cpus": None,
                "cpu_seconds": math.ceil(limits.total_s * threads) + 10,
                "file_bytes": limits.file_bytes, "memory_bytes": limits.memory_bytes,
                "gpu_fraction": limits.gpu_fraction, "input_capacity": capacity,
                "arena_fd": arena.child_fd if arena is not None else None,
            }
            if shared:
                # The shared code its kernels import, as read here (runners.harness.imports).
                served.append(imports.Served(shared, []))
                setup["lib"] = str(served[-1].candidate_folder)

            def environment(scratch: Path, found: list[str] = found) -> dict[str, str]:
                env: dict[str, str] = {}
                # Triton's interpreter flag is set by its own entry, whichever comes last.
                for dsl_name in sorted(set(found), key=lambda name: name == "triton"):
                    env.update(dsls.child_environment(dsl_name, device, scratch))
                return env

            children[role] = Child(role=role, label=f"{role} process ({stage.label})", setup=setup,
                                   limits=limits, deadline=deadline, env_extra=environment, gpu=gpu)
        for role, child in children.items():
            try:
                child.wait_loaded()
            except (CallFailed, ChildFailure) as failure:
                raise CompoundError(f"{child.label} did not load: {_detail(failure)}") from None
        say(f"{len(stages)} stages of the {loop} loop at ctx={context_length}, batch {batch}, "
            f"{steps} step{'s' if steps > 1 else ''} a call")
        budget = min(budget_s, CPU_BUDGET_S) if device == "cpu" else budget_s
        try:
            times, _ = measure_step(
                children, context_length=context_length, batch=batch,
                seed=derive_seed(seed, "compound", context_length, batch), budget_s=budget,
                output_bytes=2 * batch * e2e_model.SHAPES[device].hidden * 8)
        except (CallFailed, ChildFailure) as failure:
            raise CompoundError(f"the loop failed: {_detail(failure)}") from None
    finally:
        for child in children.values():
            child.close()
        if arena is not None:
            arena.close()
        for folder in served:
            folder.close()
    report = _report(loop, stages, times, roles=roles, device=device, seed=seed, batch=batch,
                     steps=steps, meaningful=meaningful, hardware=hardware)
    report.update(context_length=context_length, machine=machine_state(device),
                  duration_s=round(time.monotonic() - started, 3))
    return report


def _detail(failure: CallFailed | ChildFailure) -> str:
    if isinstance(failure, CallFailed):
        return f"{failure.error} ({failure.role}, {failure.during or 'a request'})"
    return f"{failure.detail} ({failure.role})"


def _report(loop: str, stages: list[Stage], times: dict, *, roles: list[str], device: str, seed: int,
            batch: int, steps: int, meaningful: bool, hardware: str | None) -> dict[str, Any]:
    tokens = batch * steps
    rng = np.random.default_rng(derive_seed(seed, "compound-bootstrap"))
    (floor,) = noise_floors([(times[roles[0]].reported, times[CONTROL].reported)], rngs=[rng],
                            minimum=MIN_NOISE_FLOOR[device])
    rows = []
    previous: list[float] = []
    for index, (role, stage) in enumerate(zip(roles, stages, strict=True)):
        samples = times[role].reported
        if index == 0:
            # The first stage's two processes are the same kernels: both are its samples.
            samples = samples + times[CONTROL].reported
        median = float(np.median(samples))
        low, high = median_ci(samples)
        row: dict[str, Any] = {
            "label": stage.label, "ms": median, "ms_ci": [low, high],
            "tokens_per_s": tokens / (median / 1e3),
            "tokens_per_s_ci": [tokens / (high / 1e3), tokens / (low / 1e3)],
            "samples": len(samples),
        }
        if index:
            found = compare(previous, samples, rng=rng, noise=floor.floor)
            row.update(speedup=found.speedup, speedup_ci=list(found.speedup_ci), p_value=found.p_value,
                       significant=found.significant and meaningful)
        rows.append(row)
        previous = samples
    return {
        "loop": loop, "device": device, "hardware": hardware, "batch": batch, "decode_steps": steps,
        "seed": seed, "timing_meaningful": meaningful, "noise_floor_pct": 100 * floor.floor,
        "graphs": device == "cuda", "stages": rows,
        "roofline_tokens_per_s": roofline_tokens_per_s(loop, device, hardware),
    }

