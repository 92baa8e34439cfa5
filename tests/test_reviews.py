"""Keep or revert: four eyes, revisions, the merge into the workspace, the queue, the page."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.urls import reverse

from research import candidates
import workspace
from research.models import Candidate, GuardFinding
from runners.ops import get_op
from reviews import selectors, services
from research.hidden_characters import hidden_characters
from reviews.diffs import render_diff
from reviews.models import Review
from tests.reviewing import make_reviewer, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, waiting_win, workspace_dir  # noqa: F401  (fixtures)


def _decide(client, user, candidate, *, htmx: bool = False, **fields):
    client.force_login(user)
    data = {"decision": "keep", "commit": candidate.commit, "comment": "", **fields}
    headers = {"HTTP_HX_REQUEST": "true"} if htmx else {}
    return client.post(reverse("candidate_decide", args=[candidate.pk]), data, **headers)


# -- four eyes and permissions -------------------------------------------------------

def test_the_thesis_author_is_refused_with_403_and_nothing_is_merged(client, people, waiting_win):
    people.author.user_permissions.add(*people.reviewer.user_permissions.all())
    main = workspace.main_head()
    response = _decide(client, people.author, waiting_win)
    assert response.status_code == 403
    assert "you filed this candidate" in response.content.decode()
    assert not Review.objects.exists() and workspace.main_head() == main


def test_whoever_produced_the_candidate_may_not_approve_it(people, waiting_win):
    people.producer.user_permissions.add(*people.reviewer.user_permissions.all())
    producer = type(people.producer).objects.get(pk=people.producer.pk)
    with pytest.raises(PermissionDenied, match="you produced this candidate"):
        services.candidate_keep(candidate=waiting_win, reviewer=producer, commit=waiting_win.commit)
    assert not Review.objects.exists()


def test_a_person_without_the_decide_permission_gets_403(client, people, waiting_win):
    response = _decide(client, people.outsider, waiting_win, decision="revert")
    assert response.status_code == 403 and not Review.objects.exists()


@pytest.mark.parametrize("who", ["author", "producer"])
def test_the_database_itself_refuses_a_review_by_the_author_or_the_producer(people, waiting_win, who):
    person = getattr(people, who)
    with pytest.raises(IntegrityError), transaction.atomic():
        # Straight to the ORM, past the service: the check constraints hold on their own.
        Review.objects.create(candidate=waiting_win, commit=waiting_win.commit, revision=1,
                              decision="keep", reviewer=person, author=people.author,
                              producer=people.producer)


# -- revisions -----------------------------------------------------------------------

def test_an_approval_of_a_stale_revision_is_refused(client, people, waiting_win):
    seen = waiting_win.commit
    revised = candidates.candidate_revise(
        candidate=waiting_win, source=waiting_win.source + "\n# amended by the agent\n",
        revised_by=people.producer, message="amend")
    assert revised.revision == 2 and revised.commit != seen
    assert workspace.commit_info(revised.commit)["parents"] == [seen]
    record(revised, recorded_result())

    response = _decide(client, people.reviewer, revised, commit=seen)
    assert response.status_code == 409 and "new revision" in response.content.decode()
    assert not Review.objects.exists()
    # The reviewer who reads the new revision can keep it.
    assert _decide(client, people.reviewer, revised).status_code == 302
    assert Review.objects.get().commit == revised.commit


def test_a_new_revision_dismisses_an_earlier_decision_and_waits_again(people, waiting_win):
    services.candidate_revert(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit)
    assert waiting_win not in selectors.review_queue()
    revised = candidates.candidate_revise(
        candidate=waiting_win, source=waiting_win.source.replace('"upcast": "full"', '"upcast": "normalize_only"'),
        revised_by=people.author)
    # It is evaluated afresh before anyone decides on it again.
    assert revised.status == "queued" and revised.verdict == "" and not revised.measurements.exists()
    record(revised, recorded_result())
    assert list(selectors.review_queue()) == [revised]
    assert selectors.candidate_decision(revised) is None
    assert workspace.branches()[revised.branch] == revised.commit  # the live branch is back


def test_only_the_producer_or_the_author_may_revise(people, waiting_win):
    with pytest.raises(PermissionDenied):
        candidates.candidate_revise(candidate=waiting_win, source="x = 1\n", revised_by=people.reviewer)


# -- keep and revert in the workspace --------------------------------------------------

def test_keeping_merges_the_branch_into_main_with_the_author_the_trailer_and_the_dispatch_range(
        client, people, waiting_win):
    base = workspace.main_head()
    response = _decide(client, people.reviewer, waiting_win, comment="Checked the bf16 rows.",
                       dispatch_min="64", dispatch_max="128")
    assert response.status_code == 302

    review = Review.objects.get()
    assert (review.decision, review.reviewer, review.commit) == ("keep", people.reviewer, waiting_win.commit)
    merge = workspace.commit_info(workspace.main_head())
    assert merge["sha"] == review.merge_commit
    assert merge["parents"] == [base, waiting_win.commit]
    assert (merge["author"], merge["author_email"]) == ("Ada Lovelace", "ada@example.com")
    assert (merge["committer"], merge["committer_email"]) == ("Grace Reviewer", "grace@example.com")
    assert merge["message"].rstrip().endswith("Reviewed-by: Grace Reviewer <grace@example.com>")
    assert "Checked the bf16 rows." in merge["message"]

    assert workspace.read_file("main", "kernels/rmsnorm/cpu/kept.py") == waiting_win.source
    entry, baseline = json.loads(workspace.read_file(review.merge_commit, "dispatch.json"))["rmsnorm"]["cpu"]
    assert entry["commit"] == waiting_win.commit and entry["candidate"] == waiting_win.label
    assert (entry["axis"], entry["min"], entry["max"]) == ("tokens", 64, 128)
    assert entry["reviewer"] == "grace" and entry["author"] == "ada"
    assert baseline["kernel"] == "baseline"
    assert waiting_win not in selectors.review_queue()


def test_a_keep_on_one_hardware_class_leaves_every_other_classs_kernel_alone(people, workspace_dir,
                                                                          no_enqueue):
    # The new user's blocker: a CPU keep became the H200's kernel, and every waiting H200
    # win was then refused with 409.
    cpu_win = record(start_sweep(make_thesis(people.author), people.producer, budget=1).candidates.get(),
                     recorded_result())
    h200_thesis = make_thesis(people.author, title="H200 rows", hardware="h200", context_lengths=[4096])
    h200_sweep = start_sweep(h200_thesis, people.producer, budget=1)
    h200_win = record(h200_sweep.candidates.get(), {
        **recorded_result((1.3,), names=["t=4096,dtype=bfloat16"]), "device": "cuda"})
    baseline = get_op("rmsnorm").baseline_path.read_text()
    assert h200_sweep.baseline_source == baseline
    services.candidate_keep(candidate=cpu_win, reviewer=people.reviewer, commit=cpu_win.commit)
    assert workspace.kept_kernel("rmsnorm", "cpu").source == cpu_win.source
    assert workspace.kept_kernel("rmsnorm", "h200").source == baseline
    # The H200 win was timed against the H200's kept kernel, which did not move: it keeps.
    review = services.candidate_keep(candidate=h200_win, reviewer=people.reviewer, commit=h200_win.commit)
    assert workspace.kept_kernel("rmsnorm", "h200").source == h200_win.source
    assert workspace.kept_kernel("rmsnorm", "cpu").source == cpu_win.source
    table = workspace.dispatch_table(review.merge_commit)["rmsnorm"]
    assert [e["candidate"] for e in table["h200"][:1]] == [h200_win.label]
    assert [e["candidate"] for e in table["cpu"][:1]] == [cpu_win.label]
    assert [e["kernel"] for e in table["h100"]] == ["baseline"]
    # New sweeps time against their own class's kernel; so does the API.
    assert start_sweep(h200_thesis, people.producer, budget=1).baseline_source == h200_win.source


def test_keeping_with_the_proposed_range_records_it(people, waiting_win):
    proposed = waiting_win.result["dispatch"]
    review = services.candidate_keep(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit,
                                     dispatch_min=proposed["min"], dispatch_max=proposed["max"])
    assert (review.dispatch_axis, review.dispatch_min, review.dispatch_max) == ("tokens", 64, 64)
    with pytest.raises(ValidationError, match="already decided"):
        services.candidate_revert(candidate=waiting_win, reviewer=make_reviewer("linus"),
                                  commit=waiting_win.commit)


def test_a_range_that_ends_before_it_starts_is_refused(people, waiting_win):
    with pytest.raises(ValidationError) as error:
        services.candidate_keep(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit,
                                dispatch_min=256, dispatch_max=64)
    assert "dispatch_max" in error.value.message_dict and not Review.objects.exists()


def test_reverting_archives_the_branch_and_leaves_main_alone(people, waiting_win):
    main = workspace.main_head()
    review = services.candidate_revert(candidate=waiting_win, reviewer=people.reviewer,
                                       commit=waiting_win.commit, comment="Wins only at 64 tokens.")
    sweep = waiting_win.sweep
    archived = f"archive/{sweep.pk}-1-r1"
    branches = workspace.branches()
    assert review.archived_branch == archived and branches[archived] == waiting_win.commit
    assert f"candidate/{sweep.pk}-1" not in branches
    assert workspace.main_head() == main
    waiting_win.refresh_from_db()
    assert waiting_win.branch == archived


def test_a_second_win_measured_against_a_kernel_no_longer_kept_cannot_be_merged(people, waiting_win):
    second = record(waiting_win.sweep.candidates.get(number=2), recorded_result())
    services.candidate_keep(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit)
    main = workspace.main_head()
    with pytest.raises(ValidationError) as error:
        services.candidate_keep(candidate=second, reviewer=people.reviewer, commit=second.commit)
    assert error.value.code == "conflict" and "no longer kept" in error.value.message
    assert workspace.main_head() == main and Review.objects.count() == 1


def test_a_decision_writes_its_webhook_delivery_in_the_same_transaction(people, waiting_win):
    from webhooks.models import Delivery
    from webhooks.services import endpoint_create

    endpoint_create(owner=people.reviewer, url="https://hooks.example.com/kernel-lab",
                    events=["candidate.kept", "candidate.reverted"])
    review = services.candidate_keep(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit,
                                     comment="ship it", dispatch_min=64, dispatch_max=64)
    delivery = Delivery.objects.get()
    assert delivery.event_type == "candidate.kept"
    data = delivery.payload
    assert data["candidate"]["id"] == waiting_win.pk and data["candidate"]["op"] == "rmsnorm"
    assert data["reviewer"] == "grace" and data["comment"] == "ship it"
    details = data["details"]
    assert details["thesis"]["title"] == "Blocked rmsnorm stays in cache" and details["author"] == "ada"
    assert details["commit"] == waiting_win.commit and details["merge_commit"] == review.merge_commit
    assert details["dispatch_range"] == {"axis": "tokens", "min": 64, "max": 64}
    assert data["candidate"]["geomean_speedup"] == pytest.approx(waiting_win.geomean_speedup)


def test_a_cpu_win_of_an_op_served_on_gpus_decides_correctness_only(client, people, workspace_dir, no_enqueue):
    assert get_op("rmsnorm").cpu_served and not get_op("dsa_indexer_topk").cpu_served
    thesis = make_thesis(people.author, title="Indexer chunks", op="dsa_indexer_topk",
                         context_lengths=[4096], batch_sizes=[1])
    win = record(start_sweep(thesis, people.producer, budget=1, kernel="chunked_topk").candidates.get(),
                 {**recorded_result((1.4,), names=["ctx=4096,m=1"], dispatch=None), "op": "dsa_indexer_topk"})
    main = workspace.main_head()
    with pytest.raises(ValidationError, match="served on GPUs: a CPU run decides whether the kernel is right") as refused:
        services.candidate_keep(candidate=win, reviewer=people.reviewer, commit=win.commit)
    assert refused.value.code == "cpu-decides-correctness"
    assert not Review.objects.exists() and workspace.main_head() == main
    # Nothing waits on a keep it cannot have: not in the queue, not in its count.
    assert win not in selectors.review_queue() and selectors.review_queue_count() == 0

    client.force_login(people.reviewer)
    page = client.get(reverse("candidate_review", args=[win.pk])).content.decode()
    assert 'id="speed-not-decided"' in page and "Time it on its GPU class to keep it." in page
    assert 'id="keep"' not in page and 'id="revert"' in page
    refused_post = _decide(client, people.reviewer, win)  # a Keep posted anyway
    assert "served on GPUs" in refused_post.content.decode() and not Review.objects.exists()
    review = services.candidate_revert(candidate=win, reviewer=people.reviewer, commit=win.commit)
    assert review.decision == Review.Decision.REVERT and workspace.main_head() == main


# -- the queue -------------------------------------------------------------------------

def test_the_queue_holds_undecided_wins_oldest_first_and_filters_them(people, workspace_dir, no_enqueue):
    first_thesis = make_thesis(people.author)
    other_author = make_reviewer("hedy")
    # On its GPU class: a CPU win of the indexer decides only correctness and waits for no keep.
    second_thesis = make_thesis(other_author, title="Indexer chunks", op="dsa_indexer_topk", hardware="h200",
                                context_lengths=[4096], batch_sizes=[1])
    older = record(start_sweep(first_thesis, people.producer, budget=1).candidates.get(), recorded_result())
    losing = start_sweep(first_thesis, people.producer, budget=1).candidates.get()
    record(losing, recorded_result((1.0, 1.0, 1.0, 1.0)))
    indexer = start_sweep(second_thesis, people.producer, budget=1, kernel="chunked_topk").candidates.get()
    newer = record(indexer, {**recorded_result((1.4,), names=["ctx=4096,m=1"], dispatch=None),
                             "op": "dsa_indexer_topk"})

    assert list(selectors.review_queue()) == [older, newer]
    assert list(selectors.review_queue(op="dsa_indexer_topk")) == [newer]
    assert list(selectors.review_queue(author=people.author.pk)) == [older]
    assert list(selectors.review_queue(thesis=second_thesis.pk)) == [newer]
    assert list(selectors.review_queue(hardware="h100")) == []
    assert selectors.review_queue_count() == 2


def test_the_queue_shows_what_i_may_review_and_marks_what_needs_scrutiny(client, people, workspace_dir,
                                                                        no_enqueue):
    # The admin of a fresh install sees every win, most of them their own: "reviewable by me".
    mine = record(start_sweep(make_thesis(people.reviewer, title="My own idea"), people.producer,
                              budget=1).candidates.get(), recorded_result())
    theirs = record(start_sweep(make_thesis(people.author), people.producer, budget=1).candidates.get(),
                    recorded_result())
    assert list(selectors.review_queue()) == [mine, theirs]
    assert list(selectors.review_queue(reviewable_by=people.reviewer)) == [theirs]
    assert list(selectors.review_queue(reviewable_by=people.producer)) == []  # produced both
    client.force_login(people.reviewer)
    page = client.get(reverse("review_queue"), {"mine": "on"}).content.decode()
    assert f'id="queue-{theirs.pk}"' in page and f'id="queue-{mine.pk}"' not in page
    assert "needs scrutiny" not in page
    # A result more than 10x faster is marked before anyone opens it.
    GuardFinding.objects.create(candidate=theirs, name="plausibility", status="warn",
                                detail="needs scrutiny: more than 10x faster than the baseline")
    page = client.get(reverse("review_queue"), {"mine": "on"}).content.decode()
    assert 'class="badge rejected scrutiny"' in page


def test_the_queue_page_and_its_htmx_fragment_follow_the_filters(client, people, waiting_win):
    client.force_login(people.reviewer)
    page = client.get(reverse("review_queue"))
    assert page.status_code == 200 and b"<html" in page.content
    assert f'id="queue-{waiting_win.pk}"'.encode() in page.content
    assert b'id="review-count"' in page.content and b">1</span>" in page.content

    fragment = client.get(reverse("review_queue"), {"op": "dsa_indexer_topk"}, HTTP_HX_REQUEST="true")
    assert b"<html" not in fragment.content and b'id="queue-list"' in fragment.content
    assert b"Nothing waits" in fragment.content


# -- the review page ---------------------------------------------------------------------

@pytest.mark.parametrize(("workload", "meaningful", "why"), [
    # The new user's puzzle: 1.41x [1.15, 1.48], p = 2.7e-05, "significant: no" on a CPU.
    ({"speedup": 1.41, "speedup_ci": [1.15, 1.48], "p_value": 2.7e-05, "noise_floor": 0.5}, True,
     "inside this run's noise floor of ±50%"),
    ({"speedup": 1.2, "speedup_ci": [0.9, 1.5], "p_value": 0.2, "noise_floor": 0.02}, True, "p = 0.2, not under 0.01"),
    ({"speedup": 1.2, "speedup_ci": [0.98, 1.3], "p_value": 0.001, "noise_floor": 0.02}, True, "holds 1×"),
    ({"speedup": 1.2, "speedup_ci": [1.1, 1.3], "p_value": 0.001, "noise_floor": 0.02}, False, "CPU interpreter"),
    ({"speedup": 1.2, "speedup_ci": [1.1, 1.3], "p_value": 0.001, "noise_floor": 0.02}, True, "clock check"),
    ({"speedup": 1.2, "significant": True}, True, None),
])
def test_a_speedup_that_is_not_significant_says_why(workload, meaningful, why):
    found = selectors.why_not_significant(workload, timing_meaningful=meaningful)
    assert found == why if why is None else why in found



def test_the_review_page_shows_the_evidence_a_reviewer_needs(client, people, waiting_win):
    client.force_login(people.reviewer)
    html = client.get(waiting_win.get_absolute_url()).content.decode()
    # The git diff against the kept kernel, highlighted, with line numbers.
    assert 'class="diff code"' in html and 'data-path="kernels/rmsnorm/cpu/kept.py"' in html
    assert '<tr class="add">' in html and '<span class="k">def</span>' in html
    # This candidate's own commit: only its PARAMS values against the sweep's kernel.
    assert "This commit alone" in html
    # Every "significant" beside the floor it had to clear, and every "no" with its reason.
    assert "floor ±2%" in html and '<small class="muted why-not">p = 0.4, not under 0.01</small>' in html
    # Curves with confidence bands, the dispatch range shaded.
    latency = json.loads(html.split('id="latency-figure" type="application/json">')[1].split("</script>")[0])
    assert any(t.get("fill") == "tonexty" for t in latency["data"])
    speedup = json.loads(html.split('id="speedup-figure" type="application/json">')[1].split("</script>")[0])
    assert speedup["layout"]["shapes"][0]["type"] == "rect"
    # Guards, the warning before the passes; the end-to-end delta; the roofline.
    guards = html.split('id="guards"')[1]
    assert guards.index("cache-state") < guards.index("correctness")
    assert "not measured" in html.split('id="e2e"')[1].split("</section>")[0]
    assert 'class="num roofline">6%' in html  # 1.3 µs floor / 23 µs
    # What the first call at a size no timing process had seen cost, beside the kept kernel's.
    first = html.split('id="workloads"')[1].split('class="num first-call">')[1].split("</td>")[0]
    assert first.startswith("1.5 ") and "kept 1.2" in first and "+3</code>" in first
    # The thesis's idea (rendered), the op's kept history, the decision form.
    assert "<strong>blocks</strong>" in html and 'id="history"' in html
    assert 'id="decision-form"' in html and f'value="{waiting_win.commit}"' in html


def test_the_author_sees_why_they_cannot_decide(client, people, waiting_win):
    client.force_login(people.author)
    html = client.get(waiting_win.get_absolute_url()).content.decode()
    assert 'id="decision-form"' not in html and "You filed this thesis" in html


def test_an_htmx_decision_answers_with_the_decision_fragment(client, people, waiting_win):
    response = _decide(client, people.reviewer, waiting_win, htmx=True, decision="revert", comment="noise")
    assert response.status_code == 200 and b"<html" not in response.content
    assert b"Reverted" in response.content and b"archive/" in response.content


def test_an_end_to_end_delta_is_shown_when_measured(client, people, workspace_dir, no_enqueue):
    sweep = start_sweep(make_thesis(people.author), people.producer, budget=1)
    candidate = record(sweep.candidates.get(), recorded_result(
        e2e={"baseline_ms": 12.0, "candidate_ms": 11.4, "delta_pct": -5.0}))
    client.force_login(people.reviewer)
    e2e = client.get(candidate.get_absolute_url()).content.decode().split('id="e2e"')[1].split("</section>")[0]
    assert "-5.00 %" in e2e and "12.000 ms → 11.400 ms" in e2e and "<strong>faster</strong>" in e2e


def test_a_win_that_needs_scrutiny_shows_that_flag_before_everything_else(
        client, people, workspace_dir, no_enqueue):
    sweep = start_sweep(make_thesis(people.author), people.producer, budget=1)
    result = recorded_result(speedups=(14.0, 1.24, 1.02, 0.99))
    result["guards"].append({"name": "plausibility", "status": "warn",
                             "detail": "needs scrutiny: more than 10x faster than the baseline "
                                       "(t=64,dtype=float32 14.0x)"})
    result["guards"].append({"name": "e2e", "status": "fail", "detail": "slower end to end"})
    candidate = record(sweep.candidates.get(), result)
    client.force_login(people.reviewer)
    html = client.get(candidate.get_absolute_url()).content.decode()
    guards = html.split('id="guards"')[1]
    assert guards.index("needs scrutiny") < guards.index("slower end to end") < guards.index("cache-state")
    # And the page opens with them, before the machine table, the change and the curves.
    glance = html.split('id="at-a-glance"')[1].split("</section>")[0]
    warnings = glance.split('id="glance-warnings"')[1]
    assert warnings.index("needs scrutiny") < warnings.index("slower end to end") < warnings.index("cache-state")
    assert "matched the reference" not in glance  # a guard that passed is no warning
    assert html.index('id="at-a-glance"') < html.index('id="provenance"') < html.index('id="diff"')
    assert html.index('id="at-a-glance"') < html.index('id="latency-chart"')


def test_the_summary_says_which_way_the_decode_step_moved(client, people, workspace_dir, no_enqueue):
    """"70.53 %" alone read as a gain: it was a slowdown."""
    client.force_login(people.reviewer)
    for e2e, said in [({"baseline_ms": 10.0, "candidate_ms": 17.053, "delta_pct": 70.53},
                       ("slower", "+70.53 % time")),
                      ({"baseline_ms": 12.0, "candidate_ms": 11.4, "delta_pct": -5.0}, ("faster", "-5.00 % time")),
                      (None, ("not measured",))]:
        sweep = start_sweep(make_thesis(people.author), people.producer, budget=1)
        candidate = record(sweep.candidates.get(), recorded_result(**({"e2e": e2e} if e2e else {})))
        html = client.get(candidate.get_absolute_url()).content.decode()
        line = html.split('id="glance-e2e"')[1].split("</dd>")[0]
        assert all(part in line for part in said), line


def test_a_long_change_is_folded_below_the_summary(client, people, workspace_dir, no_enqueue, monkeypatch):
    from reviews import views

    sweep = start_sweep(make_thesis(people.author), people.producer, budget=1)
    candidate = record(sweep.candidates.get(), recorded_result())
    client.force_login(people.reviewer)
    shown = client.get(candidate.get_absolute_url()).content.decode()
    assert 'id="diff-folded"' not in shown and 'class="diff' in shown
    monkeypatch.setattr(views, "DIFF_OPEN_LINES", 0)
    folded = client.get(candidate.get_absolute_url()).content.decode()
    summary = folded.split('id="diff-folded"')[1].split("</summary>")[0]
    assert "kernel" in summary and "show the change" in summary


def test_the_review_page_draws_one_curve_per_kind_of_batch():
    op = get_op("dsa_indexer_topk_paged")
    axis, layout = selectors.workload_groups(op, op.workloads("cpu", [2048, 4096, 8192]))
    assert axis == "context_length"
    groups = {group for _, group in layout.values()}
    assert groups == {"mix=equal,next_n=1", "mix=mixed,next_n=1", "mix=mixed,next_n=2"}
    assert layout["ctx<=4096,b=8,mixed"] == (4096, "mix=mixed,next_n=1")


# -- honest diffs: characters a diff cannot show ---------------------------------------

BIDI_DIFF = (
    "diff --git a/k.py b/k.py\n--- a/k.py\n+++ b/k.py\n@@ -1,3 +1,4 @@\n"
    " def forward(x):\n"
    '+    """\u202e Returns x. \u2066"""  ; x = x * 0 # \u2069\n'
    "+    y = 1\u2028    return y\n"
    "     return x\n"
    "-    pass\n"
)


def test_a_diff_shows_hidden_characters_as_escapes_and_splits_lines_at_newlines_only():
    old = "def forward(x):\n    return x\n    pass\n"
    new = 'def forward(x):\n    """\u202e Returns x. \u2066"""  ; x = x * 0 # \u2069\n    y = 1\u2028    return y\n    return x\n'
    [file] = render_diff(BIDI_DIFF, old_file=lambda path: old, new_file=lambda path: new)
    assert [(line.kind, line.old, line.new) for line in file.lines] == [
        ("hunk", None, None), ("ctx", 1, 1), ("add", None, 2), ("add", None, 3), ("ctx", 2, 4), ("del", 3, None)]
    added = str(file.lines[2].html)
    assert "\u202e" not in added and "\u2066" not in added
    assert 'title="U+202E RIGHT-TO-LEFT OVERRIDE">&lt;U+202E&gt;</span>' in added
    # The line separator is one line's content, shown, not a line break of its own.
    separated = str(file.lines[3].html)
    assert separated.index("&lt;U+2028&gt;") < separated.index('<span class="k">return</span> <span class="n">y</span>')
    assert file.hidden == ["U+202E RIGHT-TO-LEFT OVERRIDE", "U+2066 LEFT-TO-RIGHT ISOLATE",
                           "U+2069 POP DIRECTIONAL ISOLATE", "U+2028 LINE SEPARATOR"]
    assert hidden_characters("plain ascii\tand é ü — ok\n") == []


def test_the_source_view_shows_the_whole_file_numbered_with_hidden_characters_named(people, waiting_win, client):
    source = waiting_win.source + 'NOTE = "\u202e reversed"\n'
    Candidate.objects.filter(pk=waiting_win.pk).update(source=source)
    client.force_login(people.outsider)
    page = client.get(reverse("candidate_source", args=[waiting_win.pk])).content.decode()
    lines = source.count("\n")
    assert f'<td class="ln">{lines}</td>' in page and f'<td class="ln">{lines + 1}</td>' not in page
    assert "\u202e" not in page and "&lt;U+202E&gt;" in page
    assert 'id="hidden-characters"' in page and "U+202E RIGHT-TO-LEFT OVERRIDE" in page
    assert 'data-path="kernels/rmsnorm/cpu/kept.py"' in page
    review = client.get(waiting_win.get_absolute_url()).content.decode()
    assert f'href="{reverse("candidate_source", args=[waiting_win.pk])}"' in review
    assert client.get(reverse("candidate_source", args=[999999])).status_code == 404


@pytest.mark.parametrize("invisible", ["\ufe00", "\U000e0100", "\u034f", "\u3164", "\u115f", "\uffa0"])
def test_a_name_that_differs_by_an_invisible_letter_is_shown_and_flagged(invisible):
    """A variation selector or a Hangul filler is not a format character, yet Python takes
    it inside a name: `hidden︀ = min(max(hidden, …))` reads as a clamp of `hidden` and leaves
    `hidden` as it was."""
    old = "def forward(hidden):\n    return hidden\n"
    new = f"def forward(hidden):\n    hidden{invisible} = min(max(hidden, -1.0), 1.0)\n    return hidden\n"
    scope: dict = {}
    exec(new, scope)
    assert scope["forward"](5.0) == 5.0  # another name: nothing was clamped
    diff = ("diff --git a/k.py b/k.py\n--- a/k.py\n+++ b/k.py\n@@ -1,2 +1,3 @@\n def forward(hidden):\n"
            f"+    hidden{invisible} = min(max(hidden, -1.0), 1.0)\n     return hidden\n")
    [file] = render_diff(diff, old_file=lambda path: old, new_file=lambda path: new)
    added = str(file.lines[2].html)
    assert invisible not in added and f"&lt;U+{ord(invisible):04X}&gt;" in added
    assert file.hidden and file.hidden[0].startswith(f"U+{ord(invisible):04X} ")


def test_a_carriage_return_is_shown_where_it_is_and_keeps_the_diff_on_its_lines():
    """Python ends a line at a lone CR; the highlighter did too, and the diff (split on
    newlines) then showed the code after it as another line's, or not at all."""
    old = "def forward(x):\n    return x\n"
    new = "def forward(x):\n    y = x + 1  # note\r\r    x = x * 0\n    return x\n"
    diff = ("diff --git a/k.py b/k.py\n--- a/k.py\n+++ b/k.py\n@@ -1,2 +1,3 @@\n def forward(x):\n"
            "+    y = x + 1  # note\r\r    x = x * 0\n     return x\n")
    scope: dict = {}
    exec(new + "z = forward(3)\n", scope)
    assert scope["z"] == 0  # the line after the carriage returns runs
    [file] = render_diff(diff, old_file=lambda path: old, new_file=lambda path: new)
    assert [(line.kind, line.old, line.new) for line in file.lines] == [
        ("hunk", None, None), ("ctx", 1, 1), ("add", None, 2), ("ctx", 2, 3)]
    added = str(file.lines[2].html)
    # The code a carriage return starts is on the added line, after the escapes.
    assert added.count("&lt;U+000D&gt;") == 2 and added.rindex("&lt;U+000D&gt;") < added.index("x = x * 0")
    assert 'return' in str(file.lines[3].html) and "U+000D CONTROL CHARACTER" in file.hidden


