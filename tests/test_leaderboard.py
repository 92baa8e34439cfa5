"""The leaderboard: kept wins, end-to-end speedup contributed, tried, hit rate, per period."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from research.models import Candidate
from reviews import selectors
from reviews.services import candidate_keep, candidate_revert
from tests.reviewing import make_reviewer, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, workspace_dir  # noqa: F401  (fixtures)


@pytest.fixture
def history(people, workspace_dir, no_enqueue):
    """ada: 3 tried, 1 kept (e2e 12 → 10 ms), 1 reverted; hedy: 1 tried on the indexer, kept.
    ada's third candidate was evaluated 40 days ago."""
    hedy = make_reviewer("hedy")
    ada_sweep = start_sweep(make_thesis(people.author), people.producer, budget=3)
    kept, reverted, old = ada_sweep.candidates.order_by("number")
    kept = record(kept, recorded_result(e2e={"baseline_ms": 12.0, "candidate_ms": 10.0, "delta_pct": -16.7}))
    reverted = record(reverted, recorded_result())
    record(old, recorded_result((1.0, 1.0, 1.0, 1.0)))
    Candidate.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(days=40))
    candidate_keep(candidate=kept, reviewer=people.reviewer, commit=kept.commit)
    candidate_revert(candidate=reverted, reviewer=people.reviewer, commit=reverted.commit)

    # On its GPU class: a CPU run of an op served on GPUs decides correctness only.
    indexer = make_thesis(hedy, title="Indexer", op="dsa_indexer_topk", hardware="h200",
                          context_lengths=[4096], batch_sizes=[1])
    theirs = start_sweep(indexer, people.producer, budget=1, kernel="chunked_topk").candidates.get()
    theirs = record(theirs, {**recorded_result((1.4,), names=["ctx=4096,m=1"], dispatch=None),
                             "op": "dsa_indexer_topk"})
    candidate_keep(candidate=theirs, reviewer=people.reviewer, commit=theirs.commit)


def _row(standings, label):
    return next(s for s in standings if s.label == label)


def test_it_counts_kept_wins_tried_candidates_hit_rate_and_end_to_end_per_engineer_and_op(history):
    board = selectors.leaderboard(days=None)
    ada, hedy = _row(board["engineers"], "ada"), _row(board["engineers"], "hedy")
    assert (ada.kept, ada.tried, ada.hit_rate) == (1, 3, pytest.approx(1 / 3))
    [cpu] = ada.e2e_per_hardware
    assert (cpu.hardware, cpu.factor, cpu.measured) == ("CPU (this machine)", pytest.approx(1.2), 1)
    assert (hedy.kept, hedy.tried, hedy.hit_rate, hedy.e2e_per_hardware) == (1, 1, 1.0, [])
    rmsnorm = _row(board["ops"], "rmsnorm")
    assert (rmsnorm.kept, rmsnorm.tried) == (1, 3)
    # Ranked by kept wins, then end-to-end speedup: ada's measured 1.2× comes first.
    assert [s.label for s in board["engineers"]] == ["ada", "hedy"]


def test_end_to_end_speedups_multiply_within_a_hardware_class_never_across(history, people):
    """A CPU decode step's 1.2× and an H200 step's 1.1× are two facts, not a 1.32× one."""
    gpu = make_thesis(people.author, title="H200 norm", hardware="h200")
    win = record(start_sweep(gpu, people.producer, budget=1).candidates.get(),
                 recorded_result(e2e={"baseline_ms": 11.0, "candidate_ms": 10.0, "delta_pct": -9.1}))
    candidate_keep(candidate=win, reviewer=people.reviewer, commit=win.commit)
    ada = _row(selectors.leaderboard(days=None)["engineers"], "ada")
    assert [(c.hardware, round(c.factor, 3), c.measured) for c in ada.e2e_per_hardware] == [
        ("CPU (this machine)", 1.2, 1), ("NVIDIA H200 (sm_90)", 1.1, 1)]


def test_the_period_filter_counts_only_candidates_evaluated_in_it(history):
    ada = _row(selectors.leaderboard(days=30)["engineers"], "ada")
    assert (ada.kept, ada.tried, ada.hit_rate) == (1, 2, 0.5)
    assert selectors.leaderboard(days=7, now=timezone.now() + timedelta(days=60)) == {"engineers": [], "ops": []}


def test_the_page_and_its_htmx_fragment_follow_the_period(client, people, history):
    client.force_login(people.outsider)
    page = client.get("/leaderboard/")
    assert page.status_code == 200 and b"Per engineer" in page.content
    fragment = client.get("/leaderboard/", {"period": "all"}, HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in fragment
    ada = fragment.split('id="by-engineer"')[1].split("</tr>")[1]
    assert 'class="num tried">3<' in ada and 'class="num hit-rate">33%<' in ada and "1.200×" in ada
