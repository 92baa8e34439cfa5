"""The keep/revert path: the figure (a pure function) and the points it is drawn from."""

from __future__ import annotations

import pytest

from reviews import selectors
from reviews.charts import GREY, WIN_COLOUR, path_figure
from reviews.charts import LOSS_COLOUR
from reviews.services import candidate_keep, candidate_revert, candidate_undo
from tests.reviewing import make_reviewer, make_thesis, record, recorded_result, start_sweep
from tests.reviewing import no_enqueue, people, workspace_dir  # noqa: F401  (fixtures)


def _point(x, y, state, op="rmsnorm", label="blocked block_rows=256"):
    return {"x": x, "y": y, "op": op, "state": state, "label": label, "candidate": f"1-{x}",
            "thesis": "t", "speedup": y, "when": "2026-01-01T00:00:00", "url": f"/candidates/{x}/"}


def _trace(figure, name):
    return next(t for t in figure["data"] if t["name"] == name)


def test_kept_candidates_are_highlighted_and_labelled_and_the_rest_are_grey():
    figure = path_figure([
        _point(1, 1.10, "no-gain"), _point(2, None, "rejected"), _point(3, 1.40, "kept"),
        _point(4, 1.30, "reverted"), _point(5, 1.45, "waiting"),
    ])
    kept = _trace(figure, "kept")
    assert kept["x"] == [3] and kept["y"] == [1.40]
    assert kept["marker"]["color"] == WIN_COLOUR and kept["mode"] == "markers+text"
    assert kept["text"] == ["1-3: blocked block_rows=256"]
    for name in ("rejected", "no gain", "reverted"):
        assert _trace(figure, name)["marker"]["color"] == GREY
    # Never timed: drawn on the axis, and said so on hover.
    rejected = _trace(figure, "rejected")
    assert rejected["y"] == [0] and rejected["customdata"][0][6] == "not timed"
    assert _trace(figure, "awaiting review")["x"] == [5]
    # Every point links to its candidate: the URL is first in its customdata.
    assert kept["customdata"][0][0] == "/candidates/3/"


def test_the_running_best_steps_only_at_kept_candidates():
    figure = path_figure([
        _point(1, 1.2, "no-gain"), _point(2, 1.3, "kept"), _point(3, 1.9, "reverted"),
        _point(4, 1.6, "kept"), _point(5, 1.5, "kept"), _point(6, 1.1, "rejected"),
    ])
    best = _trace(figure, "running best")
    assert best["line"]["shape"] == "hv"
    assert best["x"] == [1, 2, 4, 5, 6] and best["y"] == [1.0, 1.3, 1.6, 1.6, 1.6]


def test_the_team_chart_has_a_running_best_per_op():
    figure = path_figure([_point(1, 1.2, "kept"), _point(2, 1.5, "kept", op="dsa_indexer_topk")])
    names = [t["name"] for t in figure["data"]]
    assert "running best (rmsnorm)" in names and "running best (dsa_indexer_topk)" in names
    # Told apart by their colour and dash: in one colour, three of them read as one line.
    lines = [_trace(figure, f"running best ({op})")["line"] for op in ("rmsnorm", "dsa_indexer_topk")]
    assert {line["dash"] for line in lines} == {"solid", "dash"}
    assert len({line["color"] for line in lines}) == 2


def test_kept_labels_lean_toward_the_middle_of_the_path():
    figure = path_figure([_point(1, 1.2, "kept"), _point(2, 1.1, "reverted"), _point(3, 1.5, "kept")])
    assert _trace(figure, "kept")["textposition"] == ["top right", "top left"]


def test_an_empty_path_has_no_traces():
    assert path_figure([])["data"] == []


def test_points_follow_the_result_order_and_compound_kept_wins(people, workspace_dir, no_enqueue):
    thesis = make_thesis(people.author)
    first = start_sweep(thesis, people.producer, budget=2)
    kept = record(first.candidates.get(number=1), recorded_result((1.5, 1.5, 1.5, 1.5)))
    reverted = record(first.candidates.get(number=2), recorded_result((1.2, 1.2, 1.2, 1.2)))
    candidate_keep(candidate=kept, reviewer=people.reviewer, commit=kept.commit)
    candidate_revert(candidate=reverted, reviewer=people.reviewer, commit=reverted.commit)
    # Started after the keep: timed against the kept kernel, so its 1.1× compounds to 1.65×.
    later = record(start_sweep(thesis, people.producer, budget=1).candidates.get(),
                   recorded_result((1.1, 1.1, 1.1, 1.1)))

    points = selectors.path_points(thesis_id=thesis.pk)
    assert [(p["x"], p["candidate"], p["state"]) for p in points] == [
        (1, kept.label, "kept"), (2, reverted.label, "reverted"), (3, later.label, "waiting")]
    assert [p["y"] for p in points] == pytest.approx([1.5, 1.2, 1.65])
    assert points[0]["label"].startswith("blocked block_rows=") and points[0]["url"] == kept.get_absolute_url()
    assert selectors.path_points(op="dsa_indexer_topk") == []