def _win_with_hidden_characters(people, waiting_win) -> Candidate:
    source = waiting_win.source.replace("def forward(", "# \u202e kept as it was \u2066\ndef forward(", 1)
    revised = candidates.candidate_revise(candidate=waiting_win, source=source,
                                                 revised_by=people.producer)
    return record(revised, recorded_result())


def test_a_change_with_hidden_characters_is_kept_only_by_a_reviewer_who_says_they_read_them(
        client, people, waiting_win):
    candidate = _win_with_hidden_characters(people, waiting_win)
    client.force_login(people.reviewer)
    html = client.get(candidate.get_absolute_url()).content.decode()
    banner = html.split('id="hidden-characters"')[1].split("</div>")[0]
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in banner and "kernels/rmsnorm/cpu/kept.py" in banner
    assert 'name="saw_hidden_characters"' in html and "&lt;U+202E&gt;" in html
    base = workspace.main_head()

    response = _decide(client, people.reviewer, candidate)
    assert response.status_code == 422 and "characters a diff cannot show" in response.content.decode()
    assert not Review.objects.exists() and workspace.main_head() == base
    with pytest.raises(ValidationError):
        services.candidate_keep(candidate=candidate, reviewer=people.reviewer, commit=candidate.commit)

    assert _decide(client, people.reviewer, candidate, saw_hidden_characters="on").status_code == 302
    assert Review.objects.get().decision == "keep" and workspace.main_head() != base


