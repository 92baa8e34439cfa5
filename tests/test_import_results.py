"""Remote GPU hosts: the harness's sweep mode writes a results file; the app imports it
(manage.py import_results, POST /api/theses/ID/results) as if workers had run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.urls import reverse

from research import provenance, selectors
import workspace
from research.api_tokens import api_token_create, api_token_revoke
from research.models import ApiToken, Candidate, Event, Evidence, Measurement, Sweep, Thesis
from runners import space
from runners.harness import results_file
from runners.ops import get_op

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / "tests" / "fixtures" / "evidence" / "nsys_kern_sum.csv"


@pytest.fixture(scope="module")
def results_path(tmp_path_factory) -> Path:
    """One real sweep on the CPU, 2 points with a tiny budget, shared by the tests here."""
    out = tmp_path_factory.mktemp("remote") / "results.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "sweep", "rmsnorm", "blocked", "--strategy", "grid",
         "--budget", "2", "--ctx", "64", "--batch", "1", "--time-budget", "0.05", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 candidates in ")
    return out


@pytest.fixture
def thesis(make_thesis):
    return make_thesis(context_lengths=[64], batch_sizes=[1])


@pytest.fixture
def published(monkeypatch):
    """What would go to open browsers: the messages published after commit."""
    messages: list[dict] = []
    monkeypatch.setattr("research.events.publish_sweep_event", messages.append)
    return messages


def _nothing_written() -> bool:
    return not (Sweep.objects.exists() or Candidate.objects.exists() or Event.objects.exists()
                or Measurement.objects.exists())


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "edited.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# -- the harness's sweep mode ---------------------------------------------------------

def test_the_sweep_subcommand_writes_a_header_then_one_evaluated_candidate_a_line(results_path):
    parsed = results_file.read(results_path.read_bytes())
    header = parsed.header
    kernel_source = get_op("rmsnorm").kernels()["blocked"].read_text()
    assert header["op"] == "rmsnorm" and header["kernel"] == "blocked" and header["strategy"] == "grid"
    assert header["kernel_source"] == kernel_source and header["device"] == "cpu"
    assert header["context_lengths"] == [64] and header["batch_sizes"] == [1]
    assert header["baseline_kernel"] == "baseline"
    assert header["baseline_source"] == get_op("rmsnorm").baseline_path.read_text()
    assert header["harness"]["torch"]
    points = space.grid_points(space.read_literals(kernel_source)[1])[:2]
    assert [c.number for c in parsed.candidates] == [1, 2]
    assert [c.params for c in parsed.candidates] == points
    for candidate in parsed.candidates:
        assert candidate.source == space.materialize(kernel_source, candidate.params)
        assert candidate.result["correct"] is True and candidate.result["verdict"] in {"win", "no-gain"}
        assert [w["name"] for w in candidate.result["workloads"]] == ["t=64,dtype=float32", "t=64,dtype=bfloat16"]


def test_the_sweep_subcommand_never_overwrites_a_results_file(results_path):
    before = results_path.read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "sweep", "rmsnorm", "blocked", "--budget", "1",
         "--out", str(results_path)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "exists" in done.stderr
    assert results_path.read_bytes() == before


def test_a_listed_sweep_evaluates_exactly_the_points_it_names(tmp_path):
    out = tmp_path / "listed.jsonl"
    point = {"block_rows": 16384, "formulation": "functional", "upcast": "full"}
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "sweep", "rmsnorm", "blocked", "--strategy", "listed",
         "--points", json.dumps([point]), "--ctx", "64", "--batch", "1", "--time-budget", "0.05",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    parsed = results_file.read(out.read_bytes())
    assert parsed.header["strategy"] == "listed" and parsed.header["points"] == 1
    kernel_source = get_op("rmsnorm").kernels()["blocked"].read_text()
    # Written in SPACE's order, whatever order the point was given in.
    assert [c.params for c in parsed.candidates] == [
        {key: point[key] for key in space.read_literals(kernel_source)[1]}]
    assert parsed.candidates[0].source == space.materialize(kernel_source, point)
    assert parsed.candidates[0].result["correct"] is True


def test_a_prefix_left_by_a_crash_is_a_valid_file(results_path):
    first_two = b"".join(results_path.read_bytes().splitlines(keepends=True)[:2])
    assert len(results_file.read(first_two).candidates) == 1


# -- importing --------------------------------------------------------------------------

def test_the_command_imports_a_sweep_with_its_candidates_measurements_and_events(
        results_path, thesis, user, published, capsys):
    call_command("import_results", str(results_path), thesis=thesis.pk, user=user.username)
    sweep = Sweep.objects.get()
    assert f"imported 2 candidates as sweep {sweep.pk}" in capsys.readouterr().out
    assert sweep.strategy == Sweep.Strategy.IMPORTED and sweep.status == Sweep.Status.FINISHED
    assert sweep.thesis == thesis and sweep.started_by == user and sweep.kernel == "blocked"
    assert (sweep.done, sweep.total) == (2, 2) and sweep.hardware == "cpu"
    assert sweep.context.startswith("Imported results file sha256:")
    lines = _lines(results_path)[1:]
    for candidate, line in zip(sweep.candidates.all(), lines, strict=True):
        assert candidate.status == Candidate.Status.DONE and candidate.proposed_by == "grid"
        assert candidate.params == line["params"] and candidate.source == line["source"]
        assert candidate.verdict == line["result"]["verdict"] and candidate.result == line["result"]
        assert candidate.measurements.count() == 2 and candidate.guards.exists()
        # Committed into the workspace as sweep_start does: its branch, forked from main.
        assert workspace.branches("candidate/")[candidate.branch] == candidate.commit
        assert workspace.read_file(candidate.commit, workspace.kept_path("rmsnorm", "cpu")) == candidate.source
        assert workspace.is_ancestor(sweep.base_commit, candidate.commit)
        assert candidate.provenance == {
            "by": "import", "imported_by": "ada", "through": "the import_results command", "host": None,
            "claimed_host": _lines(results_path)[0]["machine"]["host"], "run": _lines(results_path)[0]["run"],
            "harness_commit": _lines(results_path)[0]["harness"]["commit"]}
        # The harness reports the machine beside every result.
        assert candidate.result["machine"]["cores"] == os.cpu_count()
    events = list(Event.objects.filter(sweep=sweep))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    types = [e.type for e in events]
    assert types[0] == "sweep.created" and types[-1] == "sweep.finished"
    assert types.count("candidate.result") == 2
    # Open browsers got every stored event, in order; a reconnecting one is replayed them.
    assert published == [e.as_message() for e in events]
    assert selectors.sweep_events_after(sweep.pk, 0) == [e.as_message() for e in events]


def test_importing_the_same_file_twice_is_refused_and_writes_nothing_more(results_path, thesis, user):
    call_command("import_results", str(results_path), thesis=thesis.pk, user=user.username)
    counts = (Sweep.objects.count(), Candidate.objects.count(), Event.objects.count())
    with pytest.raises(CommandError) as error:
        call_command("import_results", str(results_path), thesis=thesis.pk, user=user.username)
    assert error.value.returncode == 2
    assert f"already imported as sweep {Sweep.objects.get().pk}" in str(error.value)
    assert (Sweep.objects.count(), Candidate.objects.count(), Event.objects.count()) == counts


def test_results_from_another_gpu_than_the_hardware_class_are_refused(results_path, thesis, user, tmp_path):
    """An H100's numbers filed as an H200's would move the H200's path and dispatch."""
    header, *lines = [json.loads(line) for line in results_path.read_text().splitlines()]
    moved = tmp_path / "h100.jsonl"
    moved.write_text("\n".join(json.dumps(record) for record in [
        {**header, "device": "cuda", "hardware": "NVIDIA H100 80GB HBM3"},
        *({**line, "result": {**line["result"], "device": "cuda"}} for line in lines)]) + "\n")
    thesis.hardware = "h200"
    thesis.save()
    with pytest.raises(CommandError, match="measured on NVIDIA H100 80GB HBM3, not on NVIDIA H200"):
        call_command("import_results", str(moved), thesis=thesis.pk, user=user.username)
    with pytest.raises(CommandError, match="measured on NVIDIA H100 80GB HBM3, not on NVIDIA H200"):
        call_command("import_results", str(moved), thesis=thesis.pk, user=user.username, hardware="h200")
    assert not Sweep.objects.exists()
    # As the H100's class, the card it ran on, it imports.
    call_command("import_results", str(moved), thesis=thesis.pk, user=user.username, hardware="h100")
    assert Sweep.objects.get().hardware == "h100"


