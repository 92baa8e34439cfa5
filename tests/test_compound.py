"""Kernels compound: the decode loop with the kept kernels stacked in, one stage per keep
or undo, measured by the harness in jailed children and shown as a waterfall.

The harness runs here for real on the CPU (its tokens per second are this machine's and
only their shape is asserted); the keeps behind the stages are reviews of hand-written
test results (tests/reviewing.py), as in the other review tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from django.urls import reverse

import workspace
from reviews import compounding, services
from reviews.models import CompoundRun
from runners.harness import compound
from runners.harness.measure import round_orders
from runners.ops import get_op
from tests.reviewing import make_reviewer, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, workspace_dir  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[1]
RMSNORM_KERNELS = get_op("rmsnorm").kernels()


@pytest.mark.parametrize("count", range(3, 13))
def test_every_stage_takes_every_place_and_follows_every_other_and_none_runs_twice_in_a_row(count):
    sides = tuple(f"stage {index}" for index in range(count))
    orders = round_orders(sides)
    assert all(sorted(order) == sorted(sides) for order in orders)
    for place in range(count):
        assert Counter(order[place] for order in orders) == Counter({side: len(orders) // count for side in sides})
    follows = Counter((order[i], order[i + 1]) for order in orders for i in range(count - 1))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) == 1
    joins = [(orders[i][-1], orders[(i + 1) % len(orders)][0]) for i in range(len(orders))]
    assert all(left != right for left, right in joins)


def _stages_file(folder: Path, loop: str, stages: list[tuple[str, dict[str, Path]]]) -> Path:
    document = {"loop": loop, "stages": []}
    for index, (label, kernels) in enumerate(stages):
        names = {}
        for op, source in kernels.items():
            file = folder / str(index) / f"{op}.py"
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(source.read_text())
            file.chmod(0o644)
            names[op] = f"{index}/{op}.py"
        document["stages"].append({"label": label, "kernels": names})
    path = folder / "stages.json"
    path.write_text(json.dumps(document))
    return path


def _harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runners.harness", "compound", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False)


def test_the_harness_times_the_loop_with_each_stages_kernels_stacked_in(tmp_path):
    loop = "dsa_indexer_topk_paged"
    baselines = {"rmsnorm": get_op("rmsnorm").baseline_path, loop: get_op(loop).baseline_path}
    per_sequence = get_op(loop).kernels()["per_sequence"]
    stages = _stages_file(tmp_path, loop, [
        ("shipped baselines", baselines),
        ("keep of blocked rmsnorm", {**baselines, "rmsnorm": RMSNORM_KERNELS["blocked"]}),
        ("keep of per_sequence", {"rmsnorm": RMSNORM_KERNELS["blocked"], loop: per_sequence}),
    ])
    done = _harness(str(stages), "--json", "--seed", "7")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert (report["loop"], report["device"], report["seed"]) == (loop, "cpu", 7)
    assert (report["context_length"], report["batch"]) == compound.point(loop, "cpu")
    assert report["decode_steps"] == get_op(loop).decode_steps["cpu"]
    assert [stage["label"] for stage in report["stages"]] == [
        "shipped baselines", "keep of blocked rmsnorm", "keep of per_sequence"]
    tokens = report["batch"] * report["decode_steps"]
    for stage in report["stages"]:
        low, high = stage["tokens_per_s_ci"]
        assert low <= stage["tokens_per_s"] <= high
        assert stage["tokens_per_s"] == pytest.approx(tokens / (stage["ms"] / 1e3))
        assert stage["samples"] >= 30
    # Every stage after the first is compared with the one before, beyond a CPU's floor.
    assert "speedup" not in report["stages"][0]
    assert all(stage["speedup_ci"][0] <= stage["speedup"] <= stage["speedup_ci"][1]
               for stage in report["stages"][1:])
    assert report["noise_floor_pct"] >= 50
    # A CPU has no roofline: its peaks are generous bounds (skills/hardware/peaks.toml).
    assert report["roofline_tokens_per_s"] is None
    assert report["machine"]["cpu"]


def test_the_roofline_is_what_a_step_must_read_at_the_datasheet_bandwidth():
    loop = "dsa_indexer_topk_paged_fp8"
    context_length, batch = compound.point(loop, "cuda")
    read, flops = compound.step_cost(loop, "cuda", context_length, batch)
    # Decode is memory-bound: reading decides, at the H200's 4.8 TB/s.
    assert read / 4800e9 > flops / 989e12
    assert compound.roofline_tokens_per_s(loop, "cuda", "h200") == pytest.approx(batch / (read / 4800e9))
    # A longer context reads more keys; a bf16 cache reads twice the key bytes of e4m3.
    longer, _ = compound.step_cost(loop, "cuda", 2 * context_length, batch)
    bf16, _ = compound.step_cost("dsa_indexer_topk_paged", "cuda", context_length, batch)
    assert longer > read and bf16 > read
    assert compound.roofline_tokens_per_s(loop, "cpu", "cpu") is None


@pytest.mark.parametrize(("document", "error"), [
    ("not json", "is not JSON"),
    ('{"loop": "dsa_indexer_topk", "stages": []}', "has no stages"),
    ('{"loop": "rmsnorm", "stages": [{"kernels": {}}]}', "no decode loop serves 'rmsnorm'"),
    ('{"loop": "dsa_indexer_topk", "stages": [{"kernels": {"rmsnorm": "a.py"}}]}',
     "the dsa_indexer_topk loop needs exactly rmsnorm, dsa_indexer_topk"),
    ('{"loop": "dsa_indexer_topk", "stages": [{"kernels": {"rmsnorm": "a.py", "dsa_indexer_topk": "gone.py"}}]}',
     "dsa_indexer_topk's kernel gone.py is not a file"),
])
def test_a_bad_stages_file_is_refused_with_what_is_wrong(tmp_path, document, error):
    (tmp_path / "a.py").write_text("def forward(*args):\n    return None\n")
    path = tmp_path / "stages.json"
    path.write_text(document)
    done = _harness(str(path), "--json")
    assert done.returncode == 1 and done.stdout == ""
    assert error in done.stderr.strip().splitlines()[-1]


def test_a_stage_kernel_is_jailed_like_a_candidate(tmp_path):
    """A kept kernel passed four eyes, not a jail: the stage's process is the candidate's.
    This one writes into the project when imported, which it does outside the harness."""
    loop = "dsa_indexer_topk"
    target = ROOT / "kept-kernel-was-here.txt"
    hostile = tmp_path / "hostile.py"
    hostile.write_text(
        get_op("rmsnorm").baseline_path.read_text()
        + f"\nfrom pathlib import Path\nPath({str(target)!r}).write_text('out')\n")
    try:
        outside = subprocess.run([sys.executable, str(hostile)], capture_output=True, text=True, check=False)
        assert outside.returncode == 0 and target.read_text() == "out"  # it does, outside the harness
        target.unlink()
        baselines = {"rmsnorm": get_op("rmsnorm").baseline_path, loop: get_op(loop).baseline_path}
        stages = _stages_file(tmp_path / "stages", loop, [
            ("shipped baselines", baselines), ("keep of a hostile rmsnorm", {**baselines, "rmsnorm": hostile})])
        done = _harness(str(stages), "--json")
        assert done.returncode == 1
        assert "stage 1 process (keep of a hostile rmsnorm) did not load" in done.stderr
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


# -- the lab's side: stages from main's history, a run per keep, the path page ------------

def _win(people, thesis, number: int):
    sweep = start_sweep(thesis, people.producer, budget=number)
    return record(sweep.candidates.get(number=number), recorded_result())


def _keep(candidate, reviewer, **dispatch):
    return services.candidate_keep(candidate=candidate, reviewer=reviewer, commit=candidate.commit, **dispatch)


@pytest.fixture
def kept_twice_and_undone(people, workspace_dir, no_enqueue):
    """Three rmsnorm keeps on the CPU class: the first for every size, the second only at
    64 tokens (not the loop's point), the third for every size and then undone."""
    thesis = make_thesis(people.author)
    # Each win forks from main after the keep before it, as a keep requires.
    first = _win(people, thesis, 1)
    _keep(first, people.reviewer)
    narrow = _win(people, thesis, 2)
    _keep(narrow, people.reviewer, dispatch_min=64, dispatch_max=64)
    third = _win(people, thesis, 3)
    _keep(third, people.reviewer)
    services.candidate_undo(candidate=third, reviewer=make_reviewer("linus"), commit=third.commit,
                            comment="Slower in the engine.")
    return first, narrow, third


def test_the_stages_are_the_keeps_and_undos_that_changed_what_serves_the_loop(kept_twice_and_undone):
    first, narrow, third = kept_twice_and_undone
    found = compounding.loops("cpu")
    # Only rmsnorm was kept: the serving loop shows it.
    assert list(found) == [compound.SERVING_LOOP]
    stages = found[compound.SERVING_LOOP]
    assert [stage["label"] for stage in stages] == [
        compounding.SEED_LABEL, f"keep rmsnorm {first.label} (blocked)", f"keep rmsnorm {third.label} (blocked)",
        f"undo rmsnorm {third.label} (blocked)"]
    # The keep for 64 tokens only serves no decode step of batch 8: no stage of its own.
    assert not any(narrow.label in stage["label"] for stage in stages)
    assert [stage["sources"]["rmsnorm"] for stage in stages] == [
        get_op("rmsnorm").baseline_path.read_text(), first.source, third.source, first.source]
    assert {stage["sources"][compound.SERVING_LOOP] for stage in stages} == {
        get_op(compound.SERVING_LOOP).baseline_path.read_text()}
    assert stages[-1]["commit"] == workspace.main_head()
    # Nothing was ever kept on another class.
    assert compounding.loops("h200") == {}


def test_a_keep_asks_its_hardwares_worker_for_a_run_once_a_head(people, workspace_dir, no_enqueue,
                                                                  django_capture_on_commit_callbacks):
    thesis = make_thesis(people.author)
    win = _win(people, thesis, 1)
    with django_capture_on_commit_callbacks(execute=True):
        _keep(win, people.reviewer)
    run = CompoundRun.objects.get()
    assert (run.hardware, run.queue, run.status) == ("cpu", "runner.cpu", CompoundRun.Status.QUEUED)
    assert run.main_commit == workspace.main_head()
    assert compounding.request("cpu") is None  # that head has its run
    assert CompoundRun.objects.count() == 1
    # A later keep's run makes this one's measurement moot: the worker skips it.
    later = _win(people, thesis, 2)
    with django_capture_on_commit_callbacks(execute=True):
        _keep(later, people.reviewer)
    skipped = compounding.measure(run.pk)
    assert (skipped.status, skipped.error) == (CompoundRun.Status.FAILED,
                                               f"superseded by the run at {workspace.main_head()[:12]}")
    measured, waiting = compounding.latest("cpu")
    assert measured is None and waiting.main_commit == workspace.main_head()


@pytest.mark.django_db
def test_a_worker_measures_the_waterfall_and_the_path_page_draws_it(kept_twice_and_undone, client, people):
    run = CompoundRun.objects.create(hardware="cpu", main_commit=workspace.main_head(), queue="runner.cpu")
    client.force_login(people.outsider)
    page = client.get(reverse("path_team")).content.decode()
    assert 'id="compound-cpu-waiting"' in page and 'hx-trigger="every 5s"' in page
    # No worker serves the CPU queue in this test: the page says how to start one.
    assert "No worker serves <code>runner.cpu</code> now" in page

    measured = compounding.measure(run.pk)

    assert measured.status == CompoundRun.Status.DONE, measured.error
    (report,) = measured.reports
    assert report["loop"] == compound.SERVING_LOOP
    assert [stage["commit"] for stage in report["stages"]] == [
        stage["commit"] for stage in compounding.loops("cpu")[compound.SERVING_LOOP]]
    assert measured.provenance["queue"] == "runner.cpu"
    assert compounding.measure(run.pk) is None  # measured once
    page = client.get(reverse("path_team")).content.decode()
    assert "compound-cpu-waiting" not in page and "every 5s" not in page
    assert f'id="compound-cpu-{compound.SERVING_LOOP}"' in page
    assert '"type": "waterfall"' in page and "undo rmsnorm" in page
    fragment = client.get(reverse("path_compound")).content.decode()
    assert fragment.lstrip().startswith('<section id="compound"')
