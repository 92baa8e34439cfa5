"""A person's path through the app, in the system Chromium, against real processes.

The app runs as the quick start runs it (Daphne, a Celery worker, embedded Redis,
SQLite); the sweep is evaluated for real by the worker and its results must appear on
the open page without a reload.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from playwright.sync_api import expect, sync_playwright

from bench._common import CHROMIUM, CHROMIUM_ARGS
from tests.app_process import ROOT, launched_app

pytestmark = pytest.mark.browser

ARTIFACTS = ROOT / "test-artifacts"  # the last page, to look at when something fails


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # The app declares one coding agent: the scripted one, which first edits a file
    # outside the allowed paths, then improves the kernel.
    data_dir = tmp_path_factory.mktemp("browser-app")
    agents = data_dir / "agent_commands.toml"
    scripted = ROOT / "tests" / "agents" / "scripted_agent.py"
    agents.write_text(f'scripted = "{sys.executable} {scripted} outside,improve"\n')
    with launched_app(data_dir, env={"AGENT_COMMANDS_FILE": str(agents)}) as process:
        yield process


@pytest.fixture(scope="module")
def page(app, tmp_path_factory):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(base_url=app.url)
        context.set_default_timeout(30_000)
        page = context.new_page()
        yield page
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-last-page.png"), full_page=True)
        browser.close()


@pytest.fixture
def torch_trace(tmp_path):
    """A real PyTorch profiler trace, made here on the CPU."""
    path = tmp_path / "trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        x = torch.randn(256, 256)
        for _ in range(5):
            x = torch.relu(x @ x).clamp_max(1.0)
    profiler.export_chrome_trace(str(path))
    return path


def test_a_person_files_a_thesis_starts_a_sweep_and_watches_it_live(app, page, torch_trace):
    username, password = app.login()
    page.goto("/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    expect(page.get_by_role("heading", name="Theses")).to_be_visible()

    page.click("text=File a thesis")
    page.fill("input[name=title]", "Blocked rmsnorm stays in cache")
    page.fill("textarea[name=idea]", "Normalise rows in **blocks** so each block stays in L2.")
    page.select_option("select[name=op]", "rmsnorm")
    page.select_option("select[name=hardware]", "cpu")
    page.set_input_files("input[name=evidence]", str(torch_trace))
    page.fill("input[name=context_lengths]", "64, 256")
    page.fill("input[name=batch_sizes]", "1")
    page.click("#thesis-form button[type=submit]")

    expect(page.locator("h1")).to_have_text("Blocked rmsnorm stays in cache")
    expect(page.locator("#top-kernels tbody tr").first).to_be_visible()
    expect(page.locator("#bottleneck-reason")).not_to_be_empty()
    expect(page.locator("#evidence-chart .main-svg").first).to_be_attached()

    # Model-based: TPE proposes 2 candidates, then a third once a result is in, so the
    # page must show candidates the worker proposed after it was loaded.
    page.select_option("select[name=kernel]", "blocked")
    page.select_option("select[name=strategy]", "tpe")
    page.fill("input[name=budget]", "3")
    page.click("#sweep-form button[type=submit]")
    expect(page.locator("h1")).to_contain_text("Sweep #")
    # A marker on this page object: a reload or navigation would erase it.
    page.evaluate("window.__sameDocument = true")
    expect(page.locator("#connection")).to_have_text("live")

    expect(page.locator("#results-body tr[id^=candidate-]")).to_have_count(3, timeout=180_000)
    expect(page.locator("#sweep-progress .done")).to_have_text("3")
    expect(page.locator("#sweep-status")).to_have_text("finished")
    assert page.evaluate("window.__sameDocument") is True
    points = page.evaluate("document.getElementById('sweep-chart').data.map(t => t.x.length)")
    assert points and all(n == 3 for n in points)
    # The empty chart's "no result yet" note went with the first point.
    assert page.evaluate("(document.getElementById('sweep-chart').layout.annotations || []).length") == 0
    verdicts = page.locator("#results-body .badge").all_inner_texts()
    # Every point of the kernel's SPACE is correct, so none may be rejected.
    assert set(verdicts) <= {"win", "no-gain"} and len(verdicts) == 3


def _log_in_if_asked(app, page) -> None:
    """The module's tests share one page: only the first finds the login form."""
    page.goto("/")
    if page.locator("input[name=username]").count():
        username, password = app.login()
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", password)
        page.click("button[type=submit]")


def _file_rmsnorm_thesis(page, title: str, idea: str) -> None:
    """A CPU rmsnorm thesis at one context length, from the form; ends on its page."""
    page.goto("/theses/new/")
    page.fill("input[name=title]", title)
    page.fill("textarea[name=idea]", idea)
    page.select_option("select[name=op]", "rmsnorm")
    page.select_option("select[name=hardware]", "cpu")
    page.fill("input[name=context_lengths]", "64")
    page.fill("input[name=batch_sizes]", "1")
    page.click("#thesis-form button[type=submit]")
    expect(page.locator("h1")).to_have_text(title)


