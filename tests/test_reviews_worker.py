"""Kept wins accumulate: after a keep, the next sweep is timed against the kept kernel,
by a real Celery worker through the real broker and the real harness."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from research import evaluation, queueing
from research.models import Candidate
from reviews import compounding
from reviews.services import candidate_keep
from tests.celery_worker import cpu_worker, wait_until_finished
from tests.reviewing import make_people, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import workspace_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def test_after_a_keep_the_next_evaluation_is_timed_against_the_kept_kernel(workspace_dir, monkeypatch):
    people = make_people()
    thesis = make_thesis(people.author, context_lengths=[64], batch_sizes=[1])
    with monkeypatch.context() as patch:
        patch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
        first = start_sweep(thesis, people.producer, budget=1)
        kept = record(first.candidates.get(), recorded_result(
            (1.3, 1.2), names=["t=64,dtype=float32", "t=64,dtype=bfloat16"]))
        # The keep's kernels-compound run (tests/test_compound.py) would be the worker's
        # first task, minutes long on a loaded host: here the evaluation is its only one.
        patch.setattr(compounding, "request_on_commit", lambda hardware: None)
        candidate_keep(candidate=kept, reviewer=people.reviewer, commit=kept.commit)

    baselines: list[tuple[str, str]] = []
    real_run = subprocess.run

    def spying_run(command, **kwargs):
        # Read the baseline file while it exists: the evaluation deletes it afterwards.
        if "--baseline" in command:
            path = Path(command[command.index("--baseline") + 1])
            baselines.append((path.name, path.read_text()))
        return real_run(command, **kwargs)

    monkeypatch.setattr(evaluation.subprocess, "run", spying_run)
    second = start_sweep(thesis, people.producer, budget=1)
    assert second.baseline_source == kept.source and second.baseline_kernel == "blocked"

    with cpu_worker():
        wait_until_finished(second.pk)

    candidate = Candidate.objects.get(sweep=second)
    assert candidate.status == Candidate.Status.DONE, candidate.error
    assert candidate.correct is True and all(m.baseline_ms > 0 for m in candidate.measurements.all())
    # The harness was handed the kept kernel, named so its DSL (torch) is read from it.
    assert baselines == [("blocked.py", kept.source)]
