"""API tokens from the web: made on a page and shown once, revoked by their owner only,
seen and revoked (never made or deleted) in the admin."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from research.models import ApiToken

pytestmark = pytest.mark.django_db


def _api_status(token: str) -> int:
    return Client().get("/api/theses/999999", HTTP_AUTHORIZATION=f"Bearer {token}").status_code


def _make(client: Client, **fields) -> tuple[int, str]:
    made = client.post(reverse("api_token_list"), fields)
    return made.status_code, made.content.decode()


def _shown_token(page: str) -> str:
    return page.split('<code id="token-value">')[1].split("</code>")[0]


def test_a_token_made_on_the_page_is_shown_once_opens_the_api_and_stops_when_revoked(logged_in_client, user):
    status, page = _make(logged_in_client, name="my laptop")
    token = _shown_token(page)
    assert status == 200 and token.startswith("kl_")
    assert _api_status(token) == 404  # authenticated: the thesis just does not exist
    again = logged_in_client.get(reverse("api_token_list")).content.decode()
    assert token not in again and "my laptop" in again and token[:11] in again

    row = ApiToken.objects.get(user=user)
    assert row.host == "" and token not in {row.key_hash, row.prefix}
    assert logged_in_client.post(reverse("api_token_revoke", args=[row.pk])).status_code == 302
    assert _api_status(token) == 401
    assert "revoked" in logged_in_client.get(reverse("api_token_list")).content.decode()


def test_a_new_token_is_kept_nowhere_but_its_hash_and_the_answer_is_not_cached(logged_in_client):
    """It once waited in the session (a table of its own) until the next GET of the page."""
    from django.contrib.sessions.models import Session

    made = logged_in_client.post(reverse("api_token_list"), {"name": "ci"})
    token = _shown_token(made.content.decode())
    assert "no-store" in made["Cache-Control"] and "no-store" in logged_in_client.get(reverse("api_token_list"))["Cache-Control"]
    stored = [str(session.get_decoded()) + session.session_data for session in Session.objects.all()]
    assert stored and not any(token in text for text in stored)
    assert token not in logged_in_client.get(reverse("api_token_list")).content.decode()


def test_nobody_else_sees_or_revokes_a_token(logged_in_client, user):
    _, page = _make(logged_in_client, name="ci box")
    token = _shown_token(page)
    other = Client()
    other.force_login(get_user_model().objects.create_user("mallory", password="x"))
    assert "ci box" not in other.get(reverse("api_token_list")).content.decode()
    row = ApiToken.objects.get(user=user)
    assert other.post(reverse("api_token_revoke", args=[row.pk])).status_code == 404
    assert other.get(reverse("api_token_revoke", args=[row.pk])).status_code == 405
    assert _api_status(token) == 404 and ApiToken.objects.get(pk=row.pk).revoked_at is None


def test_a_gpu_hosts_token_takes_the_permission_to_import(logged_in_client, user):
    status, page = _make(logged_in_client, name="h200", host="h200-box-1")
    assert status == 422 and "permission to import results" in page
    assert not ApiToken.objects.exists()

    user.user_permissions.add(Permission.objects.get(codename="import_results"))
    status, page = _make(logged_in_client, name="h200", host="h200-box-1")
    assert status == 200 and ApiToken.objects.get(user=user).host == "h200-box-1"
    assert "GPU host <code>h200-box-1</code>" in page
    status, page = _make(logged_in_client, name="bad", host="<b>x</b>")
    assert status == 422 and ApiToken.objects.count() == 1


def test_bad_input_gets_a_clear_error_and_nothing_is_made(logged_in_client):
    for fields, said in [({"name": ""}, "This field is required."), ({"name": "x" * 101}, "at most 100"),
                         ({"name": "laptop\u202e"}, "U+202E RIGHT-TO-LEFT OVERRIDE"),
                         ({"name": "two\nlines"}, "U+000A"), ({"name": "ws\u3164x"}, "U+3164 HANGUL FILLER")]:
        status, page = _make(logged_in_client, **fields)
        assert status == 422 and said in page.replace("Ensure this value has at most 100", "at most 100")
    assert not ApiToken.objects.exists()


def test_the_admin_lists_and_revokes_tokens_but_never_makes_deletes_or_shows_their_hash(user):
    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", "", "x"))
    mine = Client()
    mine.force_login(user)
    token = _shown_token(_make(mine, name="laptop")[1])
    row = ApiToken.objects.get()
    listing = admin.get("/admin/research/apitoken/")
    assert listing.status_code == 200 and "laptop" in listing.content.decode()
    detail = admin.get(f"/admin/research/apitoken/{row.pk}/change/").content.decode()
    assert row.key_hash not in detail and token not in detail
    assert admin.get("/admin/research/apitoken/add/").status_code == 403
    # Nor a digit at a time through the URL's filters.
    for digit in "0123456789abcdef":
        filtered = admin.get("/admin/research/apitoken/", {"key_hash__startswith": digit})
        assert filtered.status_code == 400 and "laptop" not in filtered.content.decode(), digit
    assert admin.get(f"/admin/research/apitoken/{row.pk}/delete/").status_code == 403
    admin.post("/admin/research/apitoken/", {"action": "revoke", "_selected_action": [row.pk]})
    assert ApiToken.objects.get(pk=row.pk).revoked_at is not None and _api_status(token) == 401