def test_a_change_without_hidden_characters_asks_for_no_confirmation(client, people, waiting_win):
    client.force_login(people.reviewer)
    html = client.get(waiting_win.get_absolute_url()).content.decode()
    assert 'id="hidden-characters"' not in html and 'name="saw_hidden_characters"' not in html


def test_the_admin_can_neither_change_nor_delete_a_decision(rf, people, waiting_win):
    from django.contrib.admin.sites import site

    services.candidate_revert(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit)
    admin = site.get_model_admin(Review)
    request = rf.get("/admin/reviews/review/")
    request.user = get_user_model().objects.create_superuser("root-admin", password="pw-for-tests-only")
    review = Review.objects.get()
    assert not admin.has_delete_permission(request, review) and not admin.has_change_permission(request, review)
    assert "delete_selected" not in admin.get_actions(request)


# -- undoing a keep --------------------------------------------------------------------

def _keep(candidate, reviewer) -> Review:
    return services.candidate_keep(candidate=candidate, reviewer=reviewer, commit=candidate.commit)


def _undo(candidate, reviewer, comment: str = "Slower under load in the serving engine.", **fields) -> Review:
    return services.candidate_undo(candidate=candidate, reviewer=reviewer,
                                   commit=fields.pop("commit", candidate.commit), comment=comment)