def test_the_thesis_op_and_team_pages_embed_the_path(client, people, workspace_dir, no_enqueue):
    thesis = make_thesis(people.author)
    record(start_sweep(thesis, people.producer, budget=1).candidates.get(), recorded_result())
    client.force_login(people.reviewer)
    # The thesis page (research's) asks reviews for its path as it loads.
    fragment = f"/theses/{thesis.pk}/path/"
    assert f'hx-get="{fragment}"' in client.get(thesis.get_absolute_url()).content.decode()
    for url in (fragment, "/ops/rmsnorm/", "/path/"):
        html = client.get(url).content.decode()
        assert 'id="path-figure"' in html and "data-links" in html, url
    assert client.get(f"/theses/{thesis.pk + 1}/path/").status_code == 404
    assert client.get("/ops/nope/").status_code == 404


def test_text_users_wrote_is_shown_as_text_not_rendered_as_markup():
    """Plotly renders a subset of HTML in labels and hover text: a kernel name or thesis
    title with a link, a style or a line break must show as the characters it is."""
    from reviews.charts import speedup_figure
    from reviews.selectors import WorkloadRow

    title = '<a href="https://evil.example/">click</a><br><span style="font-size:99px">x</span>'
    figure = path_figure([_point(1, 1.4, "kept", label=title) | {"thesis": title}])
    kept = _trace(figure, "kept")
    assert "<" not in kept["text"][0] and kept["text"][0].startswith("1-1: &lt;a href=")
    assert kept["customdata"][0][3] == title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert kept["customdata"][0][0] == "/candidates/1/"  # the link the page's script follows is ours
    row = WorkloadRow(name="<b>w</b>", size=None, group="<i>g</i>", baseline_ms=1.0, baseline_ci=None,
                      candidate_ms=0.5, candidate_ci=None, speedup=2.0, speedup_ci=None, significant=True,
                      p_value=1e-6, roofline_fraction=None, noise_floor=None)
    figure = speedup_figure([row], None, None)
    assert figure["data"][0]["x"] == ["&lt;b&gt;w&lt;/b&gt;"]
    assert figure["data"][0]["name"] == "speedup (&lt;i&gt;g&lt;/i&gt;)"
    sized = WorkloadRow(**{**row.__dict__, "size": 64})
    figure = speedup_figure([sized], "tokens", {"min": 64, "max": 64, "summary": "<img src=x>"})
    assert figure["layout"]["annotations"][0]["text"].endswith("&lt;img src=x&gt;")


def test_an_undo_is_a_point_of_its_own_and_the_running_best_drops_back_there():
    figure = path_figure([
        _point(1, 1.2, "no-gain"), _point(2, 1.3, "kept"), _point(3, 1.1, "no-gain"), _point(4, 1.6, "undone"),
        _point(4.5, 1.6, "undo") | {"undoes": 4, "candidate": "1-4"}, _point(5, 1.4, "waiting"),
    ])
    undo = _trace(figure, "undo of a keep")
    assert undo["x"] == [4.5] and undo["y"] == [1.6] and undo["text"] == ["undo 1-4"]
    assert undo["marker"]["color"] == LOSS_COLOUR and undo["marker"]["symbol"] == "triangle-down"
    # The undone candidate is drawn apart from the kept ones.
    assert _trace(figure, "kept, then undone")["x"] == [4] and _trace(figure, "kept")["x"] == [2]
    best = _trace(figure, "running best")
    assert best["x"] == [1, 2, 4, 4.5, 5] and best["y"] == [1.0, 1.3, 1.6, 1.3, 1.3]


def test_undo_points_come_from_the_decisions_and_later_sweeps_compound_without_the_undone_keep(
        people, workspace_dir, no_enqueue):
    thesis = make_thesis(people.author)
    sweep = start_sweep(thesis, people.producer, budget=2)
    kept = record(sweep.candidates.get(number=1), recorded_result((1.5, 1.5, 1.5, 1.5)))
    candidate_keep(candidate=kept, reviewer=people.reviewer, commit=kept.commit)
    # Started while the keep stood: timed against it, so its 1.1x compounds to 1.65x.
    during = record(start_sweep(thesis, people.producer, budget=1).candidates.get(),
                    recorded_result((1.1, 1.1, 1.1, 1.1)))
    candidate_undo(candidate=kept, reviewer=make_reviewer("linus"), commit=kept.commit, comment="slower in serving")
    # Started after the undo: timed against the shipped baseline again.
    after = record(start_sweep(thesis, people.producer, budget=1).candidates.get(),
                   recorded_result((1.1, 1.1, 1.1, 1.1)))

    points = selectors.path_points(thesis_id=thesis.pk)
    assert [(p["x"], p["candidate"], p["state"]) for p in points] == [
        (1, kept.label, "undone"), (2, during.label, "waiting"), (3, after.label, "waiting"),
        (2.5, kept.label, "undo")]
    assert [p["y"] for p in points] == pytest.approx([1.5, 1.65, 1.1, 1.5])
    assert points[-1]["undoes"] == 1 and points[-1]["url"] == kept.get_absolute_url()
    best = _trace(path_figure(points), "running best")
    assert best["x"] == [1, 1, 2.5, 3] and best["y"] == pytest.approx([1.0, 1.5, 1.0, 1.0])
