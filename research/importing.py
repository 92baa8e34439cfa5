"""Importing a results file from a GPU host that reaches neither Redis nor the database.

The host ran `python -m runners.harness sweep … --out results.jsonl`
(runners.harness.results_file); this turns the file into an IMPORTED sweep of a thesis,
exactly as if workers had evaluated it: the candidates are committed into the kernel
workspace by the code sweep_start uses, and each result is claimed and recorded by
the services the workers call, so the same events stream to open browsers and the
same webhooks fire. The whole file is checked first and written in one transaction.
"""

from __future__ import annotations

import hashlib
import json

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from research import candidates, sweeps
import workspace
from research.events import event_append
from research.hardware import HARDWARE, gpu_class
from research.models import ApiToken, Sweep, Thesis
from research.provenance import import_provenance
from runners import ops, space
from runners.harness import results_file
from runners.harness.source_checks import first_failure, lib_checks, source_checks

# Sweep.context of an imported sweep starts with this and the hash of what the file
# says (content_digest): importing the same results again is refused by looking it up.
CONTEXT_PREFIX = "Imported results file sha256:"
# What a file measured, and only that: the kernels, the workloads and device, and each
# candidate's point, source and findings. Everything else a file says (its run's name,
# seed, machine, hardware, harness versions, budget, any key of its own) names or
# describes the run: the same measurements under another of those are the same results
# (blocking names one at a time let one forgery import again under each new spelling).
_MEASURED_HEADER = ("op", "device", "dsl", "kernel", "kernel_source", "baseline_kernel", "baseline_source",
                    "context_lengths", "batch_sizes")
_MEASURED_RESULT = ("op", "device", "dsl", "verdict", "correct", "guards", "workloads", "e2e", "dispatch")