def _next_cpu_win(people, thesis, number: int = 1) -> Candidate:
    """A win of a sweep started now (forked from, and timed against, main's kept kernel):
    its `number`th grid point, so two such wins differ in their source."""
    sweep = start_sweep(thesis, people.producer, budget=number)
    return record(sweep.candidates.get(number=number), recorded_result())


def test_undoing_a_keep_brings_back_the_kernel_kept_before_it_on_that_hardware_only(
        people, workspace_dir, no_enqueue):
    thesis = make_thesis(people.author)
    first = _next_cpu_win(people, thesis)
    first_keep = _keep(first, people.reviewer)
    h200_thesis = make_thesis(people.author, title="H200 rows", hardware="h200", context_lengths=[4096])
    h200_win = record(start_sweep(h200_thesis, people.producer, budget=1).candidates.get(), {
        **recorded_result((1.3,), names=["t=4096,dtype=bfloat16"]), "device": "cuda"})
    _keep(h200_win, people.reviewer)
    second = _next_cpu_win(people, thesis, number=2)
    assert second.source != first.source
    second_keep = _keep(second, people.reviewer)
    h200_before = workspace.dispatch_entries("rmsnorm", "h200")
    before = workspace.main_head()

    # Undone by a second reviewer: the keep's own reviewer is no author, so may too; four
    # eyes are about the author and the producer.
    linus = make_reviewer("linus")
    undo = _undo(second, linus, comment="Regresses bf16 at 4K tokens in the engine.")

    assert (undo.decision, undo.undoes, undo.reviewer) == (Review.Decision.UNDO, second_keep, linus)
    assert undo.revert_commit == workspace.main_head()
    # Append-only: the keep's row stays beside the undo's.
    assert list(second.reviews.order_by("id").values_list("decision", flat=True)) == ["keep", "undo"]
    commit = workspace.commit_info(undo.revert_commit)
    assert commit["parents"] == [before]
    assert (commit["author"], commit["author_email"]) == ("Linus Reviewer", "linus@example.com")
    assert second_keep.merge_commit in commit["message"] and second.commit in commit["message"]
    assert "Regresses bf16 at 4K tokens in the engine." in commit["message"]
    assert f"candidate {first.label}'s blocked" in commit["message"]

    assert workspace.kept_kernel("rmsnorm", "cpu").source == first.source
    assert [e.get("candidate") for e in workspace.dispatch_entries("rmsnorm", "cpu")] == [first.label, None]
    # The other class is untouched: its kernel and its dispatch list.
    assert workspace.kept_kernel("rmsnorm", "h200").source == h200_win.source
    assert workspace.dispatch_entries("rmsnorm", "h200") == h200_before
    assert set(workspace.changed_files(before, undo.revert_commit)) == {
        "kernels/rmsnorm/cpu/kept.py", "dispatch.json"}
    # What the next sweep times against, and compares machines with, is the first keep.
    assert start_sweep(thesis, people.producer, budget=1).baseline_source == first.source
    assert selectors.latest_kept("rmsnorm", "cpu", other_than=second) == first
    assert [r.candidate for r in selectors.op_kept_history("rmsnorm")] == [h200_win, first]
    assert second not in selectors.review_queue()

    # Then the first: the shipped baseline is back, with only its own entry.
    _undo(first, linus)
    assert workspace.kept_kernel("rmsnorm", "cpu").source == get_op("rmsnorm").baseline_path.read_text()
    assert [e["kernel"] for e in workspace.dispatch_entries("rmsnorm", "cpu")] == ["baseline"]
    assert Review.objects.get(undoes=first_keep).reviewer == linus
    assert Review.objects.filter(decision="undo").count() == 2 and Review.objects.filter(decision="keep").count() == 3


