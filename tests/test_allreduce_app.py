"""The collective op through the app: a thesis for allreduce_sum on the CPU, a sweep of
its shipped one-shot kernel evaluated by a real Celery worker through the real harness
(two ranks, gloo), its result recorded with a dispatch range over message size, and the
review page drawing its curves along message size."""

from __future__ import annotations

import json
import re

import pytest

from research import evaluation
from research.models import Candidate, Sweep
from tests.celery_worker import cpu_worker, wait_until_finished
from tests.reviewing import make_people, make_thesis, start_sweep
from tests.reviewing import workspace_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db(transaction=True)

SIZES = [4096, 65536]
WORKLOADS = {f"bytes={size},dtype={dtype}" for size in SIZES for dtype in ("float32", "bfloat16")}


def _figures(page: str) -> list[dict]:
    """The Plotly figures a page embeds (json_script blocks)."""
    blocks = re.findall(r'<script id="[^"]*" type="application/json">(.*?)</script>', page, re.S)
    return [figure for figure in map(json.loads, blocks) if isinstance(figure, dict) and "layout" in figure]


def test_a_sweep_of_the_one_shot_allreduce_is_evaluated_recorded_and_reviewed_by_message_size(
        workspace_dir, client, monkeypatch):
    people = make_people()
    thesis = make_thesis(people.author, title="One-shot all-reduce through shared memory",
                         idea="Small messages skip gloo's per-call cost.", op="allreduce_sum",
                         context_lengths=SIZES, batch_sizes=[1])
    commands: list[list[str]] = []
    real_run = evaluation.subprocess.run

    def spying_run(command, **kwargs):
        if "runners.harness" in command:  # the workspace's git commands share the module
            commands.append(list(command))
        return real_run(command, **kwargs)

    monkeypatch.setattr(evaluation.subprocess, "run", spying_run)
    sweep = start_sweep(thesis, people.producer, budget=1, kernel="shared_memory_one_shot")
    assert sweep.queue == "runner.cpu"

    with cpu_worker():
        finished = wait_until_finished(sweep.pk, timeout_s=600)
    assert finished.status == Sweep.Status.FINISHED

    # The worker ran the harness's command line, the one a GPU host runs by hand.
    assert len(commands) == 1
    assert commands[0][1:5] == ["-m", "runners.harness", "evaluate", "allreduce_sum"]
    assert commands[0][commands[0].index("--ctx") + 1] == "4096,65536"

    candidate = Candidate.objects.get(sweep=sweep)
    assert candidate.status == Candidate.Status.DONE, candidate.error
    assert candidate.correct is True and candidate.verdict in {"win", "no-gain"}
    guards = {g["name"]: g["status"] for g in candidate.result["guards"]}
    assert guards["moves-data"] == "pass" and guards["correctness"] == "pass"
    timings = {m.workload: (m.baseline_ms, m.candidate_ms) for m in candidate.measurements.all()}
    assert set(timings) == WORKLOADS
    assert all(b > 0 and c > 0 for b, c in timings.values())
    # The dispatch range, when the candidate wins anywhere, is over message size.
    dispatch = candidate.result["dispatch"]
    if candidate.verdict == "win":
        assert dispatch["axis"] == "message_bytes" and set(dispatch["sizes"]) <= set(SIZES)
        assert "message size" in dispatch["summary"]
    else:
        assert dispatch is None

    client.force_login(people.reviewer)
    response = client.get(candidate.get_absolute_url())
    assert response.status_code == 200
    page = response.content.decode()
    figures = _figures(page)
    assert figures, "the review page embeds no figure"
    axes = [f["layout"]["xaxis"]["title"]["text"] for f in figures if "xaxis" in f["layout"]]
    curves = [axis for axis in axes if axis not in {"candidate", "candidate, in the order results came in"}]
    assert curves and all(axis == "message size (bytes per rank)" for axis in curves), axes
    # One curve per dtype, each point at a message size.
    xs = {x for f in figures for trace in f["data"] for x in trace.get("x", []) if isinstance(x, str)}
    assert {"4,096", "65,536"} <= xs
    assert "context length" not in page.lower()
    # The end-to-end tensor-parallel step, reported and shown as any op's end to end.
    e2e = candidate.result["e2e"]
    assert e2e["tensor_parallel"]["world_size"] == 2 and e2e["baseline_ms"] > 0
    assert "ms per decode step" in page and "no end-to-end check in this result" not in page
