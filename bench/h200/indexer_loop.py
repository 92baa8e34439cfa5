"""The indexer's GPU results through the product's own loop: theses, imported sweeps,
a reviewer's decisions, the path chart.

    .venv/bin/python bench/h200/indexer_loop.py [--results docs/benchmarks/h200]
        [--chart docs/benchmarks/h200/path_chart.png]

In a fresh database and kernel workspace of its own (bench/_common.py), as a team would:
an author files one thesis per (op, kernel DSL); the results files the harness wrote on
an H200 or an H100 (`python -m runners.harness sweep ... --out FILE`, bench/h200/indexer_round.py)
are imported as that author's sweeps (`manage.py import_results` does the same); a
second user with the reviewer permission decides every win through reviews.services,
as the review page does: per op the fastest win by its geometric-mean speedup is kept
with the dispatch range its result proposes, every other win is reverted as
superseded; each card's results are its own class's theses (the file names the GPU).
The wins are imported and this installation has no GPU worker to verify
them, so the keep is the two-reviewer "keep unverified": the reviewer asks, a third
user confirms, and the path chart marks it. The path chart is the figure the /paths/ page draws (reviews.charts),
rendered by Chromium to a PNG.

Prints, per op, what was kept and what was reverted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._common import CHROMIUM, CHROMIUM_ARGS, app_environment  # noqa: E402

THESES = {
    ("dsa_indexer_topk", "triton"): (
        "Fuse the indexer's logits and reduce its top-k incrementally (Triton)",
        "The eager indexer writes the [M, H, N] score tensor and reads it back for the relu "
        "(39% of GPU time). Fuse the logits, ReLU and head weighting into one kernel, then "
        "reduce the top-k per block and merge, or pipeline it over context chunks."),
    ("dsa_indexer_topk", "cute"): (
        "A Hopper indexer: wgmma logits fed by TMA, top-k selected from a fused histogram",
        "Keys stream through a TMA pipeline into warpgroup MMAs; each CTA counts its scores' "
        "first radix digit as it writes them, so the select kernel reads every score once."),
    ("dsa_indexer_topk_fp8", "triton"): (
        "The fp8 indexer as DeepSeek ships it, logits fused (Triton)",
        "q and k in float8 e4m3 with float32 scales: half the bytes of bfloat16 and twice "
        "the tensor-core rate."),
    ("dsa_indexer_topk_fp8", "cute"): (
        "The fp8 indexer on Hopper: e4m3 wgmma fed by TMA, the key scale after the head sum",
        "The bf16 CuTe kernel on e4m3 operands: wgmma at twice the bf16 rate, the per-token key "
        "scale applied once to each summed score (it is positive and shared by every head)."),
    ("dsa_indexer_topk_paged", "cute"): (
        "The paged indexer a server calls: lengths on the device, one graph for every step",
        "Keys by TMA one cache block per tile through the block table, lengths read from "
        "context_lens on the device and a grid from shapes alone: one compile serves every "
        "length, and a long sequence is split into spans whose selections are merged."),
    ("dsa_indexer_topk_paged_fp8", "cute"): (
        "The paged FP8 indexer a server calls: e4m3 wgmma through the block table",
        "The paged bf16 kernel's layout with the dense FP8 kernel's e4m3 wgmma; each token's "
        "scale read through the block table beside its key and applied once to its head sum."),
}


def render_png(figure, path: Path) -> None:
    """The figure as the page draws it (the same plotly.js the app serves), screenshotted."""
    from django.contrib.staticfiles import finders
    from playwright.sync_api import sync_playwright

    plotly = Path(finders.find("plotly/plotly.min.js"))
    html = ("<html><head><meta charset='utf-8'><script src='" + plotly.as_uri() + "'></script></head>"
            "<body style='margin:0'><div id='chart' style='width:1200px;height:560px'></div><script>"
            f"const f = {json.dumps(figure)};"
            "Plotly.newPlot('chart', f.data, f.layout, {staticPlot: true}).then(() => {"
            "document.body.dataset.ready = '1'; });</script></body></html>")
    with tempfile.TemporaryDirectory() as scratch:
        page_file = Path(scratch) / "chart.html"
        page_file.write_text(html)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1200, "height": 560})
            page.goto(page_file.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            page.locator("#chart").screenshot(path=str(path))
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "docs/benchmarks/h200")
    parser.add_argument("--chart", type=Path, default=ROOT / "docs/benchmarks/h200/path_chart.png")
    args = parser.parse_args()
    files = sorted(args.results.glob("sweep_*.jsonl"))
    if not files:
        sys.exit(f"no results files (sweep_*.jsonl) under {args.results}")

    with app_environment() as servers:
        print(servers, file=sys.stderr)
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Permission

        import workspace
        from research.hardware import gpu_class
        from research.importing import results_import
        from research.models import Candidate
        from research.theses import thesis_submit
        from reviews import charts, selectors, services as reviews

        workspace.ensure()
        users = get_user_model().objects
        author = users.create_user("author", password="unused-author-password")
        reviewer = users.create_user("reviewer", password="unused-reviewer-password")
        confirmer = users.create_user("confirmer", password="unused-confirmer-password")
        for person in (reviewer, confirmer):
            person.user_permissions.add(Permission.objects.get(codename="decide_candidate"))
        # Permissions are cached per instance.
        reviewer, confirmer = users.get(pk=reviewer.pk), users.get(pk=confirmer.pk)

        theses, sweeps = {}, []
        # Oldest first: the order the results came in is the path's order.
        for path in sorted(files, key=lambda p: json.loads(p.open().readline())["started_at"]):
            header = json.loads(path.open().readline())
            # The card the file says it ran on: an H100's results are the H100's sweeps.
            hardware = gpu_class(header["hardware"])
            if hardware is None:
                sys.exit(f"{path}: ran on {header['hardware']!r}, which is no GPU class here")
            key = (header["op"], header["dsl"], hardware)
            if key not in theses:
                title, idea = THESES[key[:2]]
                theses[key] = thesis_submit(
                    author=author, title=title, idea=idea, op=header["op"], hardware=hardware,
                    required_dsl=header["dsl"], context_lengths=header["context_lengths"],
                    batch_sizes=header["batch_sizes"])
            sweeps.append(results_import(thesis=theses[key], imported_by=author, data=path.read_bytes()))

        report = []
        for op, hardware in sorted({(key[0], key[2]) for key in theses}):
            wins = list(Candidate.objects.filter(sweep__in=sweeps, sweep__thesis__op=op,
                                                 sweep__thesis__hardware=hardware, verdict="win")
                        .select_related("sweep").order_by("-geomean_speedup"))
            for rank, candidate in enumerate(wins):
                # Sorted: PostgreSQL's jsonb keeps keys in its own order, SQLite in the file's.
                label = f"{candidate.sweep.kernel} {dict(sorted(candidate.params.items()))}"
                if rank == 0:
                    dispatch = candidate.result.get("dispatch") or {}
                    reviews.candidate_keep_unverified_request(
                        candidate=candidate, reviewer=reviewer, commit=candidate.commit,
                        comment=f"The fastest win for this op on the {hardware.upper()}; every guard passed. "
                                f"No {hardware.upper()} worker here to verify it.",
                        dispatch_min=dispatch.get("min"), dispatch_max=dispatch.get("max"))
                    reviews.candidate_keep(candidate=candidate, reviewer=confirmer, commit=candidate.commit,
                                           confirm_unverified=True)
                    report.append(f"{op} on {hardware}: kept {label}, geomean {candidate.geomean_speedup:.2f}x, "
                                  f"dispatch {dispatch.get('summary', 'none')} (unverified, two reviewers)")
                else:
                    reviews.candidate_revert(
                        candidate=candidate, reviewer=reviewer, commit=candidate.commit,
                        comment=f"Superseded: {wins[0].sweep.kernel} is faster at every context here.")
                    report.append(f"{op} on {hardware}: reverted {label}, geomean {candidate.geomean_speedup:.2f}x")
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        render_png(charts.path_figure(selectors.path_points()), args.chart)
        report.append(f"path chart: {args.chart}")
        print("\n".join(report))


if __name__ == "__main__":
    main()
