"""An imported win is badged as such and kept only once a worker of the lab, measuring the
same commit again, also found a win (reviews.verification).

The attack is the security review's: a results file that claims a win it never measured.
Here the kernel is `blocked` at its shipped point, which at 64 tokens runs the very
operations the kept baseline runs; the file says it is 1.8 times faster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.cache import cache
from django.core.management import CommandError, call_command

from research import candidates, provenance, queueing, sweep_control, workers
import workspace
from research.models import Candidate, Sweep
from research.tasks import evaluate_candidate
from reviews import selectors
from reviews.services import candidate_keep, candidate_keep_unverified_request
from reviews.verification import verification, verification_start
from runners.harness import machine
from tests.celery_worker import cpu_worker
from tests.reviewing import make_reviewer, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, waiting_win, workspace_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
SAME_AS_BASELINE = {"block_rows": 4096, "formulation": "rsqrt", "upcast": "full"}


@pytest.fixture(scope="module")
def honest_results(tmp_path_factory) -> Path:
    """A real CPU sweep of the one point, as a GPU host would write it."""
    out = tmp_path_factory.mktemp("verify") / "results.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "sweep", "rmsnorm", "blocked", "--strategy", "listed",
         "--points", json.dumps([SAME_AS_BASELINE]), "--ctx", "64", "--batch", "1", "--time-budget", "0.05",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    return out


def _forged_win(honest: Path, tmp_path: Path) -> Path:
    """The honest file with its result rewritten into a win, consistent enough to parse."""
    header, line = (json.loads(text) for text in honest.read_text().splitlines())
    result = line["result"]
    result.update(verdict="win", correct=True, error=None, guards=[
        {"name": name, "status": "pass", "detail": "as claimed"}
        for name in ("loads", "correctness", "clock", "protected-settings")])
    for workload in result["workloads"]:
        workload.update(speedup=1.8, significant=True, speedup_ci=[1.7, 1.9], p_value=1e-9)
        if workload.get("baseline_ms"):
            workload["candidate_ms"] = workload["baseline_ms"] / 1.8
    result["dispatch"] = {"axis": "tokens", "min": 64, "max": 64, "sizes": [64], "covers_all": True,
                          "summary": "candidate for tokens 64–64"}
    forged = tmp_path / "forged.jsonl"
    forged.write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n")
    return forged


@pytest.fixture
def imported_win(honest_results, people, workspace_dir, tmp_path) -> Candidate:
    """bob imports the forged file into ada's thesis."""
    thesis = make_thesis(people.author, context_lengths=[64], batch_sizes=[1])
    call_command("import_results", str(_forged_win(honest_results, tmp_path)), thesis=thesis.pk,
                 user=people.producer.username)
    return Sweep.objects.get(strategy=Sweep.Strategy.IMPORTED).candidates.get()


@pytest.fixture
def sent(monkeypatch) -> list[tuple[int, str, str]]:
    """Evaluations sent to the queue, (candidate, dispatch token, queue): run here by hand."""
    messages: list[tuple[int, str, str]] = []
    monkeypatch.setattr(queueing, "evaluation_send", lambda *message: messages.append(message))
    return messages


def test_the_forged_win_waits_badged_and_its_keep_is_refused_unverified(imported_win, people, client):
    assert imported_win.verdict == "win" and provenance.is_imported(imported_win)
    assert imported_win in selectors.review_queue()
    client.force_login(people.reviewer)
    queue = client.get("/reviews/").content.decode()
    assert "imported by bob, not reproduced here" in queue
    page = client.get(imported_win.get_absolute_url()).content.decode()
    assert 'data-state="none"' in page and 'id="verify"' in page
    main_before = workspace.main_head()
    with pytest.raises(ValidationError) as refusal:
        candidate_keep(candidate=imported_win, reviewer=people.reviewer, commit=imported_win.commit)
    assert refusal.value.code == "unverified"
    assert "no worker of the lab has measured it" in " ".join(refusal.value.messages)
    assert workspace.main_head() == main_before and not imported_win.reviews.exists()