@pytest.mark.parametrize("who", ["author", "producer", "outsider"])
def test_an_undo_by_the_author_the_producer_or_someone_without_the_permission_is_refused(
        people, waiting_win, who):
    keep = _keep(waiting_win, people.reviewer)
    person = getattr(people, who)
    if who != "outsider":
        person.user_permissions.add(*people.reviewer.user_permissions.all())
        person = type(person).objects.get(pk=person.pk)  # no stale permission cache
    main = workspace.main_head()
    with pytest.raises(PermissionDenied):
        _undo(waiting_win, person)
    assert list(Review.objects.all()) == [keep] and workspace.main_head() == main


def test_an_undo_from_a_stale_page_or_of_a_keep_already_undone_is_refused(people, waiting_win):
    _keep(waiting_win, people.reviewer)
    main = workspace.main_head()
    linus = make_reviewer("linus")
    with pytest.raises(ValidationError) as stale:
        _undo(waiting_win, linus, commit="0" * 40)
    assert stale.value.code == "stale" and workspace.main_head() == main
    _undo(waiting_win, make_reviewer("hedy"))
    undone = workspace.main_head()
    with pytest.raises(ValidationError, match="already undone by hedy") as again:
        _undo(waiting_win, linus)
    assert again.value.code == "decided" and workspace.main_head() == undone
    assert Review.objects.filter(decision="undo").count() == 1


