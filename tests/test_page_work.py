"""The sweep, review and dashboard pages' own work: queries that do not grow with what a
page lists (an N+1 coming back fails here), and the fragments kept in the cache, drawn
once for what they show and drawn again when that changes."""

from __future__ import annotations

import re

import pytest
from django.core.cache import cache
from django.db import connection
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import workspace
from research import result_rows
from reviews import queue_count, services
from research.models import Candidate, Measurement
from tests.reviewing import (make_reviewer, make_thesis, people, record, recorded_result, start_sweep,  # noqa: F401
                             no_enqueue, waiting_win, workspace_dir)

pytestmark = pytest.mark.django_db

# What differs between two renders of one page by design: the CSRF token of each answer.
_PER_ANSWER = re.compile(r'(csrfmiddlewaretoken" value=|"X-CSRFToken": |nonce=)"[^"]*"')


def _speedups(number: int) -> tuple[float, ...]:
    return (1.0 + number / 100, 1.24, 1.02, 0.97 - number / 1000)


def _recorded_sweep(people, results: int):
    sweep = start_sweep(make_thesis(people.author, title=f"{results} results"), people.producer, budget=results)
    for candidate in sweep.candidates.order_by("number"):
        record(candidate, recorded_result(_speedups(candidate.number)))
    return sweep


