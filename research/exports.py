"""A candidate as a file anyone can take away and run again: its kernel, the kept kernel
it was timed against, the shared kernel code each of them ran with, what the lab
recorded, and the harness command that made it.

Our users do not trust a number they cannot reproduce; the bundle holds everything the
worker's run had besides the machine. The command is the worker's own
(research.evaluation.harness_arguments) with the seed the result revealed, so the same
inputs are drawn; timings move with the machine, the verdict's correctness does not.
"""

from __future__ import annotations

import io
import json
import shlex
import zipfile

from django.utils.text import capfirst

import workspace
from research import provenance
from research.evaluation import harness_arguments, kept_file_name
from research.hardware import HARDWARE
from research.models import Candidate, Sweep

# Entries dated alike: the same candidate exports to the same bytes.
_ZIP_DATE = (2000, 1, 1, 0, 0, 0)


def bundle_name(candidate: Candidate) -> str:
    return f"candidate-{candidate.label}-r{candidate.revision}.zip"


def candidate_bundle(candidate: Candidate) -> bytes:
    sweep, thesis = candidate.sweep, candidate.sweep.thesis
    kept = kept_file_name(sweep.baseline_kernel) if sweep.baseline_source else None
    seed = (candidate.result or {}).get("seed")
    # The lib folders a worker passes (research.tasks.evaluate_candidate); an imported
    # result ran on a host of its own, with the shared code its results file names.
    imported = sweep.strategy == Sweep.Strategy.IMPORTED
    shared = {folder: workspace.lib_files(commit) if commit and not imported else None
              for folder, commit in (("lib", candidate.commit), ("kept-lib", sweep.base_commit))}
    arguments = harness_arguments(
        op=thesis.op, candidate="candidate.py", device=HARDWARE[sweep.hardware].device,
        dsl=thesis.required_dsl, context_lengths=thesis.context_lengths, batch_sizes=thesis.batch_sizes,
        baseline=kept, seed=seed if isinstance(seed, int) else None,
        lib="lib" if shared["lib"] else None, baseline_lib="kept-lib" if shared["kept-lib"] else None)
    command = shlex.join(["python3", *arguments])
    recorded = {
        "candidate": candidate.label, "revision": candidate.revision, "commit": candidate.commit,
        "op": thesis.op, "hardware": sweep.hardware, "kernel": sweep.kernel, "params": candidate.params,
        "status": candidate.status, "verdict": candidate.verdict, "geomean_speedup": candidate.geomean_speedup,
        "measured": provenance.describe(candidate), "provenance": candidate.provenance,
        "baseline": sweep.baseline_kernel or "the op's baseline", "base_commit": sweep.base_commit,
        "command": command, "result": candidate.result,
    }
    files = {
        "candidate.py": candidate.source,
        "result.json": json.dumps(recorded, indent=1, sort_keys=True, default=str) + "\n",
        "REPRODUCE.md": _reproduce_text(candidate, command, kept),
    }
    if kept:
        files[kept] = sweep.baseline_source
    for folder, lib in shared.items():
        files.update({f"{folder}/{name}": data for name, data in (lib or {}).items()})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            # Shared code as git holds it: the bytes the harness hashed.
            data = content if isinstance(content, bytes) else content.encode("utf-8")
            archive.writestr(zipfile.ZipInfo(name, _ZIP_DATE), data)
    return out.getvalue()


def _reproduce_text(candidate: Candidate, command: str, kept: str | None) -> str:
    against = f"`{kept}`, the kernel kept when its sweep started" if kept else "the op's shipped baseline"
    seed_note = ("`--seed` repeats the inputs its run drew, secret sizes included."
                 if "--seed" in command else "Its run revealed no seed: this run draws its own inputs.")
    return (
        f"# Candidate {candidate.label}, revision {candidate.revision}\n\n"
        # The description says who measured it ("measured here by …", "imported by …"):
        # prefixed with "Measured", it read "Measured measured here" and "Measured imported".
        f"{capfirst(provenance.describe(candidate))}; verdict: {candidate.verdict or candidate.status}.\n"
        f"Timed against {against}.\n\n"
        "In this folder, with a Kernel Lab checkout on PYTHONPATH (the harness needs Python with\n"
        "torch; `PYTHONPATH=/path/to/kernel-lab`):\n\n"
        f"    {command}\n\n"
        f"{seed_note} Timings move with the machine (compare `result.json`'s `machine`);\n"
        "correctness and the guards do not.\n"
    )