def test_only_the_newest_keep_of_an_op_on_its_hardware_can_be_undone(people, workspace_dir, no_enqueue):
    thesis = make_thesis(people.author)
    older = _next_cpu_win(people, thesis)
    _keep(older, people.reviewer)
    newer = _next_cpu_win(people, thesis, number=2)
    _keep(newer, people.reviewer)
    main = workspace.main_head()
    with pytest.raises(ValidationError) as refused:
        _undo(older, make_reviewer("linus"))
    assert refused.value.code == "not-current"
    assert f"candidate {newer.label} was kept after it" in refused.value.message
    assert workspace.main_head() == main and not Review.objects.filter(decision="undo").exists()


def test_only_a_kept_candidate_is_undone_and_only_with_a_reason(people, waiting_win):
    main = workspace.main_head()
    with pytest.raises(ValidationError) as waiting:
        _undo(waiting_win, people.reviewer)
    assert waiting.value.code == "not-kept"
    second = record(waiting_win.sweep.candidates.get(number=2), recorded_result())
    services.candidate_revert(candidate=second, reviewer=people.reviewer, commit=second.commit)
    with pytest.raises(ValidationError, match="only a kept candidate"):
        _undo(second, people.reviewer)
    _keep(waiting_win, people.reviewer)
    kept = workspace.main_head()
    with pytest.raises(ValidationError) as no_reason:
        _undo(waiting_win, make_reviewer("linus"), comment="   ")
    assert no_reason.value.error_dict["comment"][0].code == "required"
    assert kept != main and workspace.main_head() == kept and not Review.objects.filter(decision="undo").exists()


