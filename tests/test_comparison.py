"""Two candidates side by side, and two waiting wins whose ranges overlap timed against
each other in a head-to-head that is never kept."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from config.celery import app
import workspace
from research.hardware import HARDWARE
from research.models import Candidate, Sweep
from reviews import comparison, retiming, selectors, services
from reviews.models import Review
from tests.reviewing import make_thesis, record, recorded_result, start_sweep
from tests.reviewing import people, workspace_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db

TOKENS_256 = {"axis": "tokens", "min": 256, "max": 256, "sizes": [256], "covers_all": False,
              "summary": "candidate for tokens 256–256, kept kernel below 256"}


@pytest.fixture
def cpu_queue(settings):
    """The CPU class's queue on this run's broker, declared as its worker declares it (the
    broker drops a message for a queue nobody declared) and empty: returns what was sent
    to it since, as (task name, its arguments)."""
    queue = HARDWARE["cpu"].queue
    with app.connection_for_write() as broker:
        app.amqp.queues[queue](broker.default_channel).declare()
    messages = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    messages.delete(queue)

    def sent() -> list[tuple[str, list]]:
        found = [json.loads(message) for message in reversed(messages.lrange(queue, 0, -1))]
        return [(m["headers"]["task"], json.loads(base64.b64decode(m["body"]))[0]) for m in found]

    yield sent
    messages.delete(queue)


@pytest.fixture
def two_wins(people, workspace_dir):
    """Candidates 1 and 2 of one rmsnorm sweep on the CPU (two sources), both waiting
    wins claiming tokens 64–64. (Their own evaluations are never sent: the test's
    transaction never commits.)"""
    sweep = start_sweep(make_thesis(people.author), people.producer)
    first, second = (record(sweep.candidates.get(number=n), recorded_result((1.30, 1.24 + n / 100, 1.02, 0.99)))
                     for n in (1, 2))
    assert set(selectors.review_queue()) == {first, second} and first.source != second.source
    return first, second


# -- side by side ------------------------------------------------------------------------

def test_the_comparison_aligns_both_candidates_workloads_and_diffs_their_sources(people, two_wins):
    first, second = two_wins
    compared = comparison.comparison(first, second)

    assert compared.left.candidate == first and compared.right.candidate == second
    assert compared.left.state == compared.right.state == "waiting"
    assert [guard.name for guard in compared.left.warnings] == ["cache-state"]
    assert compared.left.dispatch_text == "candidate for tokens 64–64, kept kernel beyond 64"
    assert [row.name for row in compared.rows] == ["t=64,dtype=float32", "t=64,dtype=bfloat16",
                                                   "t=256,dtype=float32", "t=256,dtype=bfloat16"]
    bf16 = compared.rows[1]
    assert (bf16.left.speedup, bf16.right.speedup) == (pytest.approx(1.25), pytest.approx(1.26))
    assert bf16.right.speedup_ci == (pytest.approx(1.26 * 0.97), pytest.approx(1.26 * 1.03))
    # The kernel file alone, from one commit to the other: only the point's values differ.
    assert [file.path for file in compared.diff] == [workspace.kept_path("rmsnorm", "cpu")]
    assert compared.diff[0].added >= 1 and compared.diff_error == "" and compared.hidden == []
    assert compared.overlap == "tokens 64–64" and compared.head_to_head_refusal == ""


def test_a_workload_only_one_thesis_measured_keeps_its_row_with_a_gap(people, two_wins):
    first, _ = two_wins
    wider = make_thesis(people.author, title="Longer rows", context_lengths=[64, 256, 1024])
    names = ["t=64,dtype=float32", "t=1024,dtype=float32"]
    other = record(start_sweep(wider, people.producer, budget=3).candidates.get(number=3),
                   recorded_result((1.2, 1.1), names=names))
    rows = comparison.comparison(first, other).rows
    assert [row.name for row in rows] == [*(w["name"] for w in first.result["workloads"]), "t=1024,dtype=float32"]
    assert rows[-1].left is None and rows[-1].right.speedup == pytest.approx(1.1)
    assert rows[1].right is None and rows[1].left.speedup == pytest.approx(1.25)


def test_candidates_of_another_op_or_hardware_class_or_the_same_one_are_not_compared(people, two_wins):
    first, second = two_wins
    gpu = start_sweep(make_thesis(people.author, title="On the H200", hardware="h200"),
                      people.producer).candidates.get(number=1)
    indexer = start_sweep(make_thesis(people.author, title="Indexer", op="dsa_indexer_topk",
                                      context_lengths=[4096], batch_sizes=[1]),
                          people.producer, budget=1, kernel="chunked_topk").candidates.get()
    for other, code, says in ((gpu, "other-hardware", "measured on CPU"),
                              (indexer, "other-op", "only kernels of one op compare"),
                              (first, "same", "compared with itself")):
        with pytest.raises(ValidationError, match=says) as refused:
            comparison.comparison(first, other)
        assert refused.value.code == code


def test_the_picker_offers_the_other_wins_of_the_op_and_class_with_where_they_stand(people, two_wins):
    first, second = two_wins
    kept = record(start_sweep(make_thesis(people.author, title="Kept"), people.producer, budget=3)
                  .candidates.get(number=3), recorded_result())
    services.candidate_keep(candidate=kept, reviewer=people.reviewer, commit=kept.commit)
    lost = record(start_sweep(make_thesis(people.author, title="Slow"), people.producer, budget=1)
                  .candidates.get(), recorded_result((1.0, 1.0, 1.0, 1.0)))
    gpu = record(start_sweep(make_thesis(people.author, title="On the H200", hardware="h200"), people.producer)
                 .candidates.get(number=1), recorded_result())

    offered = dict(comparison.choices(first))
    assert offered == {second: "stale", kept: "kept"}  # the keep made the other waiting win stale
    assert lost not in offered and gpu not in offered


# -- the head-to-head --------------------------------------------------------------------

def test_a_head_to_head_times_the_challenger_against_the_challenged_source_on_the_hardware_queue(
        people, two_wins, cpu_queue, django_capture_on_commit_callbacks):
    first, second = two_wins
    with django_capture_on_commit_callbacks(execute=True):
        run = comparison.head_to_head_start(challenged=first, challenger=second, requested_by=people.outsider)

    sweep = run.sweep
    assert sweep.strategy == Sweep.Strategy.HEAD_TO_HEAD
    assert (sweep.challenger, sweep.challenged, sweep.started_by) == (second, first, people.outsider)
    assert run.source == second.source and run.status == Candidate.Status.QUEUED
    assert sweep.baseline_source == first.source and sweep.baseline_kernel == first.sweep.kernel
    assert sweep.base_commit == first.commit and workspace.commit_info(run.commit)["parents"] == [first.commit]
    run.refresh_from_db()
    assert sweep.queue == "runner.cpu"
    assert cpu_queue() == [("research.tasks.evaluate_candidate", [run.pk, run.dispatch])]
    assert "where both claim to win (tokens 64–64)" in sweep.context
    # Both wins still wait; the run itself never does, whatever it finds.
    run = record(run, recorded_result())
    assert set(selectors.review_queue()) == {first, second}
    assert run not in selectors.review_queue(stale=True) and selectors.review_queue_count() == 2
    assert [duel.run for duel in comparison.head_to_heads(second, first)] == [run]


def test_a_head_to_head_is_refused_while_one_of_the_pair_waits_whichever_side_asks(people, two_wins):
    first, second = two_wins
    run = comparison.head_to_head_start(challenged=first, challenger=second, requested_by=people.producer)
    for challenged, challenger in ((first, second), (second, first)):
        with pytest.raises(ValidationError, match=f"head-to-head {run.label} of these two is queued already"):
            comparison.head_to_head_start(challenged=challenged, challenger=challenger,
                                          requested_by=people.producer)
    record(run, recorded_result())
    again = comparison.head_to_head_start(challenged=second, challenger=first, requested_by=people.producer)
    assert again.sweep.challenger == first and Sweep.objects.filter(strategy="head_to_head").count() == 2


def test_a_head_to_head_is_refused_for_ranges_that_do_not_overlap_and_says_which(
        people, two_wins, cpu_queue, django_capture_on_commit_callbacks):
    first, _ = two_wins
    apart = record(start_sweep(make_thesis(people.author, title="Long rows"), people.producer, budget=3)
                   .candidates.get(number=3), recorded_result((1.0, 1.0, 1.3, 1.3), dispatch=TOKENS_256))
    with (django_capture_on_commit_callbacks(execute=True),
          pytest.raises(ValidationError, match=f"their dispatch ranges do not overlap: {first.label} wins for "
                                               f"tokens 64–64, {apart.label} for tokens 256–256") as refused):
        comparison.head_to_head_start(challenged=first, challenger=apart, requested_by=people.producer)
    assert refused.value.code == "apart"
    assert not Sweep.objects.filter(strategy="head_to_head").exists() and cpu_queue() == []
    assert "do not overlap" in comparison.comparison(first, apart).head_to_head_refusal


def test_a_head_to_head_is_refused_for_archived_theses_decided_wins_and_losers(people, two_wins):
    first, second = two_wins
    archived = record(start_sweep(make_thesis(people.author, title="Shelved"), people.producer, budget=3)
                      .candidates.get(number=3), recorded_result())
    archived.sweep.thesis.archived_at = timezone.now()
    archived.sweep.thesis.save(update_fields=["archived_at"])
    with pytest.raises(ValidationError, match=f"the thesis of candidate {archived.label} is archived"):
        comparison.head_to_head_start(challenged=first, challenger=archived, requested_by=people.producer)

    lost = record(start_sweep(make_thesis(people.author, title="Slow"), people.producer, budget=1)
                  .candidates.get(), recorded_result((1.0, 1.0, 1.0, 1.0)))
    with pytest.raises(ValidationError, match=f"candidate {lost.label} is not a win"):
        comparison.head_to_head_start(challenged=lost, challenger=first, requested_by=people.producer)

    services.candidate_revert(candidate=second, reviewer=people.reviewer, commit=second.commit)
    with pytest.raises(ValidationError, match=f"candidate {second.label} is already decided"):
        comparison.head_to_head_start(challenged=first, challenger=second, requested_by=people.producer)
    assert not Sweep.objects.filter(strategy="head_to_head").exists()


def test_a_head_to_heads_win_is_neither_kept_nor_re_timed_nor_charted(people, two_wins):
    first, second = two_wins
    run = record(comparison.head_to_head_start(challenged=first, challenger=second, requested_by=people.producer),
                 recorded_result())
    main = workspace.main_head()
    with pytest.raises(ValidationError, match=f"a head-to-head is not keepable: it says which of {first.label} "
                                              f"and {second.label} is faster where") as refused:
        services.candidate_keep(candidate=run, reviewer=people.reviewer, commit=run.commit)
    assert refused.value.code == "not-waiting"
    assert not Review.objects.exists() and workspace.main_head() == main
    with pytest.raises(ValidationError, match="a head-to-head is never kept, so never re-timed"):
        retiming.retime_start(candidate=run, requested_by=people.producer)
    assert run.pk not in {point["candidate"] for point in selectors.path_points()}
    assert comparison.head_to_head_note(run).startswith("a head-to-head, not keepable")


# -- the pages ---------------------------------------------------------------------------

def test_the_review_page_links_the_comparison_which_shows_both_and_starts_the_head_to_head(
        client, people, two_wins, cpu_queue, django_capture_on_commit_callbacks):
    first, second = two_wins
    client.force_login(people.reviewer)
    review = client.get(first.get_absolute_url()).content.decode()
    assert 'id="compare-other"' in review and f'<option value="{second.pk}">{second.label} · waiting' in review
    picked = client.get(reverse("candidate_compare_pick", args=[first.pk]), {"with": second.pk})
    url = reverse("candidate_compare", args=[first.pk, second.pk])
    assert picked.status_code == 302 and picked["Location"] == url

    page = client.get(url).content.decode()
    assert 'id="side-a"' in page and 'id="side-b"' in page and 'data-workload="t=64,dtype=bfloat16"' in page
    assert 'table class="diff code" data-path="kernels/rmsnorm/cpu/kept.py"' in page
    assert 'id="time-against-each-other"' in page and "Both claim <strong>tokens 64–64</strong>" in page

    with django_capture_on_commit_callbacks(execute=True):
        started = client.post(reverse("candidate_head_to_head", args=[first.pk, second.pk]), follow=True)
    run = Candidate.objects.get(sweep__strategy="head_to_head")
    text = started.content.decode()
    assert started.redirect_chain == [(url, 302)] and f"timed against {first.label} as {run.label}" in text
    assert f'id="head-to-head-{run.pk}"' in text and '<span class="badge queued">queued</span>' in text
    assert f"Not offered: head-to-head {run.label} of these two is queued already" in text
    with django_capture_on_commit_callbacks(execute=True):
        again = client.post(reverse("candidate_head_to_head", args=[first.pk, second.pk]), follow=True)
    assert "Not timed against each other: head-to-head" in again.content.decode()
    assert Candidate.objects.filter(sweep__strategy="head_to_head").count() == 1 and len(cpu_queue()) == 1

    run = record(run, recorded_result())
    done = client.get(url).content.decode()
    assert f"{second.label} over {first.label} [CI]" in done
    assert f"{second.label} is faster: candidate for tokens 64–64" in done
    own = client.get(run.get_absolute_url()).content.decode()
    assert 'id="head-to-head-note"' in own and "not keepable: it says which of" in own
    assert 'id="decision-form"' not in own and 'id="retime"' not in own
    # Its curves name the win it was timed against, not the kept kernel.
    assert f"speedup over candidate {first.label} (" in own and f"Median time per call, candidate {first.label} vs" in own
    assert f'"name": "candidate {first.label}' in own and '"name": "kept' not in own
    sweep_page = client.get(run.sweep.get_absolute_url()).content.decode()
    assert f"{second.label}</a>'s source, against candidate" in sweep_page and "(not keepable)" in sweep_page


def test_the_comparison_page_refuses_other_classes_with_400_and_unknown_candidates_with_404(client, people,
                                                                                           two_wins):
    first, _ = two_wins
    gpu = start_sweep(make_thesis(people.author, title="On the H200", hardware="h200"),
                      people.producer).candidates.get(number=1)
    client.force_login(people.outsider)
    refused = client.get(reverse("candidate_compare", args=[first.pk, gpu.pk]))
    assert refused.status_code == 400 and "kernels are kept per hardware class" in refused.content.decode()
    assert client.get(reverse("candidate_compare", args=[first.pk, 999_999])).status_code == 404
    assert client.get(reverse("candidate_compare_pick", args=[first.pk]), {"with": "x"}).status_code == 400
    posted = client.post(reverse("candidate_head_to_head", args=[first.pk, gpu.pk]), follow=True)
    assert "Not timed against each other" in posted.content.decode()
    assert not Sweep.objects.filter(strategy="head_to_head").exists()
    client.logout()
    assert client.get(reverse("candidate_compare", args=[first.pk, gpu.pk])).status_code == 302  # to the login


def test_the_comparison_page_shows_each_sides_end_to_end_delta_and_failed_guards(client, people, two_wins):
    first, _ = two_wins
    result = recorded_result(e2e={"baseline_ms": 2.0, "candidate_ms": 1.8})
    result["guards"].append({"name": "plausibility", "status": "warn", "detail": "more than 10x: read it first"})
    other = record(start_sweep(make_thesis(people.author, title="End to end"), people.producer, budget=3)
                   .candidates.get(number=3), result)
    client.force_login(people.reviewer)
    page = client.get(reverse("candidate_compare", args=[first.pk, other.pk])).content.decode()
    side_a, side_b = page.split('id="side-a"')[1].split('id="side-b"')
    assert "not measured" in side_a and "faster</strong>\n  per decode step: 2.000 → 1.800 ms (-10.00 % time)" in side_b
    assert "scrutiny" in side_b and "scrutiny" not in side_a
