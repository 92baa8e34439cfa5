"""Test data and fixtures for the review side: people, a workspace, recorded wins.

TEST DATA, NOT MEASUREMENTS. The results below are written by hand in the harness's
JSON shape (CONTRACTS §4 plus the fields the harness adds: confidence intervals,
roofline fractions, the dispatch proposal) so the review services and pages can be
exercised without depending on how fast this machine is. The review pages show
whatever a candidate's recorded result says; these results exist only in test
databases. Real evaluations are covered by tests/test_worker.py and
tests/test_reviews_worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

from research import candidates, queueing, sweeps, theses
from research.models import Candidate, Sweep, Thesis

# The workloads of an rmsnorm thesis on the CPU with context lengths 64, 256, batch 1.
RMSNORM_WORKLOADS = ["t=64,dtype=float32", "t=64,dtype=bfloat16", "t=256,dtype=float32", "t=256,dtype=bfloat16"]


def recorded_result(speedups=(1.30, 1.24, 1.02, 0.99), *, names=RMSNORM_WORKLOADS, e2e=None,
                    dispatch: dict | None | bool = True, warn: bool = True) -> dict:
    """A harness result (hand-written test data) with these per-workload speedups."""
    workloads = []
    for position, (name, speedup) in enumerate(zip(names, speedups, strict=True)):
        base = 0.03 * (1 + position)
        significant = abs(speedup - 1) > 0.05
        workloads.append({
            "name": name, "baseline_ms": base, "candidate_ms": base / speedup, "speedup": speedup,
            "significant": significant, "speedup_ci": [speedup * 0.97, speedup * 1.03],
            "p_value": 1e-6 if significant else 0.4, "samples": 200,
            "baseline_ci_ms": [base * 0.98, base * 1.02],
            "candidate_ci_ms": [base / speedup * 0.98, base / speedup * 1.02],
            "aa_speedup": 1.001, "noise_floor": 0.02, "floor_ms": 0.0013,
            "roofline_fraction": round(0.0013 / (base / speedup), 4),
            "first_call_shape": f"{name}+3", "first_call_ms": 1.5 + position,
            "first_call_baseline_ms": 1.2,
        })
    wins = any(w["significant"] and w["speedup"] > 1 for w in workloads)
    guards = [
        {"name": "loads", "status": "pass", "detail": "candidate.py imports and defines forward()"},
        {"name": "correctness", "status": "pass", "detail": "matched the reference in 32 calls"},
        {"name": "clock", "status": "pass", "detail": "the candidate's reported times agree with the judge's round trips"},
    ]
    if warn:
        guards.append({"name": "cache-state", "status": "warn",
                       "detail": "could not flush the last-level cache between calls on this machine"})
    if dispatch is True:
        dispatch = {"axis": "tokens", "min": 64, "max": 64, "sizes": [64], "covers_all": False,
                    "summary": "candidate for tokens 64–64, kept kernel beyond 64"}
    return {
        "op": "rmsnorm", "device": "cpu", "verdict": "win" if wins else "no-gain", "correct": True,
        "guards": guards, "workloads": workloads, "e2e": e2e, "dispatch": dispatch or None,
        "error": None, "dsl": "torch",
    }


def record(candidate: Candidate, result: dict) -> Candidate:
    """Record a result the way a worker does: claim, then record."""
    assert candidates.candidate_claim(candidate_id=candidate.pk) is not None
    assert candidates.candidate_record_result(candidate_id=candidate.pk, result=result)
    return Candidate.objects.select_related("sweep__thesis").get(pk=candidate.pk)


def make_reviewer(username: str):
    user = get_user_model().objects.create_user(username, email=f"{username}@example.com",
                                                password="pw-for-tests-only",
                                                first_name=username.title(), last_name="Reviewer")
    user.user_permissions.add(Permission.objects.get(codename="decide_candidate",
                                                     content_type__app_label="reviews"))
    return get_user_model().objects.get(pk=user.pk)  # a fresh object: no stale permission cache


@dataclass
class People:
    author: object    # files the thesis
    producer: object  # starts the sweep, so produces its candidates
    reviewer: object  # may decide
    outsider: object  # logged in, without the permission


def make_people() -> People:
    User = get_user_model()
    author = User.objects.create_user("ada", email="ada@example.com", password="pw-for-tests-only",
                                      first_name="Ada", last_name="Lovelace")
    producer = User.objects.create_user("bob", email="bob@example.com", password="pw-for-tests-only")
    outsider = User.objects.create_user("olga", password="pw-for-tests-only")
    return People(author=author, producer=producer, reviewer=make_reviewer("grace"), outsider=outsider)


def make_thesis(author, **overrides) -> Thesis:
    fields = {
        "author": author, "title": "Blocked rmsnorm stays in cache",
        "idea": "Normalise rows in **blocks** so each block stays in L2.",
        "op": "rmsnorm", "hardware": "cpu", "required_dsl": "torch",
        "context_lengths": [64, 256], "batch_sizes": [1],
    }
    return theses.thesis_submit(**{**fields, **overrides})


def start_sweep(thesis: Thesis, producer, *, budget: int = 2, kernel: str = "blocked") -> Sweep:
    return sweeps.sweep_start(thesis=thesis, started_by=producer, kernel=kernel, strategy="grid", budget=budget)


def create_waiting_win(title: str = "Blocked rmsnorm stays in cache", number: int = 1) -> int:
    """For the browser tests, run inside the launched app (`manage.py shell`): a thesis by
    ada, a sweep started by bob, its candidate `number` recorded as a win (test data, see
    the module docstring) and committed in the app's workspace. Returns its id. Ada and
    bob are made by the first call and reused by later ones (one app serves the module)."""
    # This process must not hand the sweep to the app's worker: the result is ours.
    queueing.evaluations_enqueue = lambda ids, queue: None
    User = get_user_model()
    author = User.objects.filter(username="ada").first() or User.objects.create_user(
        "ada", email="ada@example.com", password="pw-for-tests-only", first_name="Ada", last_name="Lovelace")
    producer = User.objects.filter(username="bob").first() or User.objects.create_user(
        "bob", email="bob@example.com", password="pw-for-tests-only")
    # Candidate `number` of the kernel's grid: another number, another source.
    sweep = start_sweep(make_thesis(author, title=title), producer, budget=number)
    return record(sweep.candidates.get(number=number), recorded_result()).pk


@pytest.fixture
def workspace_dir(settings, tmp_path):
    """A workspace of the test's own, created on first use like the app's."""
    settings.KERNEL_WORKSPACE = tmp_path / "workspace"
    return settings.KERNEL_WORKSPACE


@pytest.fixture
def people(db) -> People:
    return make_people()


@pytest.fixture
def no_enqueue(monkeypatch):
    # These tests record results themselves; the worker path has its own tests.
    monkeypatch.setattr(queueing, "evaluations_enqueue", lambda ids, queue: None)


@pytest.fixture
def waiting_win(people, workspace_dir, no_enqueue) -> Candidate:
    """Candidate 1 of a two-candidate sweep, recorded as a win and waiting for review."""
    sweep = start_sweep(make_thesis(people.author), people.producer)
    return record(sweep.candidates.get(number=1), recorded_result())
