"""The kernel workspace's shared code: `kernels/lib/` is seeded with the shipped
runners/kernel_lib, a candidate's commit may change a module of it, and the worker
evaluates the candidate with its own commit's modules (the kept kernel with its sweep
base's), each file hashed in the result. A change outside the thesis's allowed paths is
refused before anything is committed or evaluated.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from django.urls import reverse

import workspace
from research import evaluation, queueing, sweeps
from research.models import Candidate, Sweep
from research.tasks import propose_with_agent
from runners.harness.imports import SHIPPED_LIB
from tests.celery_worker import cpu_worker, wait_until_finished
from tests.reviewing import workspace_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db(transaction=True)

AGENT = Path(__file__).parent / "agents" / "scripted_agent.py"
SHARED = "kernels/lib/topk_torch.py"
KERNEL_FILE = "kernels/dsa_indexer_topk/cpu/kept.py"
AGENT_MARK = b"# Shared code changed by the scripted agent.\n"


@pytest.fixture
def declare(settings):
    def declare(modes: str) -> None:
        settings.AGENT_COMMANDS = {"scripted": f"{sys.executable} {AGENT} {modes}"}
        settings.AGENT_TIME_LIMIT_S = 60
    return declare


def _indexer_thesis(make_thesis, **fields):
    # chunked_topk sums its heads with runners.kernel_lib.topk_torch.head_scores.
    return make_thesis(title="Shared head sums", op="dsa_indexer_topk", context_lengths=[2048],
                       batch_sizes=[1], **fields)


def _agent_sweep(thesis, user, budget: int) -> Sweep:
    return sweeps.sweep_start(thesis=thesis, started_by=user, kernel="chunked_topk", strategy="agent",
                              budget=budget, agent_command="scripted")


def test_the_workspace_holds_the_shipped_lib_and_an_older_one_gains_what_it_lacks_once(workspace_dir):
    shipped = {module.name: module.read_bytes() for module in SHIPPED_LIB.glob("*.py")}
    workspace.ensure()
    head = workspace.main_head()
    assert workspace.lib_files(head) == shipped
    assert workspace.commit_info(head)["parents"] == []  # seeded with the kernels, in one commit

    # A main line whose topk_triton.py a keep changed, and which lacks topk_torch.py (an
    # older workspace, or a module added to the shipped lib since).
    changed = shipped["topk_triton.py"] + b"\n# changed by a keep\n"
    (older,) = workspace.build([workspace.NewCommit(
        parents=[head], author=workspace.KERNEL_LAB, message="an older main",
        files={f"{workspace.LIB_DIR}/topk_triton.py": changed.decode(), SHARED: None})])
    workspace.publish([workspace.RefUpdate(workspace.MAIN, older, old=head)])
    assert "topk_torch.py" not in workspace.lib_files(older)

    workspace.ensure()
    seeded = workspace.main_head()
    assert workspace.commit_info(seeded)["message"].strip() == f"Seed the shared kernel code: {SHARED}"
    assert workspace.lib_files(seeded) == {**shipped, "topk_triton.py": changed}  # the keep's stays
    workspace.ensure()
    assert workspace.main_head() == seeded


def test_a_commit_without_kernels_lib_is_evaluated_with_the_shipped_lib(workspace_dir, tmp_path):
    workspace.ensure()
    (bare,) = workspace.build([workspace.NewCommit(
        parents=[], author=workspace.KERNEL_LAB, message="before shared code",
        files={KERNEL_FILE: "def forward(q, k, weights, topk): ...\n"})])
    assert workspace.lib_files(bare) is None
    assert evaluation.lib_folder(bare, tmp_path / "lib") is None
    assert evaluation.lib_folder("", tmp_path / "lib") is None
    written = evaluation.lib_folder(workspace.main_head(), tmp_path / "lib")
    assert (written / "topk_torch.py").read_bytes() == (SHIPPED_LIB / "topk_torch.py").read_bytes()


def test_a_candidate_is_evaluated_with_the_shared_module_its_commit_changed(
        make_thesis, user, declare, workspace_dir, logged_in_client):
    declare("lib,lib-wrong")
    thesis = _indexer_thesis(make_thesis, allowed_paths=[SHARED])
    sweep = _agent_sweep(thesis, user, budget=2)

    with cpu_worker():
        wait_until_finished(sweep.pk, timeout_s=600)

    sweep.refresh_from_db()
    assert sweep.status == Sweep.Status.FINISHED
    honest, wrong = sweep.candidates.order_by("number")
    shipped = (SHIPPED_LIB / "topk_torch.py").read_bytes()
    # The kept kernel it is timed against runs with its sweep base's lib: the seeded one.
    assert workspace.lib_files(sweep.base_commit)["topk_torch.py"] == shipped
    for candidate in (honest, wrong):
        held = workspace.lib_files(candidate.commit)["topk_torch.py"]
        assert held != shipped and held.endswith(AGENT_MARK)
        # The change is part of the candidate: its commit, and so its diff and a keep.
        assert sorted(workspace.changed_files(sweep.base_commit, candidate.commit)) == sorted([SHARED, KERNEL_FILE])
        ran = {file["path"]: file["sha256"] for file in candidate.result["lib_files"]}
        assert ran == {"__init__.py": hashlib.sha256(workspace.lib_files(candidate.commit)["__init__.py"]).hexdigest(),
                       "topk_torch.py": hashlib.sha256(held).hexdigest()}

    # A comment changes nothing that runs: the honest change is judged like the kernel.
    assert honest.status == Candidate.Status.DONE and honest.correct is True, honest.result["guards"]
    assert honest.verdict in {"win", "no-gain"}
    # The wrong one negates the shared head sum: only the workspace's version of the
    # module, never the shipped one, selects the lowest scores.
    assert wrong.verdict == "rejected" and wrong.correct is False
    failed = {guard.name: guard.detail for guard in wrong.guards.all() if guard.status == "fail"}
    assert "correctness" in failed, failed

    page = logged_in_client.get(reverse("candidate_review", args=[honest.pk])).content.decode()
    honest_sha = hashlib.sha256(workspace.lib_files(honest.commit)["topk_torch.py"]).hexdigest()
    assert 'id="lib-files"' in page and honest_sha in page
    assert SHARED in page and "Shared code changed by the scripted agent." in page  # the diff


def test_a_change_to_a_shared_module_outside_the_allowed_paths_is_refused_naming_it(
        make_thesis, user, declare, workspace_dir, monkeypatch):
    asked: list[int] = []
    monkeypatch.setattr(queueing, "proposal_enqueue", asked.append)
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
    declare("lib")
    sweep = _agent_sweep(_indexer_thesis(make_thesis), user, budget=1)
    while asked:
        propose_with_agent(asked.pop(0))

    (refused,) = sweep.candidates.all()
    assert refused.status == Candidate.Status.REFUSED
    assert refused.refusal == (
        f"changes outside the allowed paths: {SHARED} (allowed: {KERNEL_FILE}); kernels/lib/ is shared "
        "kernel code, which every kernel that imports it runs: a candidate may change a module of it "
        "only where the thesis's allowed paths name it")
    # Nothing was committed: the shared code on main and every branch is as seeded.
    assert not refused.commit and workspace.branches("candidate/") == {}
    assert workspace.lib_files(workspace.main_head())["topk_torch.py"] == (SHIPPED_LIB / "topk_torch.py").read_bytes()