def test_a_worker_measures_the_forged_win_again_and_finds_no_win(imported_win, people, client, sent):
    client.force_login(people.reviewer)
    response = client.post(f"/candidates/{imported_win.pk}/verify/")
    assert response.status_code == 302
    run = Candidate.objects.get(sweep__verifies=imported_win)
    assert run.sweep.strategy == Sweep.Strategy.VERIFY and run.sweep.queue == "runner.cpu"
    assert run.source == imported_win.source and run.sweep.base_commit == imported_win.sweep.base_commit
    assert workspace.read_file(run.commit, workspace.kept_path("rmsnorm", "cpu")) == imported_win.source
    assert verification(imported_win).state == "pending"
    # Not a new candidate: nothing for the queue or the path chart.
    assert run not in selectors.review_queue()
    assert run.label not in [point["candidate"] for point in selectors.path_points()]
    # A second request while it waits is refused.
    again = client.post(f"/candidates/{imported_win.pk}/verify/")
    assert again.status_code == 422 and b"not measured again: verification" in again.content

    [(candidate_id, dispatch, queue)] = sent
    assert (candidate_id, queue) == (run.pk, "runner.cpu")
    evaluate_candidate(candidate_id, dispatch)  # the worker's task, the real harness
    run.refresh_from_db()
    assert run.status == Candidate.Status.DONE and run.verdict != "win", run.result
    assert run.provenance["by"] == "worker" and run.provenance["queue"] == "runner.cpu"
    assert run.result["machine"]["cores"]
    state = verification(imported_win)
    assert state.state == "disagrees" and f"found {run.verdict}, not a win" in state.detail
    with pytest.raises(ValidationError) as refusal:
        candidate_keep(candidate=imported_win, reviewer=people.reviewer, commit=imported_win.commit)
    assert refusal.value.code == "unverified" and "not a win" in " ".join(refusal.value.messages)
    page = client.get(imported_win.get_absolute_url()).content.decode()
    assert 'data-state="disagrees"' in page and "not reproduced" in page


def test_an_imported_win_a_worker_confirms_can_be_kept(imported_win, people, client, sent):
    run = verification_start(candidate=imported_win, requested_by=people.reviewer)
    # TEST DATA: the worker's result written by hand (the real run is the test above).
    record(run, recorded_result((1.5,), names=["t=64,dtype=float32"]))
    Candidate.objects.filter(pk=run.pk).update(provenance=provenance.worker_provenance(queue="runner.cpu"))
    assert verification(imported_win).agrees
    client.force_login(people.reviewer)
    assert "imported by bob, verified here" in client.get("/reviews/").content.decode()
    review = candidate_keep(candidate=imported_win, reviewer=people.reviewer, commit=imported_win.commit)
    assert review.merge_commit == workspace.main_head()


def test_the_verification_run_itself_is_never_decided_on(imported_win, people, client, sent):
    # Its source is the import's and its sweep the asker's: keeping it would slip the
    # import past its own gate, with the wrong person as its producer.
    run = verification_start(candidate=imported_win, requested_by=people.reviewer)
    record(run, recorded_result((1.5,), names=["t=64,dtype=float32"]))
    with pytest.raises(ValidationError, match=f"this run verifies candidate {imported_win.label}"):
        candidate_keep(candidate=run, reviewer=make_reviewer("hedy"), commit=run.commit)
    client.force_login(people.producer)
    people.producer.user_permissions.add(Permission.objects.get(codename="decide_candidate"))
    refused = client.post(f"/candidates/{run.pk}/decide/", {"decision": "keep", "commit": run.commit})
    assert refused.status_code == 409 and not run.reviews.exists()


