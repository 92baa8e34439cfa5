"""The kernel workspace: a git repository seeded with the baselines, one branch per
candidate, writers serialised, and the harness timing against the file it is given."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from django.core.management import call_command

import workspace
from research.hardware import HARDWARE
from runners.ops import get_op, list_ops
from tests.app_process import ROOT
from tests.reviewing import make_thesis, start_sweep
from tests.reviewing import no_enqueue, people, workspace_dir  # noqa: F401  (fixtures)


def _git(*args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(workspace.path()), *args], check=True,
                          capture_output=True, text=True).stdout


def test_the_launcher_command_creates_the_workspace_seeded_with_every_ops_baseline(workspace_dir):
    call_command("workspace_init")
    head = workspace.main_head()
    for op in list_ops():
        for hardware in HARDWARE:
            assert workspace.read_file(head, f"kernels/{op}/{hardware}/kept.py") == \
                get_op(op).baseline_path.read_text()
    table = json.loads(workspace.read_file(head, "dispatch.json"))
    assert sorted(table) == list_ops() and sorted(table["rmsnorm"]) == sorted(HARDWARE)
    assert table["rmsnorm"]["h200"] == [{
        "kernel": "baseline", "commit": None, "path": "kernels/rmsnorm/h200/kept.py",
        "source": "runners/ops/rmsnorm/baseline.py", "axis": None, "min": None, "max": None,
    }]
    assert _git("rev-parse", "--is-bare-repository").strip() == "true"
    # Idempotent: a second start adds nothing.
    call_command("workspace_init")
    assert workspace.main_head() == head
    assert _git("rev-list", "--count", "main").strip() == "1"


def test_each_candidate_is_a_commit_on_its_own_branch_forked_from_main(people, workspace_dir, no_enqueue):
    sweep = start_sweep(make_thesis(people.author), people.producer, budget=2)
    main = workspace.main_head()
    assert sweep.base_commit == main and sweep.baseline_kernel == "baseline"
    assert sweep.baseline_source == get_op("rmsnorm").baseline_path.read_text()
    branches = workspace.branches("candidate/")
    for candidate in sweep.candidates.all():
        assert candidate.branch == f"candidate/{sweep.pk}-{candidate.number}"
        assert branches[candidate.branch] == candidate.commit
        assert workspace.read_file(candidate.commit, "kernels/rmsnorm/cpu/kept.py") == candidate.source
        assert _git("merge-base", "main", candidate.commit).strip() == main
        info = workspace.commit_info(candidate.commit)
        assert info["author"] == "bob" and info["author_email"] == "bob@example.com"
        assert info["message"].startswith(f"Candidate {sweep.pk}-{candidate.number}: blocked block_rows=")

    # A parameter-only candidate's own commit changes nothing but PARAMS values.
    second = sweep.candidates.get(number=2)
    own = workspace.diff(f"{second.commit}^", second.commit, context=0)
    changed = [line for line in own.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed and all(any(key in line for key in second.params) for line in changed), own
    # ...while against the kept kernel it is the whole swap from the shipped baseline.
    assert "-    hidden = x.float()" in workspace.diff(sweep.base_commit, second.commit)


def test_a_workspace_of_one_kept_kernel_per_op_moves_to_one_per_hardware_class(workspace_dir):
    # The shared layout: a CPU keep had become the H200's kernel too. Built by hand here
    # as the earlier code wrote it: kernels/<op>/kept.py and op -> entries.
    baseline = get_op("rmsnorm").baseline_path.read_text()
    h200_kernel, cpu_kernel = baseline + "\n# kept on the H200\n", baseline + "\n# kept on a CPU\n"
    ada = workspace.Identity("Ada", "ada@example.com")
    subprocess.run(["git", "init", "--quiet", "--bare", "--initial-branch", "main", str(workspace.path())],
                   check=True)
    (seed,) = workspace.build([workspace.NewCommit(parents=[], author=ada, message="seed", files={
        "kernels/rmsnorm/kept.py": baseline, "dispatch.json": "{}"})])
    (h200_keep,) = workspace.build([workspace.NewCommit(parents=[seed], author=ada, message="h200",
                                                        files={"kernels/rmsnorm/kept.py": h200_kernel})])
    (cpu_keep,) = workspace.build([workspace.NewCommit(parents=[h200_keep], author=ada, message="cpu",
                                                       files={"kernels/rmsnorm/kept.py": cpu_kernel})])
    entry = {"kernel": "blocked", "path": "kernels/rmsnorm/kept.py", "axis": None, "min": None, "max": None}
    shared = {"rmsnorm": [{**entry, "commit": cpu_keep, "hardware": "cpu"},
                          {**entry, "commit": h200_keep, "hardware": "h200"},
                          {"kernel": "baseline", "commit": None, "path": "kernels/rmsnorm/kept.py"}]}
    (old_main,) = workspace.build([workspace.NewCommit(parents=[cpu_keep], author=ada, message="table",
                                                       files={"dispatch.json": json.dumps(shared)})])
    workspace.publish([workspace.RefUpdate("main", old_main)])

    workspace.ensure()
    head = workspace.main_head()
    assert workspace.kept_kernel("rmsnorm", "cpu").source == cpu_kernel
    assert workspace.kept_kernel("rmsnorm", "h200").source == h200_kernel
    assert workspace.kept_kernel("rmsnorm", "h100").source == baseline  # nothing kept there
    assert workspace.read_file(head, "kernels/rmsnorm/kept.py") is None
    assert [e["commit"] for e in workspace.dispatch_entries("rmsnorm", "h200")] == [h200_keep, None]
    # An entry still names where its own commit holds the kernel.
    assert workspace.read_file(h200_keep, workspace.dispatch_entries("rmsnorm", "h200")[0]["path"]) == h200_kernel
    assert workspace.commit_info(head)["message"].startswith("Keep kernels per hardware class")
    workspace.ensure()
    assert workspace.main_head() == head  # once


def test_writers_are_serialised_by_a_file_lock(workspace_dir):
    acquired = threading.Event()

    def other_writer() -> None:
        with workspace.lock():  # another thread opens its own descriptor, like a process
            acquired.set()

    with workspace.lock():
        thread = threading.Thread(target=other_writer)
        thread.start()
        assert not acquired.wait(0.3)
    assert acquired.wait(5)
    thread.join()


def test_a_ref_that_moved_makes_the_publish_fail_and_changes_nothing(workspace_dir):
    workspace.ensure()
    head = workspace.main_head()
    (commit,) = workspace.build([workspace.NewCommit(
        parents=[head], files={"kernels/rmsnorm/cpu/kept.py": "x = 1\n"}, message="m",
        author=workspace.Identity("Ada", "ada@example.com"))])
    try:
        workspace.publish([workspace.RefUpdate("candidate/9-9", commit),
                           workspace.RefUpdate("main", commit, old=commit)])  # main is not there
    except workspace.WorkspaceError as error:
        assert "update-ref" in str(error)
    else:
        raise AssertionError("the stale compare-and-swap was accepted")
    assert workspace.main_head() == head and "candidate/9-9" not in workspace.branches()


def test_the_harness_times_against_the_kernel_given_with_baseline(tmp_path):
    # A kept kernel that cannot load: if --baseline were ignored the run would be fine.
    kept = tmp_path / "kept.py"
    kept.write_text('raise SystemExit("the kept kernel refuses to load")\n')
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm",
         str(ROOT / "runners/ops/rmsnorm/baseline.py"), "--json", "--ctx", "64", "--batch", "1",
         "--time-budget", "0.05", "--baseline", str(kept)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["verdict"] == "rejected"
    assert any("kept kernel refuses to load" in g["detail"] for g in result["guards"]), result["guards"]


def test_a_missing_baseline_file_is_a_usage_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm", "baseline",
         "--baseline", str(tmp_path / "nope.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2 and "nope.py" in done.stderr
