"""Fuzzing the JSON API from its own OpenAPI schema (schemathesis), in process over WSGI.

Every operation gets a bounded, derandomized set of generated requests, authenticated
with a real token: no response may be a server error, and each must match the schema
(documented status, content type and body). Figures in docs/robustness.md.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from django.contrib.auth.models import Permission
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from research.api_tokens import api_token_create
from research.models import Thesis

pytestmark = pytest.mark.django_db

# API_FUZZ_EXAMPLES=500 for a longer hunt (docs/robustness.md); the suite runs 25.
MAX_EXAMPLES = int(os.environ.get("API_FUZZ_EXAMPLES", "25"))
SEED = 20261130

schema = schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application())
# A results file is text: send the generated bodies as they are.
schemathesis.serializer.alias("application/x-ndjson", "text/plain")



@schema.hook
def map_path_parameters(context, path_parameters):
    """Every third generated thesis id names a thesis that exists, so the endpoints run
    past their 404 on a real one (a results file of junk for it, say)."""
    thesis_id = (path_parameters or {}).get("thesis_id")
    if isinstance(thesis_id, int) and thesis_id % 3 == 0:
        path_parameters["thesis_id"] = Thesis.objects.values_list("pk", flat=True).first() or thesis_id
    return path_parameters


@pytest.fixture(autouse=True)
def keep_the_test_connection():
    """As Django's test client does: a request must not close the connection that holds
    the test's transaction."""
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    yield
    for signal in (request_started, request_finished):
        signal.connect(close_old_connections)


@pytest.fixture(autouse=True)
def no_rate_limits(settings):
    # The fuzzer posts far more than a person would: let every request reach the handlers
    # (the limits themselves are tested in test_security).
    settings.RATE_LIMITS = {action: "1000000/h" for action in settings.RATE_LIMITS}


@pytest.fixture
def token(user) -> str:
    # Allowed to import too: the import's handling of bad files is what is tried here.
    user.user_permissions.add(Permission.objects.get(codename="import_results"))
    return api_token_create(user=user, name="fuzz")[1]


@pytest.fixture
def thesis(make_thesis):
    # Something for the generated ids to find now and then.
    return make_thesis()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_is_a_server_error_or_breaks_the_schema(case, token, thesis):
    # Every check but one: the schema gives the fields' shapes, and a request of the right
    # shape may still be refused by the app's rules (an op that does not exist, workloads
    # the op cannot run), with 422 and the reason, which that check would call a failure.
    excluded = [positive_data_acceptance]
    if case.media_type == "multipart/form-data":
        # A form cannot carry a null: a field generated as null is sent as absent, and a
        # form without an optional field is a valid request, not invalid data accepted.
        excluded.append(negative_data_rejection)
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"}, excluded_checks=excluded)