def test_one_run_that_finds_no_win_refutes_the_import_for_good(imported_win, people, sent):
    first = verification_start(candidate=imported_win, requested_by=people.reviewer)
    record(first, recorded_result((1.0,), names=["t=64,dtype=float32"]))  # TEST DATA: no gain
    assert verification(imported_win).state == "disagrees"
    # No second try until noise gives a win.
    with pytest.raises(ValidationError, match="not measured again"):
        verification_start(candidate=imported_win, requested_by=people.reviewer)
    # A run the harness could not finish (a kernel that hangs only on the lab's worker) refutes too.
    assert Candidate.objects.filter(pk=first.pk).update(status=Candidate.Status.FAILED, verdict="rejected")
    assert verification(imported_win).state == "disagrees"
    # Only a run whose worker was lost counts for neither side: it may be asked again.
    Candidate.objects.filter(pk=first.pk).update(provenance={"by": "worker", "lost_worker": True})
    assert verification(imported_win).state == "none"
    second = verification_start(candidate=imported_win, requested_by=people.reviewer)
    assert second.pk != first.pk


def test_neither_the_author_nor_the_importer_can_stop_a_verification(imported_win, people, sent):
    run = verification_start(candidate=imported_win, requested_by=people.reviewer)
    for person in (people.author, people.producer):
        person.is_staff = True  # not even as staff
        person.save()
        assert not sweep_control.sweep_can_control(sweep=run.sweep, user=person)
        with pytest.raises(PermissionDenied):
            sweep_control.sweep_cancel(sweep=run.sweep, by=person)
    assert sweep_control.sweep_can_control(sweep=run.sweep, user=people.reviewer)


def test_an_import_is_never_revised(imported_win, people):
    with pytest.raises(ValidationError, match="a candidate of an imported sweep is never revised"):
        candidates.candidate_revise(candidate=imported_win, source=imported_win.source + "\n# again\n",
                                  revised_by=people.producer)


def test_keeping_unverified_waits_for_a_running_verification_and_yields_to_a_live_worker(
        imported_win, people, sent):
    verification_start(candidate=imported_win, requested_by=people.reviewer)
    with pytest.raises(ValidationError) as refusal:
        candidate_keep_unverified_request(candidate=imported_win, reviewer=people.reviewer,
                                          commit=imported_win.commit)
    assert refusal.value.code == "verifying"
    Candidate.objects.filter(sweep__verifies=imported_win).delete()
    Sweep.objects.filter(verifies=imported_win).delete()
    with cpu_worker():  # a worker of this class is live: verify, do not vote
        deadline = time.monotonic() + 20
        while "runner.cpu" not in (workers.live_queues() or ()) and time.monotonic() < deadline:
            cache.delete(workers.CACHE_KEY)
        with pytest.raises(ValidationError) as refusal:
            candidate_keep_unverified_request(candidate=imported_win, reviewer=people.reviewer,
                                              commit=imported_win.commit)
    assert refusal.value.code == "verifiable"


def test_keeping_unverified_fails_closed_when_the_broker_cannot_say_which_workers_live(
        imported_win, people, monkeypatch):
    monkeypatch.setattr(workers, "live_queues", lambda: None)
    with pytest.raises(ValidationError, match="cannot be asked") as refusal:
        candidate_keep_unverified_request(candidate=imported_win, reviewer=people.reviewer,
                                          commit=imported_win.commit)
    assert refusal.value.code == "workers-unknown"
    assert not imported_win.unverified_requests.exists()


def test_a_verified_keep_writes_the_workers_figures_not_the_files(imported_win, people, sent):
    run = verification_start(candidate=imported_win, requested_by=people.reviewer)
    # TEST DATA: the worker found a smaller win on a narrower range than the file claimed.
    result = recorded_result((1.12,), names=["t=64,dtype=float32"])
    result["dispatch"] = {"axis": "tokens", "min": 64, "max": 64, "sizes": [64], "covers_all": False,
                          "summary": "candidate for tokens 64–64 (the worker's)"}
    record(run, result)
    assert imported_win.geomean_speedup > 1.7
    review = candidate_keep(candidate=imported_win, reviewer=people.reviewer, commit=imported_win.commit,
                            dispatch_min=64, dispatch_max=64)
    [entry] = workspace.dispatch_entries("rmsnorm", "cpu")[:1]
    assert entry["geomean_speedup"] == pytest.approx(1.12) and entry["verified"] is True
    assert "geomean 1.120x" in workspace.commit_info(review.merge_commit)["message"]


