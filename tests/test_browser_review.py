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
import re
import subprocess
import sys
import time

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.app_process import ROOT, AppProcess, launched_app
from tests.test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with launched_app(tmp_path_factory.mktemp("review-app")) as process:
        yield process


def _in_app(app: AppProcess, code: str) -> str:
    """Runs as a command typed beside the quick start: only DATA_DIR says which
    installation, and the launcher's state there gives its database, workspace, embedded
    Redis (password included) and site URL (config.launcher_state). Its last line."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SITE_URL"}}
    env.update(DATA_DIR=str(app.data_dir))
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def _create_waiting_win(app: AppProcess, title: str = "Blocked rmsnorm stays in cache", number: int = 1) -> int:
    return int(_in_app(app, "from tests.reviewing import create_waiting_win; "
                            f"print(create_waiting_win({title!r}, {number}))"))


def _log_in(page, username: str, password: str) -> None:
    page.goto("/reviews/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")


# The charts whose drawing reaches below their element or their card, by id.
_CHARTS_SPILLING = """Array.from(document.querySelectorAll('.js-plotly-plot')).filter(chart => {
    const svg = chart.querySelector('.main-svg').getBoundingClientRect();
    const card = chart.closest('.card').getBoundingClientRect();
    return svg.bottom > chart.getBoundingClientRect().bottom + 1 || svg.bottom > card.bottom + 1;
}).map(chart => chart.id)"""


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
            # In a narrow window the queue's table scrolls inside its card, not the page.
            page.set_viewport_size({"width": 640, "height": 720})
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            page.set_viewport_size({"width": 1280, "height": 720})

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
            # A narrower window refits the charts: each keeps its height, inside its card
            # (a chart once shrank its element to the CSS minimum and spilled below it).
            page.set_viewport_size({"width": 800, "height": 720})
            page.wait_for_timeout(500)  # Plotly refits on the window's resize event
            assert page.evaluate(_CHARTS_SPILLING) == []
            page.set_viewport_size({"width": 1280, "height": 720})
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


def test_a_second_reviewer_undoes_a_keep_and_the_page_and_the_path_chart_show_it(app):
    username, password = app.login()
    candidate_id = _create_waiting_win(app, title="Rows in blocks, to be undone")
    # A second reviewer with the permission (tests.reviewing.make_reviewer's password).
    _in_app(app, "from tests.reviewing import make_reviewer; print(make_reviewer('linus').pk)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        keeper = browser.new_context(base_url=app.url).new_page()
        undoer = browser.new_context(base_url=app.url).new_page()
        page = keeper
        try:
            for page, (user, secret) in ((keeper, (username, password)), (undoer, ("linus", "pw-for-tests-only"))):
                page.set_default_timeout(30_000)
                _log_in(page, user, secret)
                expect(page.locator("#review-count")).to_be_visible()

            page = keeper
            page.goto(f"/candidates/{candidate_id}/")
            page.fill("textarea[name=comment]", "Faster at 64 tokens.")
            page.click("#keep")
            expect(page.locator("#decision-outcome")).to_contain_text("Kept")
            # The keeper may undo too (four eyes are about the author and the producer);
            # here the second reviewer does.
            page = undoer
            page.goto(f"/candidates/{candidate_id}/")
            expect(page.locator("#undo-form")).to_be_visible()
            page.fill("#undo-comment", "Slower in the serving engine at 64 tokens.")
            page.click("#undo")
            expect(page.locator("#decision-outcome")).to_contain_text("Undone")
            expect(page.locator("#decision-outcome")).to_contain_text("linus")
            expect(page.locator("#undo-outcome")).to_contain_text("back at the kernel kept before it")
            expect(page.locator("#undone-keep")).to_contain_text(username)
            expect(page.locator("#undo-form")).to_have_count(0)
            # The summary at the top (outside the swapped decision) says so on the next load.
            page.reload()
            expect(page.locator("#glance-dispatch")).to_contain_text("was undone")
            expect(page.locator("#decision-outcome")).to_contain_text("Undone")

            page.click("a:text('Rows in blocks, to be undone')")
            expect(page.locator("#path-chart .main-svg").first).to_be_attached()
            traces = page.evaluate("document.getElementById('path-chart').data"
                                   ".map(t => ({name: t.name, x: t.x, y: t.y}))")
            by_name = {trace["name"]: trace for trace in traces}
            assert by_name["kept, then undone"]["x"] == [1] and "kept" not in by_name
            assert by_name["undo of a keep"]["x"] == [1.5]
            best = by_name["running best"]["y"]
            assert max(best) > 1 and best[-1] == 1.0  # up at the keep, back down at the undo
            expect(page.locator("#path-chart .textpoint text", has_text="undo ").first).to_be_attached()
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "browser-undo-last-page.png"), full_page=True)
            browser.close()

    undo = _git(app, "log", "-1", "--format=%an%n%B", "main")
    assert undo.startswith("Linus Reviewer\nUndo the keep of rmsnorm candidate")
    assert "Slower in the serving engine at 64 tokens." in undo


def test_a_keep_marks_another_waiting_win_stale_live_and_it_is_re_timed(app):
    username, password = app.login()
    # Grid points 3 and 2: neither is the kernel an earlier test of this module kept.
    kept_id = _create_waiting_win(app, title="Rows in blocks, kept first", number=3)
    stale_id = _create_waiting_win(app, title="Rows in blocks, timed before", number=2)
    _in_app(app, "from tests.reviewing import make_reviewer; from django.contrib.auth import get_user_model; "
                 "print(get_user_model().objects.filter(username='linus').exists() or make_reviewer('linus').pk)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        watcher = browser.new_context(base_url=app.url).new_page()
        keeper = browser.new_context(base_url=app.url).new_page()
        page = watcher
        try:
            for page, (user, secret) in ((watcher, (username, password)), (keeper, ("linus", "pw-for-tests-only"))):
                page.set_default_timeout(30_000)
                _log_in(page, user, secret)
            page = watcher
            page.goto("/reviews/")
            expect(page.locator(f"#queue-{stale_id}")).to_be_visible()
            expect(page.locator("#review-count")).to_have_attribute("data-state", "live")
            page.evaluate("window.__sameDocument = true")

            keeper.goto(f"/candidates/{kept_id}/")
            keeper.fill("textarea[name=comment]", "Faster at 64 tokens.")
            keeper.click("#keep")
            expect(keeper.locator("#decision-outcome")).to_contain_text("Kept")

            # The open queue moves the other win to the stale list without a reload.
            expect(page.locator(f"#stale-{stale_id}")).to_be_visible()
            expect(page.locator(f"#queue-{stale_id}")).to_have_count(0)
            expect(page.locator("#review-count")).to_have_text("0")
            assert page.evaluate("window.__sameDocument") is True
            page.click(f"#stale-{stale_id} button[name=retime]")
            expect(page.locator("h1")).to_contain_text("Sweep #")
            expect(page.locator(".messages")).to_contain_text("re-timed as")
            expect(page.locator("main")).to_contain_text("Re-timed against a newer kept kernel")
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "browser-stale-last-page.png"), full_page=True)
            browser.close()


def test_a_reviewer_compares_two_wins_side_by_side_and_a_worker_times_one_against_the_other(app):
    username, password = app.login()
    # Grid points 1 and 2: two sources, both waiting wins claiming tokens 64–64.
    first_id = _create_waiting_win(app, title="Rows in blocks, compared", number=1)
    second_id = _create_waiting_win(app, title="Rows in other blocks, compared", number=2)
    first, second = (_in_app(app, f"from research.models import Candidate; print(Candidate.objects.get(pk={pk}).label)")
                     for pk in (first_id, second_id))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_context(base_url=app.url, viewport={"width": 1440, "height": 900}).new_page()
        page.set_default_timeout(30_000)
        try:
            _log_in(page, username, password)
            page.goto(f"/candidates/{first_id}/")
            page.select_option("#compare-other", str(second_id))
            page.click("#compare")
            expect(page).to_have_url(f"{app.url}/candidates/{first_id}/compare/{second_id}/")

            side_a, side_b = page.locator("#side-a"), page.locator("#side-b")
            expect(side_a).to_contain_text(f"Candidate {first}")
            expect(side_b).to_contain_text(f"Candidate {second}")
            expect(side_a.locator(".compare-warnings")).to_contain_text("cache-state")
            a_box, b_box = side_a.bounding_box(), side_b.bounding_box()
            assert a_box["y"] == b_box["y"] and a_box["x"] + a_box["width"] <= b_box["x"]  # next to each other
            # One row per workload, both candidates' speedups on it.
            rows = page.locator("#compare-workloads tbody tr")
            expect(rows).to_have_count(4)
            expect(rows.first.locator("td.faster")).to_have_count(2)
            diff = page.locator("#diff table.diff")
            expect(diff).to_have_attribute("data-path", "kernels/rmsnorm/cpu/kept.py")
            expect(diff.locator("tr.add").first).to_be_visible()
            expect(diff.locator("tr.del").first).to_be_visible()
            expect(page.locator("#overlap")).to_contain_text("tokens 64–64")

            # The app's own worker times B's source against A's, for real.
            page.click("#time-against-each-other")
            expect(page.locator(".messages")).to_contain_text(f"{second} is timed against {first}")
            run = page.locator(".head-to-head-run").first
            expect(run).to_contain_text(f"{second}'s source against {first}'s")
            deadline = time.monotonic() + 180
            while run.locator(".head-to-head-rows").count() == 0 and time.monotonic() < deadline:
                page.wait_for_timeout(2000)
                page.reload()
            expect(run.locator(".head-to-head-rows tbody tr")).to_have_count(4)
            expect(run.locator(".head-to-head-rows thead")).to_contain_text(f"{second} over {first}")
            expect(run.locator(".badge").first).to_have_text(re.compile("^(win|no-gain)$"))

            run.locator("a").first.click()
            expect(page.locator("#head-to-head-note")).to_contain_text(
                f"A head-to-head, not keepable: it says which of {first} and {second} is faster where")
            expect(page.locator("#keep")).to_have_count(0)
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "browser-compare-last-page.png"), full_page=True)
            browser.close()


def test_a_keep_for_every_size_steps_the_waterfall_which_the_worker_measures_live(app):
    """The launched app's own worker measures the CPU class's waterfall after the keep;
    the path page, open while it waits, draws it when it lands."""
    username, password = app.login()
    candidate_id = _create_waiting_win(app, title="Rows in blocks, for every size", number=4)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_context(base_url=app.url, viewport={"width": 800, "height": 900}).new_page()
        page.set_default_timeout(30_000)
        try:
            _log_in(page, username, password)
            page.goto(f"/candidates/{candidate_id}/")
            # Served everywhere: the decode loop's eight tokens a step are in its range.
            page.fill("input[name=dispatch_min]", "")
            page.fill("input[name=dispatch_max]", "")
            page.fill("textarea[name=comment]", "Faster at every size we measured.")
            page.click("#keep")
            expect(page.locator("#decision-outcome")).to_contain_text("Kept")

            page.goto("/path/")
            page.evaluate("window.__sameDocument = true")
            chart = page.locator("#compound-cpu-dsa_indexer_topk_paged_fp8-chart .main-svg").first
            expect(chart).to_be_attached(timeout=300_000)
            assert page.evaluate("window.__sameDocument") is True
            expect(page.locator("#compound-cpu-waiting")).to_have_count(0)
            labels = page.evaluate(
                "document.getElementById('compound-cpu-dsa_indexer_topk_paged_fp8-chart').data[0].x")
            assert labels[0] == "0. shipped baselines"
            assert labels[-1].startswith(f"{len(labels) - 1}. keep rmsnorm ") and labels[-1].endswith("(blocked)")
            # The legend and the slanted labels stay inside the card on a narrow page.
            card = page.locator("#compound").bounding_box()
            plot = page.locator("#compound-cpu-dsa_indexer_topk_paged_fp8-chart .main-svg").first.bounding_box()
            assert plot["x"] >= card["x"] and plot["x"] + plot["width"] <= card["x"] + card["width"] + 1
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "browser-waterfall-last-page.png"), full_page=True)
            browser.close()


def test_a_result_that_arrives_before_the_sweep_chart_is_drawn_is_on_the_chart(app):
    """The chart's figure is fetched after the page: here it is read before candidate 1's
    result is recorded and reaches the page only after that result came live, as on a
    busy server. The chart must still show candidate 1."""
    username, password = app.login()
    win = _create_waiting_win(app, "The chart comes after the page", number=2)
    sweep_id = int(_in_app(app, f"from research.models import Candidate; print(Candidate.objects.get(pk={win}).sweep_id)"))
    held = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_context(base_url=app.url).new_page()
        page.set_default_timeout(30_000)
        try:
            _log_in(page, username, password)
            expect(page.locator("#review-count")).to_have_attribute("data-state", "live")
            # The figure is fetched now (candidate 2's points only) and held back.
            page.route(f"**/sweeps/{sweep_id}/chart.json", lambda route: held.append((route, route.fetch())))
            page.goto(f"/sweeps/{sweep_id}/")
            expect(page.locator("#connection")).to_have_text("live")
            for _ in range(100):  # Playwright runs the route's handler while the page waits
                if held:
                    break
                page.wait_for_timeout(100)
            assert held, "the page never asked for its chart"
            assert [len(trace["x"]) for trace in held[0][1].json()["data"]][0] == 1

            _in_app(app, "from research.models import Candidate; from tests.reviewing import record, recorded_result; "
                         f"record(Candidate.objects.get(sweep_id={sweep_id}, number=1), recorded_result()); print('ok')")
            expect(page.locator("#candidate-1")).to_be_visible()  # applied live; the chart not drawn yet
            route, response = held[0]
            route.fulfill(response=response)

            # Polled from here: wait_for_function's polling evaluates strings, which the CSP refuses.
            plotted = "(document.getElementById('sweep-chart').data || [{x: []}])[0].x.slice().sort()"
            for _ in range(50):
                if len(page.evaluate(plotted)) == 2:
                    break
                page.wait_for_timeout(100)
            assert page.evaluate(plotted) == [1, 2]
        finally:
            browser.close()