def test_the_same_results_under_another_run_id_or_spelling_are_refused_too(results_path, thesis, user, tmp_path):
    call_command("import_results", str(results_path), thesis=thesis.pk, user=user.username)
    header, *lines = [json.loads(line) for line in results_path.read_text().splitlines()]
    renamed = tmp_path / "renamed.jsonl"
    # A new run id and start time, keys in another order, other spacing: the same results.
    renamed.write_text("\n".join(json.dumps(dict(reversed(list(record.items()))), indent=None, separators=(", ", ": "))
                                  for record in [{**header, "run": "another-run", "started_at": "2026-12-01T09:00:00Z"},
                                                 *lines]) + "\n")
    assert renamed.read_bytes() != results_path.read_bytes()
    with pytest.raises(CommandError, match="already imported as sweep"):
        call_command("import_results", str(renamed), thesis=thesis.pk, user=user.username)
    # Another seed or machine claimed for the very same numbers: the same results too.
    # Nor do another budget, hardware name, harness version or a key of the file's own.
    for claim in ({"seed": 12345}, {"machine": {**header.get("machine", {}), "host": "another-host"}},
                  {"budget": header["budget"] + 1}, {"hardware": "x86_64x"}, {"note": "again"},
                  {"harness": {**header["harness"], "torch": "2.13.0 "}}):
        reclaimed = tmp_path / "reclaimed.jsonl"
        in_result = {key: value for key, value in claim.items() if key in ("seed", "machine", "note")}
        reclaimed.write_text("\n".join(json.dumps(record) for record in [
            {**header, **claim}, *({**line, "result": {**line["result"], **in_result}} for line in lines)]) + "\n")
        with pytest.raises(CommandError, match="already imported as sweep"):
            call_command("import_results", str(reclaimed), thesis=thesis.pk, user=user.username)
    # One changed measurement is another result, and imports.
    changed = tmp_path / "changed.jsonl"
    first = lines[0]
    first["result"]["guards"] = [*first["result"]["guards"], {"name": "note", "status": "warn", "detail": "re-run"}]
    changed.write_text("\n".join(json.dumps(record) for record in [header, *lines]) + "\n")
    call_command("import_results", str(changed), thesis=thesis.pk, user=user.username)
    assert Sweep.objects.count() == 2