def test_the_importer_and_the_author_do_not_ask_for_the_check(imported_win, people):
    for person in (people.producer, people.author):
        person.user_permissions.add(Permission.objects.get(codename="decide_candidate"))
        fresh = type(person).objects.get(pk=person.pk)
        with pytest.raises(PermissionDenied, match="a colleague asks for its check"):
            verification_start(candidate=imported_win, requested_by=fresh)


def test_a_forged_machine_state_is_refused_at_import(honest_results, people, workspace_dir, tmp_path):
    header, line = (json.loads(text) for text in honest_results.read_text().splitlines())
    thesis = make_thesis(people.author, context_lengths=[64], batch_sizes=[1])
    for where, machine_value in (("header", "x"), ("result", ["a"]), ("result", {"gpu": "y" * 500})):
        forged_header, forged_line = json.loads(json.dumps(header)), json.loads(json.dumps(line))
        (forged_header if where == "header" else forged_line["result"])["machine"] = machine_value
        path = tmp_path / "machine.jsonl"
        path.write_text(json.dumps(forged_header) + "\n" + json.dumps(forged_line) + "\n")
        with pytest.raises(CommandError, match="'machine'"):
            call_command("import_results", str(path), thesis=thesis.pk, user=people.producer.username)
    assert not Sweep.objects.exists()


def test_only_a_reviewer_verifies_and_only_an_imported_win(imported_win, people, workspace_dir, no_enqueue):
    with pytest.raises(PermissionDenied):
        verification_start(candidate=imported_win, requested_by=people.outsider)
    own = record(start_sweep(imported_win.sweep.thesis, people.producer, budget=1).candidates.get(),
                 recorded_result((1.5,), names=["t=64,dtype=float32"]))
    with pytest.raises(ValidationError, match="measured by a worker of the lab"):
        verification_start(candidate=own, requested_by=people.reviewer)
    assert not Sweep.objects.filter(strategy=Sweep.Strategy.VERIFY).exists()


def test_an_import_permission_is_a_permission_like_any_other(people):
    assert not people.producer.has_perm("research.import_results")
    people.producer.user_permissions.add(Permission.objects.get(codename="import_results"))
    assert type(people.producer).objects.get(pk=people.producer.pk).has_perm("research.import_results")


# -- keeping unverified: two reviewers, and marked ------------------------------------------

def test_two_reviewers_keep_an_import_no_worker_verified_and_it_stays_marked(imported_win, people, client):
    grace, hedy = people.reviewer, make_reviewer("hedy")
    client.force_login(grace)
    asked = client.post(f"/candidates/{imported_win.pk}/decide/", {
        "decision": "ask-unverified", "commit": imported_win.commit, "comment": "no H200 worker here",
        "dispatch_min": 64, "dispatch_max": 64}, HTTP_HX_REQUEST="true")
    assert asked.status_code == 200 and b'id="unverified-request"' in asked.content
    assert not imported_win.reviews.exists()  # asked, not kept: main is untouched
    # The one who asked cannot be the one who confirms.
    with pytest.raises(PermissionDenied, match="a second reviewer must confirm"):
        candidate_keep(candidate=imported_win, reviewer=grace, commit=imported_win.commit, confirm_unverified=True)
    # A plain keep is still refused, by anyone.
    with pytest.raises(ValidationError) as refusal:
        candidate_keep(candidate=imported_win, reviewer=hedy, commit=imported_win.commit)
    assert refusal.value.code == "unverified"

    review = candidate_keep(candidate=imported_win, reviewer=hedy, commit=imported_win.commit,
                            comment="agreed", confirm_unverified=True)
    assert review.unverified_request.requested_by == grace and review.reviewer == hedy
    assert (review.dispatch_min, review.dispatch_max) == (64, 64)  # the range grace asked for
    assert review.comment.startswith("Kept unverified: asked by grace (no H200 worker here)")
    [entry] = workspace.dispatch_entries("rmsnorm", "cpu")[:1]
    assert entry["candidate"] == imported_win.label and entry["verified"] is False
    [point] = [p for p in selectors.path_points() if p["candidate"] == imported_win.label]
    assert point["state"] == "kept" and point["unverified"] is True
    client.force_login(hedy)
    page = client.get(imported_win.get_absolute_url()).content.decode()
    assert 'id="kept-unverified"' in page
    op_page = client.get("/ops/rmsnorm/").content.decode()
    assert '"name": "kept unverified"' in op_page and ">unverified</span>" in op_page
    # Decided: nothing waits on a check any more.
    with pytest.raises(ValidationError, match="already decided"):
        verification_start(candidate=imported_win, requested_by=hedy)


