"""A reviewer's path in the system Chromium, against the app as the quick start runs it:
the queue fills live, the review page shows the evidence, a keep merges the kernel into
the workspace, and the path chart shows it kept.

The waiting win is TEST DATA: a thesis, a sweep and a recorded result built through the
services inside the launched app's database (tests/reviewing.py, hand-written in the
harness's shape), so the test does not depend on this machine's speed. Real evaluations
are covered by tests/test_browser.py and tests/test_reviews_worker.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.app_process import ROOT, AppProcess, launched_app
from tests.test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with launched_app(tmp_path_factory.mktemp("review-app")) as process:
        yield process


def _create_waiting_win(app: AppProcess) -> int:
    """Runs as a command typed beside the quick start: only DATA_DIR says which
    installation, and the launcher's state there gives its database, workspace, embedded
    Redis (password included) and site URL (config.launcher_state)."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SITE_URL"}}
    env.update(DATA_DIR=str(app.data_dir))
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c",
         "from tests.reviewing import create_waiting_win; print(create_waiting_win())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


def _git(app: AppProcess, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(app.data_dir / "workspace"), *args],
                          capture_output=True, text=True, check=True).stdout


def test_a_reviewer_keeps_a_win_from_the_queue_and_the_path_chart_shows_it_kept(app):
    username, password = app.login()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_context(base_url=app.url).new_page()
        page.set_default_timeout(30_000)
        # The charts, htmx and the live queue all run under the pages' Content-Security-Policy.
        refused = []
        page.on("console", lambda message: refused.append(message.text)
                if "Content Security Policy" in message.text else None)
        try:
            page.goto("/reviews/")
            page.fill("input[name=username]", username)
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            expect(page.locator("#queue-empty")).to_be_visible()
            expect(page.locator("#review-count")).to_have_attribute("data-state", "live")
            expect(page.locator("#review-count")).to_have_text("0")
            page.evaluate("window.__sameDocument = true")

            candidate_id = _create_waiting_win(app)

            # It appears without a reload, and the navigation counts it.
            expect(page.locator(f"#queue-{candidate_id}")).to_be_visible()
            expect(page.locator("#review-count")).to_have_text("1")
            assert page.evaluate("window.__sameDocument") is True

            page.click(f"#queue-{candidate_id} a[href='/candidates/{candidate_id}/']")
            expect(page.locator("h1")).to_contain_text("rmsnorm")
            # What decides comes first, in the first screen: verdict, warnings, dispatch, provenance.
            glance = page.locator("#at-a-glance")
            expect(glance).to_be_in_viewport()
            expect(page.locator("#glance-warnings")).to_contain_text("cache-state")
            expect(page.locator("#glance-dispatch")).to_contain_text("64")
            assert glance.bounding_box()["y"] < page.locator("#diff").bounding_box()["y"]
            diff = page.locator("table.diff").first
            expect(diff).to_have_attribute("data-path", "kernels/rmsnorm/cpu/kept.py")
            expect(diff.locator("tr.add").first).to_be_visible()
            expect(page.locator("#latency-chart .main-svg").first).to_be_attached()
            expect(page.locator("#speedup-chart .main-svg").first).to_be_attached()
            expect(page.locator("#guards tbody tr").first).to_contain_text("warn")
            expect(page.locator("#e2e")).to_contain_text("not measured")
            expect(page.locator("input[name=dispatch_min]")).to_have_value("64")

            page.fill("textarea[name=comment]", "Faster at 64 tokens in both dtypes; keep it there.")
            page.click("#keep")
            expect(page.locator("#decision-outcome")).to_contain_text("Kept")
            expect(page.locator("#review-count")).to_have_text("0")

            page.click("a:text('Blocked rmsnorm stays in cache')")
            expect(page.locator("#path-chart .main-svg").first).to_be_attached()
            kept = page.evaluate("document.getElementById('path-chart').data.filter(t => t.name === 'kept')"
                                 ".map(t => ({x: t.x, text: t.text, colour: t.marker.color}))")
            assert len(kept) == 1 and kept[0]["x"] == [1] and kept[0]["colour"] == "#127a3a"
            assert kept[0]["text"][0].startswith("1-1: blocked block_rows=64")
            # The labelled star is drawn, not only in the data.
            expect(page.locator("#path-chart .textpoint text").first).to_contain_text("1-1: blocked")
            # The API's own documentation page draws under the same policy.
            page.goto("/api/docs")
            expect(page.locator(".swagger-ui .opblock").first).to_be_visible()
            assert refused == []
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "browser-review-last-page.png"), full_page=True)
            browser.close()

    merge = _git(app, "log", "-1", "--format=%an%n%(trailers:key=Reviewed-by,valueonly)", "main").split("\n")
    assert merge[0] == "Ada Lovelace" and merge[1] == "admin <admin@kernel-lab.invalid>"
    assert '"min": 64' in _git(app, "show", "main:dispatch.json")