def _truncated(path: Path, tmp_path: Path) -> Path:
    data = path.read_bytes()
    cut = tmp_path / "truncated.jsonl"
    cut.write_bytes(data[: len(data) - 200])
    return cut


def _wrong_op(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)
    lines[0]["op"] = "dsa_indexer_topk"
    return _write(tmp_path, lines)


def _edited_source(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)
    lines[2]["source"] += "\n# and something else\n"
    return _write(tmp_path, lines)


def _promoted_to_win(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)
    lines[1]["result"]["verdict"] = "win"
    return _write(tmp_path, lines)


def _carriage_return_in_source(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)  # a lone CR ends a line for Python, not for the review's diff
    lines[1]["source"] = lines[1]["source"].replace("\n", "  # note\r    y = 0\n", 1)
    return _write(tmp_path, lines)


def _long_claimed_commit(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)  # copied onto every candidate's provenance
    lines[0]["harness"]["commit"] = "f" * 10_000
    return _write(tmp_path, lines)


def _huge_guard_detail(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)  # shown on the review page: 40 MB of it made a 40 MB page
    lines[1]["result"]["guards"][0]["detail"] = "B" * 40_000
    return _write(tmp_path, lines)


def _huge_header_text(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)  # copied into the sweep's context, served whole by the API
    lines[0]["hardware"] = "x" * 5_000_000
    return _write(tmp_path, lines)


