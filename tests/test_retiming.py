"""Stale wins: a keep that replaces the kernel a waiting win was timed against takes that
win out of the queue at once, and one click times its source again against today's kept
kernel, in a sweep of its own whose result can be kept."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

import workspace
from research.models import Candidate, Sweep
from reviews import retiming, selectors, services
from tests.reviewing import make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, workspace_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_wins(people, workspace_dir, no_enqueue):
    """Two waiting wins of rmsnorm on the CPU, both timed against the baseline; the first kept."""
    first = record(start_sweep(make_thesis(people.author), people.producer).candidates.get(number=1),
                   recorded_result())
    second = record(start_sweep(make_thesis(people.author, title="Another"), people.producer)
                    .candidates.get(number=2), recorded_result())
    assert set(selectors.review_queue()) == {first, second} and not retiming.stale_reason(second)
    services.candidate_keep(candidate=first, reviewer=people.reviewer, commit=first.commit)
    return first, second


def test_a_keep_makes_the_other_waiting_win_of_its_op_and_class_stale(people, two_wins):
    first, second = two_wins
    assert list(selectors.review_queue()) == [] and selectors.review_queue_count() == 0
    assert list(selectors.review_queue(stale=True)) == [second]
    assert "no longer the kept rmsnorm kernel on" in retiming.stale_reason(second)
    # Keeping it anyway is what the queue spares the reviewer: the merge refuses it.
    with pytest.raises(ValidationError, match="no longer kept"):
        services.candidate_keep(candidate=second, reviewer=people.reviewer, commit=second.commit)


def test_a_win_of_another_hardware_class_is_not_made_stale(people, two_wins, settings):
    first, _ = two_wins
    gpu = record(start_sweep(make_thesis(people.author, title="On the H200", hardware="h200"), people.producer)
                 .candidates.get(number=1), recorded_result())
    assert gpu in selectors.review_queue() and retiming.stale_reason(gpu) is None


def test_re_timing_measures_the_same_source_against_todays_kept_kernel_and_its_win_can_be_kept(people, two_wins,
                                                                                               client):
    first, second = two_wins
    run = retiming.retime_start(candidate=second, requested_by=people.producer)

    sweep = run.sweep
    kept = workspace.kept_kernel("rmsnorm", "cpu")
    assert sweep.strategy == Sweep.Strategy.RETIME and sweep.retimes == second
    # The sweep page says what runs against what (it once read "… kernel of candidate
    # 1-2's source, against the kept blocked").
    client.force_login(people.producer)
    line = client.get(sweep.get_absolute_url()).content.decode()
    assert (f"Re-timed against a newer kept kernel (<code>{sweep.baseline_kernel}</code>): "
            f"the source of candidate <a href=\"{second.get_absolute_url()}\">{second.label}</a>") in line
    assert run.source == second.source and run.status == Candidate.Status.QUEUED
    assert sweep.baseline_source == kept.source == first.source and sweep.base_commit == kept.commit
    assert workspace.commit_info(run.commit)["parents"] == [kept.commit]
    with pytest.raises(ValidationError, match="is queued already"):
        retiming.retime_start(candidate=second, requested_by=people.producer)

    run = record(run, recorded_result())
    assert run in selectors.review_queue() and retiming.stale_reason(run) is None
    assert list(selectors.review_queue(stale=True)) == []  # its re-time's result is what waits
    review = services.candidate_keep(candidate=run, reviewer=people.reviewer, commit=run.commit)
    assert workspace.kept_kernel("rmsnorm", "cpu").source == second.source and review.merge_commit


def test_only_an_undecided_stale_win_is_re_timed(people, two_wins):
    first, second = two_wins
    with pytest.raises(ValidationError, match="already decided"):
        retiming.retime_start(candidate=first, requested_by=people.producer)
    fresh = record(start_sweep(make_thesis(people.author, title="Fresh"), people.producer).candidates.get(number=1),
                   recorded_result())
    with pytest.raises(ValidationError, match="nothing to re-time"):
        retiming.retime_start(candidate=fresh, requested_by=people.producer)
    lost = record(start_sweep(make_thesis(people.author, title="Slow"), people.producer).candidates.get(number=1),
                  recorded_result(speedups=(1.0, 1.0, 1.0, 1.0)))
    with pytest.raises(ValidationError, match="only a win"):
        retiming.retime_start(candidate=lost, requested_by=people.producer)


def test_the_queue_and_the_page_offer_the_re_time_and_the_button_starts_it(client, people, two_wins):
    first, second = two_wins
    client.force_login(people.reviewer)
    queue = client.get(reverse("review_queue")).content.decode()
    assert f'id="stale-{second.pk}"' in queue and f'id="queue-{second.pk}"' not in queue
    page = client.get(second.get_absolute_url()).content.decode()
    assert 'id="stale-note"' in page and 'id="decision-form"' not in page

    answer = client.post(reverse("candidate_retime", args=[second.pk]))
    run = Candidate.objects.get(sweep__retimes=second)
    assert answer.status_code == 302 and answer["Location"] == run.sweep.get_absolute_url()
    again = client.post(reverse("candidate_retime", args=[second.pk]), follow=True)
    assert "Not re-timed: re-time" in again.content.decode()
    assert Candidate.objects.filter(sweep__retimes=second).count() == 1