def _queries(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200, url
    return len(queries.captured_queries)


def _page(client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200
    return _PER_ANSWER.sub("", response.content.decode())


@pytest.fixture
def reviewer_client(client, people):
    client.force_login(people.reviewer)
    return client


def test_the_sweep_page_asks_as_many_queries_for_3_results_as_for_24(people, workspace_dir, no_enqueue,
                                                                     reviewer_client):
    small, large = _recorded_sweep(people, 3), _recorded_sweep(people, 24)

    def drawn_anew(url: str) -> int:
        cache.clear()
        return _queries(reviewer_client, url)

    def kept(url: str) -> int:
        reviewer_client.get(url)  # the first request fills what the page keeps
        return _queries(reviewer_client, url)

    for small_url, large_url in [(small.get_absolute_url(), large.get_absolute_url()),
                                 (reverse("sweep_results", args=[small.pk]), reverse("sweep_results", args=[large.pk])),
                                 (reverse("sweep_chart", args=[small.pk]), reverse("sweep_chart", args=[large.pk]))]:
        assert drawn_anew(small_url) == drawn_anew(large_url), large_url
        assert kept(small_url) == kept(large_url), large_url


def test_the_review_page_and_dashboard_ask_no_more_queries_as_wins_and_sweeps_add_up(people, workspace_dir,
                                                                                     no_enqueue, reviewer_client):
    def another_win(title: str) -> Candidate:
        return record(start_sweep(make_thesis(people.author, title=title), people.producer).candidates.get(number=1),
                      recorded_result())

    first = another_win("First")
    another_win("Second")  # the review page has one to compare with, so asks about it
    review, dashboard = reverse("candidate_review", args=[first.pk]), reverse("dashboard")
    reviewer_client.get(review)
    before = _queries(reviewer_client, review), _queries(reviewer_client, dashboard)
    # Eight more wins of the op: each one the review page offers to compare with, each
    # thesis and sweep one more line of the dashboard.
    for n in range(8):
        another_win(f"Other {n}")
    assert (_queries(reviewer_client, review), _queries(reviewer_client, dashboard)) == before


def _navigation_count(client) -> int:
    return int(re.search(r'id="review-count"[^>]*>(\d+)</span>', _page(client, reverse("dashboard"))).group(1))


def test_the_navigations_review_count_is_counted_once_per_change_of_the_queue(
        waiting_win, people, reviewer_client, monkeypatch, django_capture_on_commit_callbacks):
    counted: list[int] = []
    count = queue_count.review_queue_count
    monkeypatch.setattr(queue_count, "review_queue_count", lambda: counted.append(count()) or counted[-1])

    assert _navigation_count(reviewer_client) == 1 and counted == [1]
    assert _navigation_count(reviewer_client) == 1 and counted == [1]  # kept: no count on the next pages
    # A new win waits: the next page counts it.
    with django_capture_on_commit_callbacks(execute=True):
        another = record(start_sweep(make_thesis(people.author, title="Another"), people.producer)
                         .candidates.get(number=1), recorded_result())
    assert _navigation_count(reviewer_client) == 2 and counted == [1, 2]
    # A keep takes one off the queue (and makes the other win stale: timed against a kernel
    # no longer kept), on the next page too.
    with django_capture_on_commit_callbacks(execute=True):
        services.candidate_keep(candidate=another, reviewer=people.reviewer, commit=another.commit)
    assert _navigation_count(reviewer_client) == 0 and counted == [1, 2, 0]
    assert _navigation_count(reviewer_client) == 0 and counted == [1, 2, 0]


def test_a_count_made_while_the_queue_changes_is_never_shown_after_the_change(waiting_win, people, reviewer_client,
                                                                              monkeypatch):
    # A page counts the old queue (1), but a revert and its news land before it stores
    # the number: what it stores belongs to the old generation, and the next page counts anew.
    count = queue_count.review_queue_count

    def counted_before_a_change() -> int:
        number = count()
        services.candidate_revert(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit)
        queue_count.forget()  # what the revert's on_commit does (reviews.live)
        return number

    monkeypatch.setattr(queue_count, "review_queue_count", counted_before_a_change)
    assert _navigation_count(reviewer_client) == 1
    monkeypatch.setattr(queue_count, "review_queue_count", count)
    assert _navigation_count(reviewer_client) == 0


def test_a_result_row_is_drawn_once_and_again_only_when_what_it_shows_changes(people, workspace_dir, no_enqueue,
                                                                              reviewer_client, monkeypatch):
    sweep = _recorded_sweep(people, 3)
    fresh = _page(reviewer_client, sweep.get_absolute_url())  # every row drawn now
    drawn: list[int] = []
    draw = result_rows.render_to_string
    monkeypatch.setattr(result_rows, "render_to_string",
                        lambda name, context: drawn.append(context["row"].number) or draw(name, context))

    # The measurements read whole: only those of the rows drawn (the key needs one line each).
    read: list[int] = []
    post_init.connect(lambda sender, instance, **kw: read.append(instance.candidate_id), sender=Measurement,
                      weak=False, dispatch_uid="test_page_work.read")
    try:
        assert _page(reviewer_client, sweep.get_absolute_url()) == fresh and drawn == [] and read == []
        # Candidate 2's speedup on its first workload changes (as a re-record would): that
        # row, and only it, is drawn again, and the page shows the new figure.
        Measurement.objects.filter(candidate__sweep=sweep, candidate__number=2, position=0).update(speedup=1.777)
        changed = _page(reviewer_client, sweep.get_absolute_url())
        second = sweep.candidates.get(number=2).pk
        assert drawn == [2] and "1.78×" in changed and changed != fresh and read == [second] * 4
        # A change of significance alone is a change of what the row shows too.
        Measurement.objects.filter(candidate=second, position=1).update(significant=False)
        assert _page(reviewer_client, sweep.get_absolute_url()) != changed and drawn == [2, 2]
        Measurement.objects.filter(candidate=second, position=1).update(significant=True)
        # Drawn from the cache or not, the page is the same HTML.
        cache.clear()
        drawn.clear()
        read.clear()
        assert _page(reviewer_client, sweep.get_absolute_url()) == changed and drawn == [1, 2, 3]
        assert len(read) == 3 * 4
    finally:
        post_init.disconnect(sender=Measurement, dispatch_uid="test_page_work.read")


def test_a_result_row_is_drawn_again_when_its_verdict_or_error_changes(people, workspace_dir, no_enqueue,
                                                                       reviewer_client):
    sweep = _recorded_sweep(people, 2)

    def row() -> str:
        return re.search(r'<tr id="candidate-1".*?</tr>', _page(reviewer_client, sweep.get_absolute_url()),
                         re.S).group(0)

    assert "rejected" not in row()
    Candidate.objects.filter(sweep=sweep, number=1).update(verdict="rejected", error="the clock guard failed")
    assert 'class="verdict-rejected"' in row() and "the clock guard failed" in row()


def test_a_reviews_diffs_are_made_once_per_pair_of_commits(waiting_win, people, reviewer_client, monkeypatch):
    url = reverse("candidate_review", args=[waiting_win.pk])
    fresh = _page(reviewer_client, url)
    assert 'class="diff code"' in fresh and '<tr class="add">' in fresh
    made: list[tuple[str, str]] = []
    diff = workspace.diff
    monkeypatch.setattr(workspace, "diff", lambda base, head, **kw: made.append((base, head)) or diff(base, head, **kw))

    assert _page(reviewer_client, url) == fresh and made == []
    cache.clear()
    # Made again once the cache is gone: the diff shown and the hidden characters the form
    # asks about (against the kept kernel), and the candidate's own commit.
    parent = workspace.commit_info(waiting_win.commit)["parents"][0]
    assert _page(reviewer_client, url) == fresh
    assert sorted(made) == sorted([(waiting_win.sweep.base_commit, waiting_win.commit)] * 2
                                  + [(parent, waiting_win.commit)])


def test_a_diff_that_could_not_be_made_is_tried_again_on_the_next_visit(waiting_win, reviewer_client, monkeypatch):
    url = reverse("candidate_review", args=[waiting_win.pk])
    calls: list[str] = []

    def broken(base, head, **kw):
        calls.append(head)
        raise workspace.WorkspaceError("git diff failed: the object store is locked")

    monkeypatch.setattr(workspace, "diff", broken)
    assert "the object store is locked" in _page(reviewer_client, url)
    assert "the object store is locked" in _page(reviewer_client, url)
    assert len(calls) == 4  # the diff shown and the hidden characters, asked of git at each visit