def _huge_result_key(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)  # a key is as much text as a value, in the export and the API
    lines[1]["result"]["e2e"] = {"k" * 9_000: 1}
    return _write(tmp_path, lines)


def _source_nested_too_deep(path: Path, tmp_path: Path) -> Path:
    lines = _lines(path)  # ast.parse raised RecursionError: a 500, a traceback from the command
    deep = "\nZ = " + "1+" * 60_000 + "1\n"
    lines[0]["kernel_source"] += deep
    for line in lines[1:]:
        line["source"] += deep
    return _write(tmp_path, lines)


@pytest.mark.parametrize(("edit", "message"), [
    (_truncated, "line 3: not valid JSON"),
    (_huge_guard_detail, "line 2: candidate 1: 'result.guards[0].detail' holds 40,000 characters; "
                         "a file's texts are at most 8,000"),
    (_huge_header_text, "line 1: 'the header.hardware' holds 5,000,000 characters"),
    (_huge_result_key, "line 2: candidate 1: 'result.e2e key' holds 9,000 characters"),
    (_source_nested_too_deep, "line 2: candidate 1: nests too deeply for Python's parser"),
    (_carriage_return_in_source, "line 2: candidate 1: its source holds a carriage return"),
    (_long_claimed_commit, "line 1: 'harness.commit' must be a string of at most 200 characters"),
    (_wrong_op, "line 2: candidate 1: the result's op 'rmsnorm' is not the header's 'dsa_indexer_topk'"),
    (_edited_source, "line 3: candidate 2's source is not the kernel with PARAMS set to its params"),
    (_promoted_to_win, "line 2: candidate 1: a 'win' needs a dispatch range"),
])
def test_a_bad_file_is_refused_naming_the_line_and_nothing_is_written(
        results_path, thesis, user, tmp_path, edit, message):
    with pytest.raises(CommandError) as error:
        call_command("import_results", str(edit(results_path, tmp_path)), thesis=thesis.pk, user=user.username)
    assert error.value.returncode == 2 and "\n" not in str(error.value)
    assert message in str(error.value)
    assert _nothing_written()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"op": "dsa_indexer_topk", "context_lengths": [], "batch_sizes": []},
     "the results are for op 'rmsnorm'; thesis #{id} is about 'dsa_indexer_topk'"),
    ({"required_dsl": "triton"}, "kernel 'blocked' was evaluated as torch; thesis #{id} requires triton"),
    ({"context_lengths": [64, 256]}, "the results cover workloads t=64,dtype=float32, t=64,dtype=bfloat16"),
])
def test_a_file_that_does_not_fit_the_thesis_is_refused(results_path, make_thesis, user, overrides, message):
    other = make_thesis(**{"context_lengths": [64], "batch_sizes": [1], **overrides})
    with pytest.raises(CommandError) as error:
        call_command("import_results", str(results_path), thesis=other.pk, user=user.username)
    assert error.value.returncode == 2
    assert message.format(id=other.pk) in str(error.value)
    assert _nothing_written()


def test_results_timed_against_a_kernel_never_kept_are_refused(results_path, thesis, user, tmp_path):
    lines = _lines(results_path)
    lines[0]["baseline_source"] += "\n# a local edit\n"
    with pytest.raises(CommandError, match="never the kept kernel of cpu on main"):
        call_command("import_results", str(_write(tmp_path, lines)), thesis=thesis.pk, user=user.username)
    assert _nothing_written()


# The forged win of the security review: a pure-torch kernel that turns on TF32, its file
# named as a Triton kernel, its result lines claiming every guard passed.
TF32 = "\ntorch.backends.cuda.matmul.allow_tf32 = True\n"


def _forged(path: Path, tmp_path: Path, *, kernel: str, dsl: str, added: str) -> Path:
    lines = _lines(path)
    header = lines[0]
    header.update(kernel=kernel, dsl=dsl, kernel_source=header["kernel_source"] + added)
    for line in lines[1:]:
        line["source"] = space.materialize(header["kernel_source"], line["params"])
        line["result"]["guards"] = [{"name": "required-dsl", "status": "pass", "detail": "trust me"},
                                    {"name": "protected-settings", "status": "pass", "detail": "trust me"}]
    return _write(tmp_path, lines)