def test_a_refused_thesis_names_every_problem_and_keeps_its_profile(app, page, torch_trace):
    _log_in_if_asked(app, page)
    page.goto("/theses/new/")
    page.fill("input[name=title]", "Rows in \u202eblocks")  # reorders the text after it
    page.fill("textarea[name=idea]", "Blocks of rows.")
    page.select_option("select[name=op]", "rmsnorm")
    page.select_option("select[name=hardware]", "cpu")
    page.set_input_files("input[name=evidence]", str(torch_trace))
    page.fill("input[name=context_lengths]", "0")
    page.click("#thesis-form button[type=submit]")

    # Both problems at once, and the profile named as kept: nothing to choose again.
    expect(page.locator(".has-error")).to_have_count(2)
    expect(page.locator("#evidence-held")).to_contain_text("trace.json")
    page.fill("input[name=title]", "Rows in blocks")
    page.fill("input[name=context_lengths]", "64")
    page.click("#thesis-form button[type=submit]")
    expect(page.locator("h1")).to_have_text("Rows in blocks")
    expect(page.locator("#top-kernels tbody tr").first).to_be_visible()


def test_pausing_resuming_and_cancelling_a_sweep_shows_live_on_another_open_page(app, page):
    _log_in_if_asked(app, page)
    _file_rmsnorm_thesis(page, "Pause me", "A long sweep to pause.")
    page.select_option("select[name=kernel]", "blocked")
    page.select_option("select[name=strategy]", "grid")
    page.fill("input[name=budget]", "24")  # long enough to still be under way when paused
    page.click("#sweep-form button[type=submit]")
    expect(page.locator("h1")).to_contain_text("Sweep #")
    other = page.context.new_page()
    other.goto(page.url)
    expect(other.locator("#connection")).to_have_text("live")
    # htmx reports an answer or a fragment whose target the page lacks (it once did after
    # pause/cancel: first the status's, then the controls' own when the sweep's event had
    # replaced them). A target error is raised on the detached form, so it is caught
    # where htmx throws it, as the page's error.
    missing_targets = """window.__missingTargets = [];
        document.body.addEventListener('htmx:oobErrorNoTarget',
            e => window.__missingTargets.push((e.detail.content || {}).outerHTML || '?'));
        window.addEventListener('error', e => window.__missingTargets.push(String(e.message)));"""
    page.evaluate(missing_targets)
    other.evaluate(missing_targets)

    page.click("#sweep-controls button[name=pause]")
    expect(other.locator("#sweep-status")).to_have_text("paused")
    expect(other.locator("#sweep-controls button[name=resume]")).to_be_visible()
    expect(other.locator("#sweep-controls button[name=pause]")).to_have_count(0)

    page.click("#sweep-controls button[name=resume]")
    expect(other.locator("#sweep-status")).to_have_text(re.compile("^(running|queued)$"))
    expect(other.locator("#sweep-controls button[name=pause]")).to_be_visible()

    page.once("dialog", lambda dialog: dialog.accept())  # hx-confirm asks first
    page.click("#sweep-controls button[name=cancel]")
    expect(other.locator("#sweep-status")).to_have_text("cancelled")
    expect(other.locator("#sweep-controls button")).to_have_count(0)
    expect(page.locator("#sweep-status")).to_have_text("cancelled")
    page.wait_for_timeout(1000)  # the cancel's own frame reaches both pages
    assert page.evaluate("window.__missingTargets") == [] and other.evaluate("window.__missingTargets") == []
    other.close()


def test_a_sweep_on_a_queue_no_worker_serves_says_so_until_it_is_cancelled(app, page):
    _log_in_if_asked(app, page)
    _file_rmsnorm_thesis(page, "Waits for an H200", "No H200 worker serves this installation.")
    page.select_option("select[name=kernel]", "blocked")
    page.fill("input[name=budget]", "2")
    page.select_option("#sweep-form select[name=hardware]", "h200")
    page.click("#sweep-form button[type=submit]")
    expect(page.locator("#no-worker")).to_contain_text("runner.sm90")
    expect(page.locator("#connection")).to_have_text("live")
    page.evaluate("window.__sameDocument = true")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#sweep-controls button[name=cancel]")
    expect(page.locator("#sweep-status")).to_have_text("cancelled")
    # Nothing waits any more: the notice goes without a reload (it once stayed).
    expect(page.locator("#no-worker")).to_have_count(0)
    assert page.evaluate("window.__sameDocument") is True


def test_an_agent_sweep_started_from_the_page_streams_its_refusal_its_candidate_and_its_context(app, page):
    _log_in_if_asked(app, page)
    _file_rmsnorm_thesis(page, "Let an agent block the rows", "Larger blocks of rows.")

    page.select_option("select[name=kernel]", "blocked")
    page.select_option("select[name=strategy]", "agent")
    page.select_option("select[name=agent_command]", "scripted")
    page.fill("input[name=budget]", "2")
    page.click("#sweep-form button[type=submit]")
    # (The agent's context, rendered further down, has headings of its own.)
    expect(page.get_by_role("heading", name=re.compile(r"^Sweep #"))).to_be_visible()
    page.evaluate("window.__sameDocument = true")

    # The first proposal edits README.md: refused, live, with its reason.
    expect(page.locator("#refused-body tr")).to_have_count(1, timeout=180_000)
    expect(page.locator("#refused-body .refusal")).to_contain_text("outside the allowed paths")
    # The second is evaluated and streams in like any candidate.
    expect(page.locator("#results-body tr[id^=candidate-]")).to_have_count(1, timeout=180_000)
    expect(page.locator("#sweep-status")).to_have_text("finished", timeout=180_000)
    assert page.evaluate("window.__sameDocument") is True
    page.reload()
    page.click("#agent-context summary")
    expect(page.locator("#agent-context")).to_contain_text("Let an agent block the rows")
