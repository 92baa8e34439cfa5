"""Kernels compound: per hardware class, the decode loop's tokens per second with the
kept kernels stacked in, one stage per keep and per undo, against the roofline the
machine allows: the waterfall on the path page.

After every keep and undo, `request` asks for a run at main's new head on that class's
queue: only a worker of that hardware can measure it (a CPU's tokens per second say
nothing of an H200's). The worker (`measure`) reads main's history up to that head,
writes each stage's kernels into a scratch folder, and runs `python -m runners.harness
compound` once a loop: the same jailed child processes and timing loop as an
evaluation, every stage timed in the same rounds.

A stage is a commit of main's line that changed what serves the loop: for each op the
loop dispatches, the kernel its dispatch list at that commit serves at the loop's point
(a keep whose range leaves that point out changes nothing there, and is no stage).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from research import evaluation, workers
import workspace
from research.hardware import HARDWARE
from research.provenance import worker_provenance
from reviews.charts import compound_figure
from reviews.models import CompoundRun, Review
from runners.harness import compound
from runners.ops import get_op

# Seconds of timing a loop gets in all (the harness caps it on the CPU).
TIME_BUDGET_S = 10.0
# A run measures up to four loops of a handful of stages; each stage's process builds
# its loop once.
TIME_LIMIT_S = 1800
SEED_LABEL = "shipped baselines"


def request(hardware: str) -> CompoundRun | None:
    """Queue a run at main's head for `hardware` (none twice for one head). Called once a
    keep or undo is committed; None when that head already has its run."""
    from reviews.tasks import measure_compound  # the task module imports this one

    head = workspace.main_head()
    try:
        with transaction.atomic():
            run = CompoundRun.objects.create(hardware=hardware, main_commit=head,
                                             queue=HARDWARE[hardware].queue)
    except IntegrityError:
        return None
    measure_compound.apply_async(args=[run.pk], queue=run.queue)
    return run


def request_on_commit(hardware: str) -> None:
    """For a keep or undo in progress: the run is asked for once it is committed."""
    transaction.on_commit(lambda: request(hardware))


def _sizes(loop: str, device: str) -> dict[str, int]:
    """The loop's point along each op's size axis: the indexer's context, and rmsnorm's
    tokens (a decode step normalizes one token a sequence)."""
    context_length, batch = compound.point(loop, device)
    return {"context_length": context_length, "tokens": batch}


def _serving(op: str, hardware: str, commit: str, sizes: dict[str, int], seeded: str) -> str:
    """The source that serves `op` at `sizes` after `commit`: the first entry of its
    dispatch list there whose range holds the size (the shipped baseline holds all)."""
    for entry in workspace.dispatch_entries(op, hardware, commit):
        axis, low, high = entry.get("axis"), entry.get("min"), entry.get("max")
        size = sizes.get(axis) if axis else None
        if axis and (size is None or (low is not None and size < low) or (high is not None and size > high)):
            continue
        if entry.get("commit"):
            source = workspace.read_file(entry["commit"], entry.get("path") or workspace.kept_path(op, hardware))
            if source is not None:
                return source
        return seeded
    return seeded


def stages(hardware: str, loop: str, rev: str = workspace.MAIN) -> list[dict]:
    """The loop's stages on `hardware` up to `rev`, oldest first: {"label", "commit",
    "sources": {op: source}}; the first is the seed, with the shipped baselines."""
    ops = compound.loop_ops(loop)
    device = HARDWARE[hardware].device
    sizes = _sizes(loop, device)
    files = [workspace.kept_path(op, hardware) for op in ops]
    line = workspace.main_line(files, rev)
    if not line:
        return []
    seed, _ = line[0]
    seeded = {op: workspace.read_file(seed, workspace.kept_path(op, hardware))
              or get_op(op).baseline_path.read_text(encoding="utf-8") for op in ops}
    decisions = _decisions([commit for commit, _ in line])
    found: list[dict] = []
    for index, (commit, subject) in enumerate(line):
        sources = {op: _serving(op, hardware, commit, sizes, seeded[op]) for op in ops}
        if found and found[-1]["sources"] == sources:
            continue  # a keep or undo that does not change what serves this point
        # The first commit is the seed, or the move to kept kernels per class (which may
        # hold kernels kept before it): its own subject says which.
        label = SEED_LABEL if index == 0 and subject.startswith("Seed") else decisions.get(commit, subject)
        found.append({"label": label[:120], "commit": commit, "sources": sources})
    return found


def _decisions(commits: list[str]) -> dict[str, str]:
    """A short name for each commit that is a keep or an undo: what a chart's axis can hold
    ("keep rmsnorm 3-2 (blocked)"); the commit's subject says the rest."""
    names = {}
    for review in (Review.objects.filter(Q(merge_commit__in=commits) | Q(revert_commit__in=commits))
                   .select_related("candidate__sweep__thesis")):
        candidate = review.candidate
        what = f"{candidate.sweep.thesis.op} {candidate.label} ({candidate.sweep.kernel})"
        if review.merge_commit in commits:
            names[review.merge_commit] = f"keep {what}"
        if review.revert_commit in commits:
            names[review.revert_commit] = f"undo {what}"
    return names