def test_the_forged_kernel_changes_a_setting_the_harness_holds_fixed_when_run(results_path, tmp_path):
    forged = _forged(results_path, tmp_path, kernel="blocked", dsl="torch", added=TF32)
    kernel = tmp_path / "kernel.py"
    kernel.write_text(json.loads(forged.read_text().splitlines()[1])["source"])
    done = subprocess.run(
        [sys.executable, "-c", "import torch, runpy, sys; before = torch.backends.cuda.matmul.allow_tf32; "
         "runpy.run_path(sys.argv[1]); print(before, torch.backends.cuda.matmul.allow_tf32)", str(kernel)],
        capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(("required_dsl", "kernel", "message"), [
    # Named and declared Triton, launching no Triton kernel: the DSL check a worker runs.
    ("triton", "blocked_triton", "candidate 1 fails the required-dsl check a worker runs: does not import triton"),
    # Honest about being torch, but TF32 on: protected-settings against the kept kernel.
    ("torch", "blocked", "candidate 1 fails the protected-settings check a worker runs: the candidate "
                         "changes what the harness holds fixed"),
])
def test_an_import_runs_the_static_checks_again_and_refuses_a_forged_pass(
        results_path, make_thesis, user, tmp_path, required_dsl, kernel, message):
    forged_thesis = make_thesis(context_lengths=[64], batch_sizes=[1], required_dsl=required_dsl)
    forged = _forged(results_path, tmp_path, kernel=kernel, dsl=required_dsl, added=TF32)
    with pytest.raises(CommandError) as error:
        call_command("import_results", str(forged), thesis=forged_thesis.pk, user=user.username)
    assert error.value.returncode == 2 and message in str(error.value)
    assert _nothing_written()


def test_a_results_file_of_empty_objects_is_refused_before_it_is_parsed(results_path, thesis, user, tmp_path):
    # 12 MB of `{},` would be ~300 MB of dicts once parsed; the count is taken first.
    header = results_path.read_text().splitlines()[0]
    amplified = tmp_path / "amplified.jsonl"
    amplified.write_text(header + '\n{"number": 1, "params": {}, "source": "x", "result": [' + "{}," * 4_000_000
                         + "{}]}\n")
    with pytest.raises(CommandError, match="JSON values and separators; at most 4,000,000 are read"):
        call_command("import_results", str(amplified), thesis=thesis.pk, user=user.username)
    assert _nothing_written()


def test_the_command_refuses_an_unknown_thesis_or_user_in_one_line(results_path, thesis, user):
    with pytest.raises(CommandError, match="no thesis 999999") as error:
        call_command("import_results", str(results_path), thesis=999999, user=user.username)
    assert error.value.returncode == 2
    with pytest.raises(CommandError, match="no user 'nobody'"):
        call_command("import_results", str(results_path), thesis=thesis.pk, user="nobody")


# -- the JSON API -------------------------------------------------------------------------

@pytest.fixture
def token(user) -> str:
    """A person's token, without the permission to import."""
    return api_token_create(user=user, name="laptop")[1]


@pytest.fixture
def host_token(user) -> str:
    """A GPU host's token: it can import and do nothing else."""
    return api_token_create(user=user, name="h200 box", host="h200-box-1")[1]


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_api_imports_a_results_file_and_serves_the_sweep(client, results_path, thesis, token, host_token,
                                                            published):
    url = f"/api/theses/{thesis.pk}/results"
    response = client.post(url, results_path.read_bytes(), content_type="application/x-ndjson",
                           headers=_auth(host_token))
    assert response.status_code == 201, response.content
    body = response.json()
    sweep = Sweep.objects.get()
    assert body["id"] == sweep.pk and body["strategy"] == "imported" and body["status"] == "finished"
    assert [c["number"] for c in body["candidates"]] == [1, 2]
    assert body["candidates"][0]["branch"] == f"candidate/{sweep.pk}-1"
    assert [m["type"] for m in published][-1] == "sweep.finished"
    again = client.post(url, results_path.read_bytes(), content_type="application/x-ndjson",
                        headers=_auth(host_token))
    assert again.status_code == 409 and again.json()["sweep"] == sweep.pk
    assert Sweep.objects.count() == 1
    fetched = client.get(f"/api/sweeps/{sweep.pk}", headers=_auth(token))
    assert fetched.status_code == 200 and fetched.json()["total"] == 2
    listed = client.get(f"/api/theses/{thesis.pk}", headers=_auth(token)).json()
    assert [s["id"] for s in listed["sweeps"]] == [sweep.pk]
    # Every result names the host of the token it came with, and who owns that token.
    for candidate in sweep.candidates.all():
        assert candidate.provenance["by"] == "import" and candidate.provenance["host"] == "h200-box-1"
        assert candidate.provenance["imported_by"] == "ada"
        assert candidate.provenance["run"] == _lines(results_path)[0]["run"]
        assert provenance.describe(candidate) == "imported by ada from h200-box-1, not reproduced here"


def test_importing_needs_a_host_token_or_the_permission(client, results_path, thesis, user, token):
    # The forged win of the security review came from an ordinary account's token.
    url = f"/api/theses/{thesis.pk}/results"
    refused = client.post(url, results_path.read_bytes(), content_type="application/x-ndjson",
                          headers=_auth(token))
    assert refused.status_code == 403 and "research.import_results" in refused.json()["detail"]
    assert _nothing_written()
    user.user_permissions.add(Permission.objects.get(codename="import_results"))
    allowed = client.post(url, results_path.read_bytes(), content_type="application/x-ndjson",
                          headers=_auth(token))
    assert allowed.status_code == 201, allowed.content
    candidate = Sweep.objects.get().candidates.first()
    assert candidate.provenance["host"] is None and candidate.provenance["through"].startswith("API token laptop")
    assert provenance.describe(candidate).startswith("imported by ada from a host that calls itself ")


def test_a_host_token_can_only_import(client, thesis, host_token):
    for response in (client.get(f"/api/theses/{thesis.pk}", headers=_auth(host_token)),
                     client.post("/api/theses", {"title": "x"}, headers=_auth(host_token))):
        assert response.status_code == 403
        assert "is the token of GPU host 'h200-box-1': it can only import results" in response.json()["detail"]
    assert Thesis.objects.count() == 1


@pytest.mark.parametrize(("edit", "message"), [
    (_truncated, "line 3: not valid JSON"),
    (_source_nested_too_deep, "line 2: candidate 1: nests too deeply"),  # was a 500
])
def test_the_api_refuses_a_bad_results_file_with_422_naming_the_line(client, results_path, thesis, host_token,
                                                                     tmp_path, edit, message):
    response = client.post(f"/api/theses/{thesis.pk}/results",
                           edit(results_path, tmp_path).read_bytes(),
                           content_type="application/x-ndjson", headers=_auth(host_token))
    assert response.status_code == 422
    assert response.json()["detail"].startswith(message)
    assert _nothing_written()


def test_a_missing_invalid_or_revoked_token_is_401(client, thesis, user, token):
    url = f"/api/theses/{thesis.pk}"
    assert client.get(url).status_code == 401
    assert client.get(url, headers=_auth("kl_not-a-token")).status_code == 401
    assert client.get(url, headers={"Authorization": f"Token {token}"}).status_code == 401
    ok = client.get(url, headers=_auth(token))
    assert ok.status_code == 200 and ok.json()["kept_kernel"]["name"]
    row = ApiToken.objects.get(name="laptop")
    assert row.last_used_at is not None and row.prefix == token[:11] and token not in row.key_hash
    api_token_revoke(token=row, revoked_by=user)
    assert client.get(url, headers=_auth(token)).status_code == 401
    # A logged-in browser session is no API credential either.
    client.force_login(user)
    assert client.get(url).status_code == 401


def test_a_script_files_a_thesis_with_evidence_through_the_api(client, token, user):
    response = client.post("/api/theses", {
        "title": "Fuse the norm", "idea": "The profile shows *two* passes.", "op": "rmsnorm",
        "hardware": "h200", "required_dsl": "torch", "context_lengths": "2048, 8192",
        "allowed_paths": "kernels/rmsnorm/kept.py\n", "evidence": EVIDENCE.open("rb"),
    }, headers=_auth(token))
    assert response.status_code == 201, response.content
    body = response.json()
    thesis = Thesis.objects.get()
    assert body["id"] == thesis.pk and thesis.author == user
    assert thesis.context_lengths == [2048, 8192] and thesis.allowed_paths == ["kernels/rmsnorm/kept.py"]
    assert body["evidence"]["format"] == "nsys-csv" and body["evidence"]["summary"]["top_kernels"]
    assert body["url"].endswith(reverse("thesis_detail", args=[thesis.pk]))


def test_a_thesis_the_form_would_refuse_is_422_and_stores_nothing(client, token):
    response = client.post("/api/theses", {
        "title": "Bad", "idea": "x", "op": "rmsnorm", "hardware": "h200", "required_dsl": "torch",
        "context_lengths": "20x",
    }, headers=_auth(token))
    assert response.status_code == 422
    assert "context_lengths" in response.json()["errors"]
    junk = client.post("/api/theses", {
        "title": "Bad", "idea": "x", "op": "rmsnorm", "hardware": "h200", "required_dsl": "torch",
        "evidence": SimpleUploadedFile("trace.json", b'{"traceEvents": [{"ph": "X", '),
    }, headers=_auth(token))
    assert junk.status_code == 422 and "evidence" in junk.json()["errors"]
    assert not Thesis.objects.exists() and not Evidence.objects.exists()


def test_the_openapi_schema_and_docs_are_served(client):
    schema = client.get("/api/openapi.json").json()
    assert {"/api/theses", "/api/theses/{thesis_id}", "/api/theses/{thesis_id}/results",
            "/api/sweeps/{sweep_id}"} <= set(schema["paths"])
    assert "multipart/form-data" in schema["paths"]["/api/theses"]["post"]["requestBody"]["content"]
    docs = client.get("/api/docs")
    assert docs.status_code == 200 and b"cdn" not in docs.content.lower()


def test_create_api_token_prints_a_token_that_authenticates(client, user, thesis, capsys):
    call_command("create_api_token", user.username, "ci-runner")
    token = capsys.readouterr().out.strip()
    assert ApiToken.objects.get().name == "ci-runner"
    assert client.get(f"/api/theses/{thesis.pk}", headers=_auth(token)).status_code == 200


def test_an_import_checks_the_shared_code_its_candidates_ran_with(results_path, thesis, user, tmp_path):
    # The file holds its kernel's shared code; a forged lib file that turns TF32 on is
    # refused, naming it, before anything is written.
    import hashlib

    lines = _lines(results_path)
    source = "import torch\n\ntorch.backends.cuda.matmul.allow_tf32 = True\n"
    lines[0]["lib_files"] = [{"path": "norms.py", "sha256": hashlib.sha256(source.encode()).hexdigest(),
                              "source": source}]
    forged = _write(tmp_path, lines)
    with pytest.raises(CommandError) as error:
        call_command("import_results", str(forged), thesis=thesis.pk, user=user.username)
    assert "runners/kernel_lib/norms.py" in str(error.value) and "allow_tf32" in str(error.value)
    assert _nothing_written()


def test_a_paged_win_whose_decode_loop_never_ran_is_refused():
    """The H100 sweep of the paged FP8 kernel (docs/benchmarks/h200/paged_h100_2026-12-05):
    a `win` whose decode loop could not run, written when the harness counted that as a
    warning. No win of an op judged in a decode loop stands without the loop's report."""
    path = Path(__file__).resolve().parents[1] / "docs/benchmarks/h200/paged_h100_2026-12-05/sweep_fp8_to_64k.jsonl"
    header, line = [json.loads(text) for text in path.read_text().splitlines()]
    assert (line["result"]["verdict"], line["result"]["e2e"]) == ("win", None)
    with pytest.raises(results_file.ResultsFileError, match="needs its decode loop's report"):
        results_file.read(path.read_bytes())
    # The same result with the loop's report is not refused for it.
    ran = {**line, "result": {**line["result"], "e2e": {"points": []}}}
    results_file.read((json.dumps(header) + "\n" + json.dumps(ran) + "\n").encode())