def test_an_undo_that_cannot_be_written_to_main_leaves_no_decision(people, waiting_win):
    keep = _keep(waiting_win, people.reviewer)
    # Someone changed the kept file on main after the keep (not through a keep): restoring
    # the file from before the keep would throw that change away.
    head = workspace.main_head()
    (edit,) = workspace.build([workspace.NewCommit(
        parents=[head], files={"kernels/rmsnorm/cpu/kept.py": waiting_win.source + "\n# hand edit\n"},
        message="hand edit", author=workspace.KERNEL_LAB)])
    workspace.publish([workspace.RefUpdate(workspace.MAIN, edit, old=head)])
    with pytest.raises(ValidationError) as refused:
        _undo(waiting_win, make_reviewer("linus"))
    assert refused.value.code == "conflict" and "changed on main since the keep" in refused.value.message
    assert list(Review.objects.all()) == [keep] and workspace.main_head() == edit


def test_the_database_refuses_an_undo_that_names_no_keep(people, waiting_win):
    with pytest.raises(IntegrityError), transaction.atomic():
        Review.objects.create(candidate=waiting_win, commit=waiting_win.commit, revision=1, decision="undo",
                              reviewer=people.reviewer, author=people.author, producer=people.producer)


def test_an_undo_writes_a_candidate_undone_webhook_delivery(people, waiting_win):
    from webhooks.models import Delivery
    from webhooks.services import endpoint_create

    endpoint_create(owner=people.reviewer, url="https://hooks.example.com/kernel-lab", events=["candidate.undone"])
    keep = services.candidate_keep(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit,
                                   dispatch_min=64, dispatch_max=64)
    undo = _undo(waiting_win, make_reviewer("linus"), comment="wrong at 64 tokens")
    delivery = Delivery.objects.get()
    assert delivery.event_type == "candidate.undone"
    data = delivery.payload
    assert data["reviewer"] == "linus" and data["comment"] == "wrong at 64 tokens"
    assert data["details"]["revert_commit"] == undo.revert_commit
    assert data["details"]["undone_keep"]["merge_commit"] == keep.merge_commit
    assert data["details"]["undone_keep"]["dispatch_range"] == {"axis": "tokens", "min": 64, "max": 64}


