from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from research import theses

# Hypothesis (the API fuzz) keeps its caches, among them the constants it reads from our
# source files with their paths, in ./.hypothesis unless told otherwise: a run leaves
# nothing in the tree.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "kernel-lab-hypothesis"))


@pytest.fixture(autouse=True)
def _fresh_cache(settings, request):
    """Each test counts its rate limits from zero: its own in-memory cache, never the
    Redis that the whole run shares (user ids repeat across tests)."""
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": request.node.nodeid}}


@pytest.fixture(autouse=True)
def _no_recovery_thread(settings):
    """Workers started inside the test process run no recovery loop of their own
    (research.recovery): tests call it, or run it in real worker subprocesses."""
    settings.RECOVER_EVERY_S = 0


@pytest.fixture
def user(db):
    return get_user_model().objects.create_user("ada", password="pw-for-tests-only")


@pytest.fixture
def logged_in_client(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def make_thesis(user):
    def make(**overrides):
        fields = {
            "author": user,
            "title": "Blocked rmsnorm",
            "idea": "Process rows in blocks to stay in cache.",
            "op": "rmsnorm",
            "hardware": "cpu",
            "required_dsl": "torch",
            "context_lengths": [64, 256],
            "batch_sizes": [1],
        }
        fields.update(overrides)
        return theses.thesis_submit(**fields)

    return make
