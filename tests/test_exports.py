"""A candidate exported to run again elsewhere: the bundle holds its kernel, the kept
kernel it was timed against and the lab's record, and the command in its REPRODUCE.md,
run from the unpacked folder, repeats the lab's run (the same harness path, the same
secret seed)."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import zipfile

import pytest
from django.urls import reverse

import workspace
from research import candidates, exports
from research.evaluation import evaluate_source
from research.hardware import HARDWARE
from research.provenance import worker_provenance
from reviews import services as review_services
from tests.app_process import ROOT
from tests.reviewing import make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, waiting_win, workspace_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


def _unpack(data: bytes) -> dict[str, str]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {name: archive.read(name).decode() for name in archive.namelist()}


def _command(files: dict[str, str]) -> list[str]:
    [line] = [line for line in files["REPRODUCE.md"].splitlines() if line.startswith("    python3 -m runners.harness")]
    return shlex.split(line)


def test_the_exported_command_repeats_the_workers_run_from_the_unpacked_folder(people, workspace_dir, no_enqueue,
                                                                               settings, tmp_path):
    settings.HARNESS_TIME_BUDGET_S = 0.2
    thesis = make_thesis(people.author, context_lengths=[64])
    sweep = start_sweep(thesis, people.producer, budget=1)
    candidate = sweep.candidates.get(number=1)
    # As the worker does it (research.tasks.evaluate_candidate): the real harness, then record.
    result = evaluate_source(op=thesis.op, source=candidate.source, device=HARDWARE[sweep.hardware].device,
                             context_lengths=thesis.context_lengths, batch_sizes=thesis.batch_sizes,
                             dsl=thesis.required_dsl, baseline_source=sweep.baseline_source,
                             baseline_kernel=sweep.baseline_kernel, lib_commit=candidate.commit,
                             baseline_lib_commit=sweep.base_commit)
    assert candidates.candidate_claim(candidate_id=candidate.pk) is not None
    candidates.candidate_record_result(candidate_id=candidate.pk, result=result,
                                     provenance=worker_provenance(queue=sweep.queue))
    candidate.refresh_from_db()

    files = _unpack(exports.candidate_bundle(candidate))
    # Nothing kept yet: the workspace's kept file is the op's baseline, and it travels too,
    # with the shared kernel code of both commits as the worker passed it.
    lib = {f"{folder}/{name}" for folder in ("lib", "kept-lib") for name in workspace.lib_files(candidate.commit)}
    assert set(files) == {"candidate.py", "result.json", "REPRODUCE.md", "kept/baseline.py", *lib}
    assert files["kept/baseline.py"] == sweep.baseline_source
    # Who measured it, said once (it read "Measured measured here by a worker on …").
    assert files["REPRODUCE.md"].splitlines()[2].startswith("Measured here by a worker on ")
    assert files["candidate.py"] == candidate.source
    recorded = json.loads(files["result.json"])
    assert recorded["result"]["seed"] == result["seed"] and recorded["verdict"] == candidate.verdict
    assert recorded["provenance"]["by"] == "worker"
    command = _command(files)
    assert command[command.index("--seed") + 1] == str(result["seed"])
    assert command[command.index("--lib") + 1] == "lib" and command[command.index("--baseline-lib") + 1] == "kept-lib"

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    again = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    repeated = json.loads(again.stdout)
    assert repeated["seed"] == result["seed"] and repeated["correct"] is True
    assert repeated["verdict"] == result["verdict"]
    # Every input and secret size derives from the seed (runners.harness.seeds): the same
    # correctness matrix was checked again.
    assert [g["name"] for g in repeated["guards"]] == [g["name"] for g in result["guards"]]


def test_a_candidate_timed_against_a_kept_kernel_exports_that_kernel_and_names_it(people, waiting_win, no_enqueue):
    review_services.candidate_keep(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit)
    later = start_sweep(make_thesis(people.author, title="Again"), people.producer, budget=1)
    candidate = record(later.candidates.get(number=1), recorded_result())
    assert later.baseline_source

    files = _unpack(exports.candidate_bundle(candidate))
    kept = [name for name in files if name.startswith("kept/")]
    assert kept == [f"kept/{later.baseline_kernel}.py"] and files[kept[0]] == later.baseline_source
    command = _command(files)
    assert command[command.index("--baseline") + 1] == kept[0]
    assert "Timed against `kept/" in files["REPRODUCE.md"]
    # No seed in a hand-written result: the file says the run draws its own inputs.
    assert "--seed" not in command and "revealed no seed" in files["REPRODUCE.md"]


def test_the_export_is_a_download_for_people_who_are_logged_in(client, people, waiting_win):
    url = reverse("candidate_export", args=[waiting_win.pk])
    assert client.get(url).status_code == 302  # to the login page
    client.force_login(people.outsider)
    answer = client.get(url)
    assert answer.status_code == 200 and answer["Content-Type"] == "application/zip"
    assert answer["Content-Disposition"] == f'attachment; filename="candidate-{waiting_win.label}-r1.zip"'
    assert answer.content == exports.candidate_bundle(waiting_win)  # the same bytes every time
    assert client.get(reverse("candidate_export", args=[10**9])).status_code == 404
    page = client.get(waiting_win.get_absolute_url()).content.decode()
    assert f'href="{url}"' in page