def test_the_review_page_of_a_kept_candidate_offers_the_undo_and_then_shows_it(client, people, waiting_win):
    keep = _keep(waiting_win, people.reviewer)
    client.force_login(people.author)
    page = client.get(waiting_win.get_absolute_url()).content.decode()
    assert 'id="undo-form"' not in page and "a colleague must undo a keep" in page

    linus = make_reviewer("linus")
    client.force_login(linus)
    page = client.get(waiting_win.get_absolute_url()).content.decode()
    assert 'id="undo-form"' in page and 'id="undo"' in page and f'value="{waiting_win.commit}"' in page
    # Without a reason: 422, the form again with the reason asked for, nothing written.
    refused = _decide(client, linus, waiting_win, htmx=True, decision="undo", comment="")
    assert refused.status_code == 422 and "say why the keep is undone" in refused.content.decode()
    assert 'id="undo-form"' in refused.content.decode()
    assert _decide(client, people.author, waiting_win, decision="undo", comment="mine").status_code == 403

    response = _decide(client, linus, waiting_win, decision="undo", comment="Slower in the engine.")
    assert response.status_code == 302
    page = client.get(waiting_win.get_absolute_url()).content.decode()
    outcome = page.split('id="decision-outcome"')[1].split("</p>")[0]
    assert "Undone" in outcome and "linus" in outcome
    undo = Review.objects.get(decision="undo")
    assert f'id="revert-commit">{undo.revert_commit[:12]}' in page and "Slower in the engine." in page
    assert keep.merge_commit[:12] in page.split('id="undone-keep"')[1].split("</p>")[0]
    assert 'id="undo-form"' not in page
    # A second undo, from the page opened before: 409.
    assert _decide(client, make_reviewer("hedy"), waiting_win, decision="undo", comment="again").status_code == 409


def test_the_page_lists_the_shared_files_the_candidate_ran_with_and_their_hashes(client, people, workspace_dir,
                                                                                  no_enqueue):
    sweep = start_sweep(make_thesis(people.author), people.producer)
    digest = "ab" * 32
    result = {**recorded_result(), "lib_files": [{"path": "indexer_select.py", "sha256": digest}]}
    candidate = record(sweep.candidates.get(number=1), result)
    plain = record(sweep.candidates.get(number=2), recorded_result())
    client.force_login(people.reviewer)
    page = client.get(reverse("candidate_review", args=[candidate.pk])).content.decode()
    table = page[page.index('id="lib-files"'):]
    assert "indexer_select.py" in table and digest in table
    assert 'id="lib-files"' not in client.get(reverse("candidate_review", args=[plain.pk])).content.decode()