def test_a_win_a_worker_refuted_is_never_kept_unverified(imported_win, people, sent):
    run = verification_start(candidate=imported_win, requested_by=people.reviewer)
    # TEST DATA: a worker's no-gain, written by hand (the real run is the test above).
    record(run, recorded_result((1.0,), names=["t=64,dtype=float32"]))
    with pytest.raises(ValidationError) as refusal:
        candidate_keep_unverified_request(candidate=imported_win, reviewer=people.reviewer,
                                          commit=imported_win.commit)
    assert refusal.value.code == "refuted"
    assert not imported_win.unverified_requests.exists()


def test_a_win_measured_here_is_not_kept_unverified(waiting_win, people):
    with pytest.raises(ValidationError) as refusal:
        candidate_keep_unverified_request(candidate=waiting_win, reviewer=people.reviewer, commit=waiting_win.commit)
    assert refusal.value.code == "not-imported"


# -- machine states side by side --------------------------------------------------------

H200 = {"host": "gpu-7", "gpu": "NVIDIA H200", "driver": "580.65", "cuda": "13.0", "sm_clock_mhz": 1980,
        "sm_clock_max_mhz": 1980, "sm_clock_locked": False, "memory_clock_max_mhz": 3201,
        "power_limit_w": 700, "pcie": "gen 5 x16", "ecc": "on", "persistence": "on"}


def test_machine_states_differ_only_on_what_sets_a_kernels_speed():
    assert machine.differences(H200, {**H200, "host": "gpu-8", "sm_clock_mhz": 1410}) == []
    assert machine.differences(H200, {**H200, "power_limit_w": 500, "persistence": "off"}) == [
        "power limit (W)", "persistence mode"]
    assert machine.differences(H200, {"gpu": "NVIDIA H200"}) == []  # an older result that said less
    assert machine.differences(None, H200) == []


def test_the_cpu_state_is_read_from_this_machine():
    state = machine.machine_state("cpu")
    assert state["cores"] and state["torch"] and state["host"]
    assert "gpu" not in state


def test_the_review_page_sets_the_machines_side_by_side_and_warns_when_they_differ(
        people, workspace_dir, no_enqueue, client):
    thesis = make_thesis(people.author)
    first = record(start_sweep(thesis, people.producer, budget=1).candidates.get(),
                   {**recorded_result(), "machine": H200})
    candidate_keep(candidate=first, reviewer=people.reviewer, commit=first.commit, dispatch_min=64, dispatch_max=64)
    second = record(start_sweep(thesis, people.producer, budget=1).candidates.get(),
                    {**recorded_result(), "machine": {**H200, "power_limit_w": 450}})
    client.force_login(people.reviewer)
    page = client.get(second.get_absolute_url()).content.decode()
    assert 'id="machine-differs"' in page and "power limit (W)" in page
    assert f"The kept kernel&#x27;s ({first.label})" in page or f"The kept kernel's ({first.label})" in page
    assert "<td>450</td><td>700</td>" in page
    # A keep on another hardware class is not this class's kept kernel: nothing to set beside it.
    other = record(start_sweep(make_thesis(people.author, title="On the H200", hardware="h200",
                                           context_lengths=[4096]), people.producer, budget=1).candidates.get(),
                   {**recorded_result((1.3,), names=["t=4096,dtype=bfloat16"]), "device": "cuda",
                    "machine": H200})
    page = client.get(other.get_absolute_url()).content.decode()
    assert "(the shipped baseline: none recorded)" in page and 'id="machine-differs"' not in page