def content_digest(parsed: results_file.ResultsFile) -> str:
    """A hash of what a results file measured (_MEASURED_HEADER, and per candidate its
    params, source and _MEASURED_RESULT), in a canonical JSON form (key order, spacing
    and line ends do not count). A file re-imported under a new run id, seed, machine or
    any other description of its run, or re-serialised, has the same digest."""
    header = {key: parsed.header.get(key) for key in _MEASURED_HEADER}
    if parsed.header.get("lib_files"):
        # The shared code the candidates ran with is measured too; a file without any
        # keeps the digest it had before files could hold it.
        header["lib_files"] = parsed.header["lib_files"]
    lines = [{"params": line.params, "source": line.source,
              "result": {key: line.result.get(key) for key in _MEASURED_RESULT}}
             for line in parsed.candidates]
    canonical = json.dumps([header, lines], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class AlreadyImported(ValidationError):
    """These results (content_digest) were imported before, as `sweep_id`."""

    def __init__(self, sweep_id: int) -> None:
        super().__init__({"results": f"these results were already imported as sweep {sweep_id} "
                                     "(the same measurements, whatever the run is called)"})
        self.sweep_id = sweep_id


def _refuse(message: str) -> ValidationError:
    return ValidationError({"results": message})


def _hardware_for(header: dict, thesis: Thesis, hardware: str | None) -> str:
    """The hardware class the results were measured on: as given, else the thesis's when
    the device matches, else the CPU."""
    device = header["device"]
    if hardware is None:
        hardware = thesis.hardware if HARDWARE[thesis.hardware].device == device else "cpu"
    if hardware not in HARDWARE:
        raise ValidationError({"hardware": f"unknown hardware {hardware!r}"})
    if HARDWARE[hardware].device != device:
        raise ValidationError({"hardware": (
            f"the results were measured on {device}; {hardware} is a {HARDWARE[hardware].device} class")})
    # The file names the GPU it ran on ("NVIDIA H100 80GB HBM3"): an H100's numbers filed
    # as an H200's would set the H200's path, leaderboard and dispatch from another card.
    measured_on = str(header.get("hardware") or "")
    if device != "cpu" and gpu_class(measured_on) != hardware:
        raise ValidationError({"hardware": (
            f"the results were measured on {measured_on or 'an unnamed GPU'}, not on {HARDWARE[hardware].label}; "
            f"import them as that card's class")})
    return hardware


def _check_against_thesis(parsed: results_file.ResultsFile, thesis: Thesis, hardware: str) -> None:
    header = parsed.header
    kept_source = workspace.kept_kernel(thesis.op, hardware).source
    if header["op"] != thesis.op:
        raise _refuse(f"line 1: the results are for op {header['op']!r}; thesis #{thesis.pk} is about {thesis.op!r}")
    if header["dsl"] != thesis.required_dsl:
        raise _refuse(f"line 1: kernel {header['kernel']!r} was evaluated as {header['dsl']}; "
                      f"thesis #{thesis.pk} requires {thesis.required_dsl}")
    target = ops.get_op(thesis.op)
    device = header["device"]
    try:
        expected = [w.name for w in target.workloads(device, thesis.context_lengths, thesis.batch_sizes)]
    except ops.WorkloadError as error:
        raise _refuse(f"thesis #{thesis.pk}'s workloads do not run on {device}: {error}") from error
    try:
        measured = [w.name for w in target.workloads(device, header["context_lengths"], header["batch_sizes"])]
    except ops.WorkloadError as error:
        raise _refuse(f"line 1: {error}") from error
    if measured != expected:
        raise _refuse(
            f"line 1: the results cover workloads {', '.join(measured)}; thesis #{thesis.pk} asks for "
            f"{', '.join(expected)} (run the sweep with --ctx {','.join(map(str, thesis.context_lengths))} "
            f"--batch {','.join(map(str, thesis.batch_sizes))})")
    failed = first_failure(lib_checks(header.get("lib_files", []), thesis.required_dsl))
    if failed is not None:
        raise _refuse(f"line 1: the shared code fails the {failed.name} check a worker runs: {failed.detail}")
    for line, candidate in enumerate(parsed.candidates, start=2):
        unknown = [w["name"] for w in candidate.result["workloads"] if w["name"] not in expected]
        if unknown:
            raise _refuse(f"line {line}: candidate {candidate.number} has results for workload "
                          f"{unknown[0]!r}, not one of the thesis's")
        # The candidate must be the kernel at its point, as sweep_start would have made
        # it: its commit then changes only the values of the point.
        try:
            materialised = space.materialize(header["kernel_source"], candidate.params)
        except (ValueError, SyntaxError) as error:
            raise _refuse(f"line {line}: candidate {candidate.number}: {error}") from error
        if materialised != candidate.source:
            raise _refuse(f"line {line}: candidate {candidate.number}'s source is not the kernel with "
                          "PARAMS set to its params")
        # What the file says its checks found counts for nothing: the lab runs them again,
        # protected-settings against the kernel kept on main now, as a new sweep's would be.
        failed = first_failure(source_checks(candidate.source, thesis.required_dsl, kept_source))
        if failed is not None:
            raise _refuse(f"line {line}: candidate {candidate.number} fails the {failed.name} check a "
                          f"worker runs: {failed.detail}")
    if len(parsed.candidates) > sweeps.MAX_SWEEP_BUDGET:
        raise _refuse(f"{len(parsed.candidates)} candidates; a sweep has at most {sweeps.MAX_SWEEP_BUDGET}")


def _context(sha256: str, header: dict) -> str:
    harness = header["harness"]
    built = " at ".join(str(part)[:12] for part in (harness.get("version"), harness.get("commit")) if part)
    return (f"{CONTEXT_PREFIX}{sha256}\n"
            f"run {header.get('run') or 'unnamed'}: {header['strategy']} over {header['kernel']} "
            f"(seed {header['seed']}, budget {header['budget']}) on {header.get('hardware') or 'unknown hardware'} "
            f"({header['device']}), harness {built or 'unknown'}, torch {harness.get('torch') or 'unknown'}")


def results_import(*, thesis: Thesis, imported_by, data: bytes, hardware: str | None = None,
                   token: ApiToken | None = None) -> Sweep:
    """Import a results file as a finished IMPORTED sweep of `thesis`, started by `imported_by`
    (through `token`, for the API; research.provenance names both on every result).

    Raises ValidationError (naming the line) for a file that cannot be imported, and
    AlreadyImported for one imported before; either way nothing is written.
    """
    if len(data) > settings.RESULTS_MAX_BYTES:
        raise _refuse(f"the file is {len(data):,} bytes; at most {settings.RESULTS_MAX_BYTES:,}")
    try:
        parsed = results_file.read(data)
    except results_file.ResultsFileError as error:
        raise _refuse(str(error)) from error
    header = parsed.header
    hardware = _hardware_for(header, thesis, hardware)
    _check_against_thesis(parsed, thesis, hardware)
    sha256 = content_digest(parsed)
    kept_file = workspace.kept_path(thesis.op, hardware)

    # As in sweep_start: the workspace lock, then the transaction, refs published last.
    # The lock also serialises imports, so the duplicate check cannot race.
    with workspace.lock(), transaction.atomic():
        earlier = Sweep.objects.filter(
            strategy=Sweep.Strategy.IMPORTED, context__startswith=f"{CONTEXT_PREFIX}{sha256}").first()
        if earlier is not None:
            raise AlreadyImported(earlier.pk)
        base = workspace.main_commit_with(kept_file, header["baseline_source"])
        if base is None:
            raise _refuse(f"line 1: the results were timed against a {thesis.op} kernel "
                          f"({header['baseline_kernel']!r}) that was never the kept kernel of {hardware} on "
                          "main: run the sweep with --baseline set to the kept kernel (GET /api/theses/ID "
                          "shows it)")
        sweep = Sweep.objects.create(
            thesis=thesis,
            started_by=imported_by,
            kernel=header["kernel"],
            strategy=Sweep.Strategy.IMPORTED,
            budget=header["budget"],
            seed=header["seed"],
            hardware=hardware,
            queue=HARDWARE[hardware].queue,
            total=len(parsed.candidates),
            base_commit=base,
            baseline_source=header["baseline_source"],
            baseline_kernel=header["baseline_kernel"],
            context=_context(sha256, header),
        )
        event_append(sweep_id=sweep.pk, type="sweep.created", payload={
            "kernel": sweep.kernel, "strategy": sweep.strategy, "total": sweep.total, "done": 0})
        candidates.candidates_add(
            sweep=sweep, kernel_source=header["kernel_source"], fork=None,
            points=[line.params for line in parsed.candidates],
            sources=[line.source for line in parsed.candidates], proposed_by=header["strategy"],
            results=[line.result for line in parsed.candidates],
            provenance=import_provenance(imported_by=imported_by, token=token, header=header))
    sweep.refresh_from_db()
    return sweep
