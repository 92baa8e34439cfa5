"""Filing theses: the service's validation, and the form with and without htmx."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from research import queueing, sweeps, theses
from research.models import Evidence, Thesis

pytestmark = pytest.mark.django_db

NSYS_CSV = (
    b'"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"\n'
    b'"70.0","7000000","10","700000.0","700000.0","690000","710000","5000.0","sm90_xmma_gemm_bf16bf16_bf16f32"\n'
    b'"30.0","3000000","10","300000.0","300000.0","290000","310000","5000.0","vectorized_elementwise_kernel<relu>"\n'
)


def _form(**overrides):
    data = {
        "title": "Pipeline the indexer over chunks",
        "idea": "Reduce top-k **incrementally** instead of one final merge.",
        "op": "dsa_indexer_topk",
        "hardware": "cpu",
        "model_context": "deepseek-v3.2",
        "required_dsl": "torch",
        "allowed_paths": "kernels/dsa_indexer_topk/\n",
        "forbidden_changes": "tolerances",
        "context_lengths": "2048, 8192",
        "batch_sizes": "4",
    }
    data.update(overrides)
    return data


def test_it_files_a_thesis_with_the_ops_default_workloads(user):
    thesis = theses.thesis_submit(
        author=user, title="t", idea="i", op="rmsnorm", hardware="cpu", required_dsl="torch"
    )
    assert thesis.context_lengths and thesis.batch_sizes
    assert thesis.evidence is None


def test_it_rejects_an_unknown_op_and_stores_nothing(user):
    with pytest.raises(ValidationError) as error:
        theses.thesis_submit(author=user, title="t", idea="i", op="softmax9", hardware="cpu",
                               required_dsl="torch")
    assert "unknown op" in str(error.value.message_dict["op"])
    assert not Thesis.objects.exists()


@pytest.mark.parametrize("lengths", [[0], [10**9], list(range(1, 200))])
def test_it_rejects_absurd_workloads(user, lengths):
    with pytest.raises(ValidationError) as error:
        theses.thesis_submit(author=user, title="t", idea="i", op="rmsnorm", hardware="cpu",
                               required_dsl="torch", context_lengths=lengths, batch_sizes=[1])
    assert error.value.message_dict["context_lengths"]
    assert not Thesis.objects.exists()


def test_it_refuses_allowed_paths_that_leave_the_workspace(user):
    with pytest.raises(ValidationError) as error:
        theses.thesis_submit(author=user, title="t", idea="i", op="rmsnorm", hardware="cpu",
                               required_dsl="torch", allowed_paths=["../../etc/passwd"])
    assert "relative path" in str(error.value.message_dict["allowed_paths"])


def test_malformed_evidence_leaves_neither_evidence_nor_thesis(user):
    with pytest.raises(ValidationError) as error:
        theses.thesis_submit(
            author=user, title="t", idea="i", op="rmsnorm", hardware="cpu", required_dsl="torch",
            evidence=theses.Upload(name="trace.json", data=b'{"traceEvents": [{"ph": "X", '),
        )
    assert error.value.message_dict["evidence"]
    assert not Evidence.objects.exists() and not Thesis.objects.exists()


def test_the_form_needs_a_login(client):
    response = client.get(reverse("thesis_new"))
    assert response.status_code == 302 and reverse("login") in response["Location"]


def test_the_form_page_renders_in_full_without_htmx(logged_in_client):
    response = logged_in_client.get(reverse("thesis_new"))
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" in html and 'id="thesis-form"' in html and "dsa_indexer_topk" in html


def test_the_form_offers_the_paged_decode_ops_and_files_one_with_their_defaults(logged_in_client):
    html = logged_in_client.get(reverse("thesis_new")).content.decode()
    for op in ("dsa_indexer_topk_paged", "dsa_indexer_topk_paged_fp8"):
        assert f'<option value="{op}"' in html
    response = logged_in_client.post(reverse("thesis_new"), _form(
        op="dsa_indexer_topk_paged", allowed_paths="kernels/dsa_indexer_topk_paged/\n",
        context_lengths="", batch_sizes=""))
    thesis = Thesis.objects.get()
    assert response.status_code == 302 and thesis.op == "dsa_indexer_topk_paged"
    assert thesis.context_lengths == [2048, 8192] and thesis.batch_sizes == [8]


def test_a_plain_post_files_the_thesis_and_redirects_to_it(logged_in_client):
    evidence = SimpleUploadedFile("kern_sum.csv", NSYS_CSV, content_type="text/csv")
    response = logged_in_client.post(reverse("thesis_new"), {**_form(), "evidence": evidence})
    thesis = Thesis.objects.get()
    assert response.status_code == 302 and response["Location"] == thesis.get_absolute_url()
    assert thesis.context_lengths == [2048, 8192] and thesis.batch_sizes == [4]
    assert thesis.allowed_paths == ["kernels/dsa_indexer_topk"]
    assert thesis.evidence.format == "nsys-csv"


def test_context_lengths_may_be_said_in_k_as_engineers_say_them(logged_in_client):
    response = logged_in_client.post(reverse("thesis_new"), _form(context_lengths="2K, 8k", batch_sizes="4"))
    assert response.status_code == 302 and Thesis.objects.get().context_lengths == [2048, 8192]
    for bad in ("32KB", "K", "1.5K", "-2K"):
        refused = logged_in_client.post(reverse("thesis_new"), _form(context_lengths=bad))
        assert refused.status_code == 422 and "is not a whole number (or one with K or M)" in refused.content.decode()
    assert Thesis.objects.count() == 1


def test_an_htmx_post_with_errors_returns_only_the_form_with_messages(logged_in_client):
    response = logged_in_client.post(
        reverse("thesis_new"), _form(context_lengths="2048, lots"), HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert response.status_code == 422
    assert "<html" not in html and 'id="thesis-form"' in html
    assert "is not a whole number" in html
    assert not Thesis.objects.exists()


def test_an_htmx_post_that_succeeds_tells_htmx_where_to_go(logged_in_client):
    response = logged_in_client.post(reverse("thesis_new"), _form(), HTTP_HX_REQUEST="true")
    thesis = Thesis.objects.get()
    assert response.status_code == 200
    assert response["HX-Redirect"] == thesis.get_absolute_url()


def test_an_unreadable_upload_is_reported_on_the_form(logged_in_client):
    junk = SimpleUploadedFile("trace.json", b"\x00\x01\x02binary", content_type="application/json")
    response = logged_in_client.post(reverse("thesis_new"), {**_form(), "evidence": junk})
    assert response.status_code == 422
    assert 'class="error"' in response.content.decode()
    assert not Thesis.objects.exists() and not Evidence.objects.exists()


def _held_token(html: str) -> str:
    return html.split('name="evidence_held" value="')[1].split('"')[0]


def test_a_refused_submit_keeps_the_profile_for_the_next_one(logged_in_client, user):
    upload = SimpleUploadedFile("kern_sum.csv", NSYS_CSV, content_type="text/csv")
    refused = logged_in_client.post(reverse("thesis_new"), {**_form(title="bad\u202etitle"), "evidence": upload})
    html = refused.content.decode()
    assert refused.status_code == 422 and 'class="error"' in html
    assert "Kept from your last submit: <strong>kern_sum.csv</strong>" in html
    token = _held_token(html)

    # Refused again with no file chosen: still held, under the same token.
    again = logged_in_client.post(reverse("thesis_new"), {**_form(context_lengths="0"), "evidence_held": token})
    assert again.status_code == 422 and _held_token(again.content.decode()) == token

    filed = logged_in_client.post(reverse("thesis_new"), {**_form(), "evidence_held": token})
    assert filed.status_code == 302
    thesis = Thesis.objects.get()
    assert thesis.evidence.filename == "kern_sum.csv" and thesis.evidence.summary["format"] == "nsys-csv"
    # Used once: a second thesis cannot take it again.
    reused = logged_in_client.post(reverse("thesis_new"), {**_form(), "evidence_held": token})
    assert reused.status_code == 422 and "no longer held" in reused.content.decode()
    assert Thesis.objects.count() == 1


def test_a_held_profile_is_only_its_uploaders_and_a_bad_profile_is_never_held(logged_in_client, user):
    from django.test import Client

    upload = SimpleUploadedFile("kern_sum.csv", NSYS_CSV, content_type="text/csv")
    token = _held_token(logged_in_client.post(
        reverse("thesis_new"), {**_form(title=""), "evidence": upload}).content.decode())
    other = Client()
    other.force_login(_other_user("mallory"))
    taken = other.post(reverse("thesis_new"), {**_form(), "evidence_held": token})
    assert taken.status_code == 422 and "no longer held" in taken.content.decode()
    assert not Thesis.objects.exists() and not Evidence.objects.exists()

    junk = SimpleUploadedFile("trace.json", b"{not json", content_type="application/json")
    refused = logged_in_client.post(reverse("thesis_new"), {**_form(title="bad\u202etitle"), "evidence": junk})
    html = refused.content.decode()
    assert refused.status_code == 422 and "not a PyTorch profiler trace" in html
    assert 'name="evidence_held"' not in html


def test_a_user_holds_one_small_profile_at_a_time(logged_in_client, user, monkeypatch):
    """Each refused submit parked its file in the broker's Redis for an hour: three posts
    of 25 MB held 75 MB. Now one slot a user, and only small profiles."""
    from research import held_uploads

    def refused_with(name: str) -> str:
        upload = SimpleUploadedFile(name, NSYS_CSV, content_type="text/csv")
        return logged_in_client.post(reverse("thesis_new"), {**_form(title=""), "evidence": upload}).content.decode()

    first, second = _held_token(refused_with("one.csv")), _held_token(refused_with("two.csv"))
    assert held_uploads.redeem(user.pk, first) is None and held_uploads.redeem(user.pk, second).name == "two.csv"

    monkeypatch.setattr(held_uploads, "MAX_HELD_BYTES", len(NSYS_CSV) - 1)
    html = refused_with("big.csv")
    assert 'name="evidence_held"' not in html and "not kept for the next submit" in html
    assert held_uploads.redeem(user.pk, second).name == "two.csv"  # the slot is untouched


def test_the_thesis_page_shows_the_top_kernels_chart_and_bottleneck(logged_in_client, user):
    thesis = theses.thesis_submit(
        author=user, title="GEMM heavy", idea="# Heading\n<script>alert(1)</script>", op="rmsnorm",
        hardware="cpu", required_dsl="torch",
        evidence=theses.Upload(name="kern_sum.csv", data=NSYS_CSV),
    )
    html = logged_in_client.get(thesis.get_absolute_url()).content.decode()
    assert "sm90_xmma_gemm_bf16bf16_bf16f32" in html and 'id="top-kernels"' in html
    assert 'id="evidence-figure"' in html and "plotly/plotly.min.js" in html
    assert thesis.evidence.summary["bottleneck"] in html
    assert thesis.evidence.summary["reason"] in html
    # The idea is rendered markdown, with the script removed rather than escaped into view.
    assert "<h1>Heading</h1>" in html and "<script>alert(1)" not in html
    figure = json.loads(html.split('id="evidence-figure" type="application/json">')[1].split("</script>")[0])
    assert figure["data"][0]["x"] == [3.0, 7.0]


def test_the_thesis_page_lists_the_packs_its_agents_read_and_each_can_be_read(logged_in_client, user):
    thesis = theses.thesis_submit(
        author=user, title="Indexer", idea="Chunk the keys.", op="dsa_indexer_topk",
        hardware="h200", model_context="deepseek-v3.2", required_dsl="torch",
    )
    packs = logged_in_client.get(thesis.get_absolute_url()).content.decode().split('id="packs"')[1].split("</dd>")[0]
    assert "skills/hardware/sm90.md" in packs and "skills/models/deepseek-v3.2.md" in packs
    assert "skills/reward-hacks.md" in packs and "sm100" not in packs
    page = logged_in_client.get(reverse("skill_pack", args=["hardware/sm90.md"]))
    assert page.status_code == 200 and "<h1>" in page.content.decode()
    # Only packs: no other file of the project, however the name is spelled.
    for name in ("../config/settings.py", "hardware/../../README.md", "README.md", "nope.md"):
        assert logged_in_client.get(reverse("skill_pack", args=[name])).status_code == 404


# -- editing and archiving ------------------------------------------------------------

def _other_user(name: str, **fields):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(name, password="pw-for-tests-only", **fields)


def test_its_author_edits_a_thesis_until_its_first_sweep(logged_in_client, make_thesis, user, monkeypatch):
    from django.test import Client

    thesis = make_thesis()
    url = reverse("thesis_edit", args=[thesis.pk])
    edited = logged_in_client.post(url, {"title": "Blocked rmsnorm, 64 rows", "idea": "Rows in blocks of 64."})
    thesis.refresh_from_db()
    assert edited.status_code == 302 and (thesis.title, thesis.idea) == ("Blocked rmsnorm, 64 rows", "Rows in blocks of 64.")
    assert logged_in_client.post(url, {"title": "bad\u202e", "idea": "x"}).status_code == 422

    other = Client()
    other.force_login(_other_user("mallory"))
    assert other.post(url, {"title": "Mine now", "idea": "x"}).status_code == 403
    assert Thesis.objects.get(pk=thesis.pk).title == "Blocked rmsnorm, 64 rows"

    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
    sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=1)
    refused = logged_in_client.post(url, {"title": "Rewritten after the fact", "idea": "x"})
    assert refused.status_code == 422 and "what its candidates were judged under" in refused.content.decode()
    assert Thesis.objects.get(pk=thesis.pk).title == "Blocked rmsnorm, 64 rows"
    assert 'id="edit-thesis"' not in logged_in_client.get(thesis.get_absolute_url()).content.decode()
    # Opened by its address, the form is not offered either: the thesis page says why.
    opened = logged_in_client.get(url, follow=True)
    assert opened.redirect_chain == [(thesis.get_absolute_url(), 302)]
    assert "what its candidates were judged under" in opened.content.decode()
    assert other.get(url).status_code == 403


def test_an_archived_thesis_leaves_the_dashboard_and_takes_no_sweep_until_restored(
        logged_in_client, make_thesis, user, monkeypatch):
    from django.test import Client

    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)
    thesis = make_thesis(title="An idea that did not pan out")
    sweep = sweeps.sweep_start(thesis=thesis, started_by=user, kernel="blocked", strategy="grid", budget=1)
    # Not while a sweep of it may still run.
    assert logged_in_client.post(reverse("thesis_archive", args=[thesis.pk]), follow=True).status_code == 200
    assert Thesis.objects.get(pk=thesis.pk).archived_at is None
    sweep.status = sweep.Status.FINISHED
    sweep.save(update_fields=["status"])

    stranger = Client()
    stranger.force_login(_other_user("mallory"))
    assert stranger.post(reverse("thesis_archive", args=[thesis.pk])).status_code == 403
    page = logged_in_client.post(reverse("thesis_archive", args=[thesis.pk]), follow=True).content.decode()
    assert 'id="archived"' in page and "closed to new sweeps" in page and 'id="sweeps-closed"' in page
    def listed(**query) -> bool:
        theses = logged_in_client.get(reverse("dashboard"), query).content.decode().split("<h2>Recent sweeps</h2>")[0]
        return "An idea that did not pan out" in theses
    assert not listed() and listed(archived="1")
    with pytest.raises(ValidationError, match="archived: restore it to start a sweep"):
        sweeps.sweep_start(thesis=Thesis.objects.get(pk=thesis.pk), started_by=user, kernel="blocked",
                             strategy="grid", budget=1)
    # Staff may restore it too.
    staff = Client()
    staff.force_login(_other_user("grace", is_staff=True))
    staff.post(reverse("thesis_restore", args=[thesis.pk]))
    restored = Thesis.objects.get(pk=thesis.pk)
    assert restored.archived_at is None and restored.archived_by is None and listed()


def test_the_form_names_every_problem_at_once(logged_in_client):
    """It named one per submit: as many submits as mistakes."""
    evidence = SimpleUploadedFile("kern_sum.csv", b"not,a,profile\n1,2,3\n", content_type="text/csv")
    response = logged_in_client.post(reverse("thesis_new"), {**_form(
        title="bad\u200btitle", allowed_paths="../../etc/passwd", batch_sizes="0"), "evidence": evidence})
    html = response.content.decode()
    assert response.status_code == 422
    assert "U+200B" in html and "must be a relative path" in html
    assert html.count('class="error"') >= 4, html  # the title, the paths, the workloads, the evidence
    assert not Thesis.objects.exists()
