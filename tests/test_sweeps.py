"""Sweeps: starting one, recording results exactly once, the stored event stream."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from research import candidates, charts, queueing, selectors, sweeps
from research.models import Candidate, Event, Sweep
from runners import space
from runners.ops import get_op

pytestmark = pytest.mark.django_db(transaction=True)


def _result(verdict="no-gain", speedups=(1.0, 1.0)):
    return {
        "op": "rmsnorm", "device": "cpu", "verdict": verdict, "correct": verdict != "rejected",
        "guards": [{"name": "correctness", "status": "pass", "detail": "3 seeds × 2 distributions"}],
        "workloads": [
            {"name": f"w{i}", "baseline_ms": 1.0, "candidate_ms": 1.0 / s, "speedup": s,
             "speedup_ci": [s * 0.99, s * 1.01], "p_value": 0.001, "significant": s > 1.05}
            for i, s in enumerate(speedups)
        ],
        "e2e": None, "dispatch": None, "error": None,
    }


@pytest.fixture
def started_sweep(make_thesis, user, monkeypatch):
    # These tests drive the services directly; the worker path has its own test.
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
    thesis = make_thesis()
    return sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=3)


def test_a_grid_sweep_materialises_one_candidate_file_per_point(started_sweep):
    kernel_source = get_op("rmsnorm").kernels()["blocked"].read_text()
    points = space.grid_points(space.read_literals(kernel_source)[1])[:3]
    candidates = list(started_sweep.candidates.all())
    assert [c.params for c in candidates] == points
    assert all(c.status == Candidate.Status.QUEUED for c in candidates)
    # Each candidate is a real file whose PARAMS literal carries its point.
    for candidate in candidates:
        namespace: dict = {}
        exec(compile(candidate.source, "candidate.py", "exec"), namespace)  # noqa: S102 — our own kernel
        assert namespace["PARAMS"] == candidate.params
    assert started_sweep.queue == "runner.cpu" and started_sweep.total == 3


def test_a_random_sweep_never_repeats_a_point(make_thesis, user, monkeypatch):
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
    sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked",
                                 strategy="random", budget=5)
    params = [tuple(sorted(c.params.items())) for c in sweep.candidates.all()]
    assert len(params) == len(set(params)) == 5


@pytest.mark.parametrize("field, kwargs", [
    ("kernel", {"kernel": "nope"}),
    ("strategy", {"strategy": "annealing"}),
    ("budget", {"budget": 0}),
    ("budget", {"budget": 10_000}),
    ("kernel", {"kernel": "rows_triton"}),  # the thesis requires torch
])
def test_it_refuses_a_bad_sweep_and_stores_nothing(make_thesis, user, field, kwargs):
    fields = {"kernel": "blocked", "strategy": "grid", "budget": 2, **kwargs}
    with pytest.raises(ValidationError) as error:
        sweeps.sweep_start(thesis=make_thesis(), started_by=user, **fields)
    assert field in error.value.message_dict
    assert not Sweep.objects.exists() and not Candidate.objects.exists()


def test_it_refuses_a_sweep_on_hardware_that_cannot_run_the_thesis_workloads(make_thesis, user):
    # Filed for the H200 with its default context lengths (up to 256K): beyond the CPU's.
    thesis = make_thesis(op="dsa_indexer_topk", hardware="h200", context_lengths=None, batch_sizes=None)
    assert max(thesis.context_lengths) > max(get_op("dsa_indexer_topk").default_context_lengths("cpu"))
    with pytest.raises(ValidationError) as error:
        sweeps.sweep_start(thesis=thesis, started_by=user, kernel="chunked_topk", strategy="grid",
                             budget=2, hardware="cpu")
    assert "above dsa_indexer_topk's maximum" in " ".join(error.value.message_dict["hardware"])
    assert not Sweep.objects.exists() and not Candidate.objects.exists()


def test_a_sweep_started_before_such_sweeps_were_refused_still_has_its_page(logged_in_client, started_sweep):
    # An H200 thesis's 256K context on the CPU queue, as a sweep made before the refusal
    # above: the CPU cannot make its workloads.
    thesis = started_sweep.thesis
    thesis.op, thesis.hardware, thesis.context_lengths = "dsa_indexer_topk", "h200", [262144]
    thesis.save(update_fields=["op", "hardware", "context_lengths"])
    assert selectors.sweep_workload_names(started_sweep) == []
    assert logged_in_client.get(started_sweep.get_absolute_url()).status_code == 200
    assert logged_in_client.get(reverse("sweep_chart", args=[started_sweep.pk])).status_code == 200


def test_a_result_is_recorded_once_even_when_delivered_twice(started_sweep):
    candidate = started_sweep.candidates.first()
    assert candidates.candidate_claim(candidate_id=candidate.pk) is not None
    assert candidates.candidate_record_result(candidate_id=candidate.pk, result=_result("win", (1.5, 1.1)))
    assert not candidates.candidate_record_result(candidate_id=candidate.pk, result=_result())
    candidate.refresh_from_db()
    assert candidate.verdict == "win" and candidate.measurements.count() == 2
    assert candidate.best_speedup == pytest.approx(1.5)
    assert candidate.geomean_speedup == pytest.approx((1.5 * 1.1) ** 0.5)
    assert Sweep.objects.get(pk=started_sweep.pk).done == 1


def test_a_claimed_candidate_cannot_be_claimed_after_it_is_recorded(started_sweep):
    candidate = started_sweep.candidates.first()
    candidates.candidate_claim(candidate_id=candidate.pk)
    candidates.candidate_record_result(candidate_id=candidate.pk, result=_result())
    assert candidates.candidate_claim(candidate_id=candidate.pk) is None


def test_a_candidate_that_kills_its_worker_three_times_ends_failed(started_sweep):
    candidate = started_sweep.candidates.first()
    for _ in range(candidates.MAX_ATTEMPTS):  # each claim is a delivery whose worker then died
        assert candidates.candidate_claim(candidate_id=candidate.pk) is not None
    assert candidates.candidate_claim(candidate_id=candidate.pk) is None
    candidate.refresh_from_db()
    assert candidate.status == Candidate.Status.FAILED and candidate.verdict == "rejected"
    assert "3 times" in candidate.error


def test_events_are_numbered_without_gaps_and_finish_the_sweep(started_sweep):
    for candidate in started_sweep.candidates.all():
        candidates.candidate_claim(candidate_id=candidate.pk)
        candidates.candidate_record_result(candidate_id=candidate.pk, result=_result())
    events = list(Event.objects.filter(sweep=started_sweep))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    types = [e.type for e in events]
    assert types[0] == "sweep.created" and types[1] == "sweep.started"
    assert types.count("candidate.result") == 3 and types[-1] == "sweep.finished"
    sweep = Sweep.objects.get(pk=started_sweep.pk)
    assert sweep.status == Sweep.Status.FINISHED and sweep.last_seq == len(events)
    assert events[-1].payload == {"done": 3, "total": 3, "wins": 0, "rejected": 0, "stop_reason": ""}


def test_the_events_endpoint_returns_what_came_after_a_seq(logged_in_client, started_sweep):
    candidate = started_sweep.candidates.first()
    candidates.candidate_claim(candidate_id=candidate.pk)
    url = reverse("sweep_events", args=[started_sweep.pk])
    body = logged_in_client.get(url, {"after": 1}).json()
    assert [e["seq"] for e in body["events"]] == [2, 3]
    first = body["events"][0]
    assert {k: v for k, v in first.items() if k != "at"} == {"sweep": started_sweep.pk, "seq": 2,
                                                              "type": "sweep.started", "payload": {"total": 3}}
    # Each event says when it was recorded, in UTC.
    recorded = Event.objects.get(sweep=started_sweep, seq=2).created_at
    assert datetime.fromisoformat(first["at"]) == recorded.replace(microsecond=0) and first["at"].endswith("+00:00")


def test_the_page_says_since_when_a_candidate_has_been_evaluated(started_sweep):
    from research.frames import event_frame

    candidates.candidate_claim(candidate_id=started_sweep.candidates.first().pk)
    started = Event.objects.get(sweep=started_sweep, type="candidate.started")
    html = event_frame(started.as_message())["html"]
    at = started.created_at.strftime("%H:%M:%S")
    assert "Evaluating candidate 1" in html and f"since {at} UTC" in html


def test_the_events_endpoint_refuses_a_seq_that_is_not_a_number(logged_in_client, started_sweep):
    url = reverse("sweep_events", args=[started_sweep.pk])
    assert logged_in_client.get(url, {"after": "-1"}).status_code == 400


def test_the_sweep_page_shows_progress_rows_and_the_chart(logged_in_client, started_sweep):
    candidate = started_sweep.candidates.first()
    candidates.candidate_claim(candidate_id=candidate.pk)
    candidates.candidate_record_result(candidate_id=candidate.pk, result=_result("win", (1.5, 1.1)))
    html = logged_in_client.get(started_sweep.get_absolute_url()).content.decode()
    assert 'id="candidate-1"' in html and "1.50×" in html
    assert '<progress value="1" max="3">' in html
    assert f'data-last-seq="{Sweep.objects.get(pk=started_sweep.pk).last_seq}"' in html
    # The chart's figure comes after the page, from the chart's JSON.
    assert f'data-figure-url="{reverse("sweep_chart", args=[started_sweep.pk])}"' in html
    chart = logged_in_client.get(reverse("sweep_chart", args=[started_sweep.pk])).json()
    assert [trace["y"] for trace in chart["data"]] == [[1.5], [1.1], [], []]  # the sweep's four workloads


def test_the_results_partial_returns_rows_after_a_number_without_the_page(logged_in_client, started_sweep):
    for candidate in started_sweep.candidates.all():
        candidates.candidate_claim(candidate_id=candidate.pk)
        candidates.candidate_record_result(candidate_id=candidate.pk, result=_result())
    url = reverse("sweep_results", args=[started_sweep.pk])
    html = logged_in_client.get(url, {"after": 1}, HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in html
    assert 'id="candidate-1"' not in html and 'id="candidate-2"' in html and 'id="candidate-3"' in html


def test_the_chart_counts_candidates_in_whole_numbers_and_says_when_it_has_nothing(logged_in_client,
                                                                                  started_sweep):
    empty = logged_in_client.get(reverse("sweep_chart", args=[started_sweep.pk])).json()["layout"]
    # Ticks at whole candidates over the sweep's own span (rounded halves read "1 1 1 2 2 2").
    assert (empty["xaxis"]["tick0"], empty["xaxis"]["dtick"], empty["xaxis"]["range"]) == (1, 1, [0.5, 3.5])
    assert "tickformat" not in empty["xaxis"]
    assert [a["text"] for a in empty["annotations"]] == ["no result yet: speedups appear as candidates finish"]
    assert empty["yaxis"]["title"]["text"] == "speedup over the kept kernel (×)"
    candidate = started_sweep.candidates.first()
    candidates.candidate_claim(candidate_id=candidate.pk)
    candidates.candidate_record_result(candidate_id=candidate.pk, result=_result("win", (1.5, 1.1)))
    drawn = logged_in_client.get(reverse("sweep_chart", args=[started_sweep.pk])).json()["layout"]
    assert drawn["annotations"] == []
    assert charts.sweep_speedup_figure(["w"], [], 95)["layout"]["xaxis"]["dtick"] == 10


def test_the_chart_endpoint_has_one_trace_per_workload(logged_in_client, started_sweep):
    candidate = started_sweep.candidates.first()
    candidates.candidate_claim(candidate_id=candidate.pk)
    candidates.candidate_record_result(candidate_id=candidate.pk, result=_result("win", (1.5, 1.1)))
    figure = logged_in_client.get(reverse("sweep_chart", args=[started_sweep.pk])).json()
    assert len(figure["data"]) == len(selectors.sweep_workload_names(started_sweep))
    assert figure["data"][0]["x"] == [1] and figure["data"][0]["y"] == [1.5]


def test_starting_a_sweep_from_the_thesis_page_redirects_to_it(logged_in_client, make_thesis, monkeypatch):
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
    thesis = make_thesis()
    url = reverse("sweep_start", args=[thesis.pk])
    response = logged_in_client.post(url, {"kernel": "blocked", "strategy": "grid", "budget": 2, "hardware": "cpu"},
                                     HTTP_HX_REQUEST="true")
    sweep = Sweep.objects.get()
    assert response["HX-Redirect"] == sweep.get_absolute_url()
    bad = logged_in_client.post(url, {"kernel": "blocked", "strategy": "grid", "budget": 0, "hardware": "cpu"},
                                HTTP_HX_REQUEST="true")
    assert bad.status_code == 422 and 'id="sweep-form"' in bad.content.decode()
    assert Sweep.objects.count() == 1