def loops(hardware: str, rev: str = workspace.MAIN) -> dict[str, list[dict]]:
    """Each loop whose kernels a keep or undo ever changed on `hardware`, with its stages;
    the serving loop alone when only rmsnorm's did; none when nothing was ever kept."""
    found = {loop: stages(hardware, loop, rev) for loop in compound.LOOPS}
    changed = {loop: found_stages for loop, found_stages in found.items() if len(found_stages) > 1}
    indexer_changed = {loop: found_stages for loop, found_stages in changed.items()
                       if any(a["sources"][loop] != b["sources"][loop]
                              for a, b in zip(found_stages, found_stages[1:]))}
    if indexer_changed:
        return indexer_changed
    return {compound.SERVING_LOOP: changed[compound.SERVING_LOOP]} if changed else {}


class MeasureFailed(Exception):
    pass


def measure(run_id: int) -> CompoundRun | None:
    """The worker's part: measure a queued run, record its reports or why it failed."""
    run = CompoundRun.objects.filter(pk=run_id, status=CompoundRun.Status.QUEUED).first()
    if run is None:
        return None  # measured already, or sent again
    newer = CompoundRun.objects.filter(hardware=run.hardware, requested_at__gt=run.requested_at).first()
    reports = []
    try:
        if newer is not None:
            # A burst of keeps: the newest head's run measures every stage of this one too.
            raise MeasureFailed(f"superseded by the run at {newer.main_commit[:12]}")
        for loop, found in loops(run.hardware, run.main_commit).items():
            report = _run_harness(loop, found, device=HARDWARE[run.hardware].device)
            for stage, spec in zip(report["stages"], found, strict=True):
                stage["commit"] = spec["commit"]
            reports.append(report)
    except (MeasureFailed, workspace.WorkspaceError) as failure:
        run.status, run.error = CompoundRun.Status.FAILED, str(failure)[:2000]
    else:
        run.status, run.reports = CompoundRun.Status.DONE, reports
    run.provenance = worker_provenance(queue=run.queue)
    run.finished_at = timezone.now()
    run.save(update_fields=["status", "error", "reports", "provenance", "finished_at"])
    return run


def _run_harness(loop: str, found: list[dict], *, device: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="compound-") as scratch:
        folder = Path(scratch)
        document = {"loop": loop, "stages": []}
        for index, stage in enumerate(found):
            kernels = {}
            for op, source in stage["sources"].items():
                file = folder / str(index) / f"{op}.py"
                file.parent.mkdir(mode=0o755, exist_ok=True)
                file.write_text(source, encoding="utf-8")
                # The harness's unprivileged worker reads it through the jail.
                file.chmod(0o644)
                kernels[op] = f"{index}/{op}.py"
            document["stages"].append({"label": stage["label"], "kernels": kernels})
        stages_file = folder / "stages.json"
        stages_file.write_text(json.dumps(document), encoding="utf-8")
        try:
            report = evaluation.harness_json(
                ["-m", "runners.harness", "compound", str(stages_file), "--device", device, "--json",
                 "--time-budget", str(TIME_BUDGET_S)], timeout_s=TIME_LIMIT_S, what=f"the {loop} loop")
        except evaluation.HarnessFailed as failure:
            raise MeasureFailed(f"the {loop} loop could not be measured: {failure}") from None
    if len(report.get("stages") or []) != len(found):
        raise MeasureFailed(f"the harness's report of the {loop} loop does not have its {len(found)} stages")
    return report


def latest(hardware: str) -> tuple[CompoundRun | None, CompoundRun | None]:
    """The newest measured run of `hardware`, and a newer one still waiting or failed."""
    runs = CompoundRun.objects.filter(hardware=hardware)
    measured = runs.filter(status=CompoundRun.Status.DONE).first()
    newer = runs.exclude(status=CompoundRun.Status.DONE)
    if measured is not None:
        newer = newer.filter(requested_at__gte=measured.requested_at)
    return measured, newer.first()


def waterfalls() -> list[dict]:
    """What the path page shows for each hardware class that had a run asked for: its
    newest measured waterfall (a figure a loop), and a newer run still waiting (with
    whether a worker serves its queue) or failed."""
    found = []
    served = None
    for hardware in HARDWARE:
        measured, newer = latest(hardware)
        if measured is None and newer is None:
            continue
        waiting = newer is not None and newer.status == CompoundRun.Status.QUEUED
        if waiting and served is None:
            served = workers.live_queues()
        found.append({
            "hardware": hardware, "label": HARDWARE[hardware].label, "measured": measured,
            "newer": newer, "waiting": waiting,
            "unserved": waiting and served is not None and newer.queue not in served,
            "start_command": workers.start_command(newer.queue) if newer else "",
            "loops": [{"loop": report["loop"], "report": report, "figure": compound_figure(report),
                       "element": f"compound-{hardware}-{report['loop']}"}
                      for report in (measured.reports if measured else [])],
        })
    return found
