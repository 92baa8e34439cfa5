"""The tables of docs/benchmarks/h200-dsa-indexer.md, from the harness's results files.

    python3 bench/h200/indexer_report.py [--results docs/benchmarks/h200]

Reads every sweep_*.jsonl there (written by `python -m runners.harness sweep`) and
prints, in Markdown: per op and context, the baseline and each candidate's median with
the 95% CI of that median, its speedup and the fraction of the compute floor it
reaches; then each candidate's end-to-end decode-step delta and verdict. Nothing is
measured here: every number is the harness's, as the results file holds it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ms(value: float | None, ci: list | None = None) -> str:
    if value is None:
        return "–"
    shown = f"{value:.3f}"
    if ci:
        shown += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    return shown


def _context(name: str) -> str:
    tokens = int(name.split("ctx=")[1].split(",")[0])
    return f"{tokens // 1024}K"


def load(results: Path) -> list[tuple[dict, list[dict]]]:
    runs = []
    for path in sorted(results.glob("sweep_*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs.append((lines[0], lines[1:]))
    # A kernel swept in more than one run (its source changed between them) is named
    # with the time its run started, so the versions stay apart.
    kernels = [(header["op"], header["kernel"]) for header, _ in runs]
    for header, _ in runs:
        header["label"] = header["kernel"]
        if kernels.count((header["op"], header["kernel"])) > 1:
            header["label"] += f" (run of {header['started_at'][:16].replace('T', ' ')})"
    return runs


def timing_table(op: str, runs: list[tuple[dict, list[dict]]]) -> list[str]:
    rows = [(header, line) for header, lines in runs if header["op"] == op for line in lines
            if line["result"]["workloads"] and line["result"]["workloads"][0].get("candidate_ms")]
    if not rows:
        return []
    names = [w["name"] for w in rows[0][1]["result"]["workloads"]]
    contexts = [_context(name) for name in names]
    out = [f"### {op}", "",
           "Median ms [95% CI of the median]; speedup over the baseline process pair; "
           "fraction of the compute floor reached.", "",
           "| kernel | point | " + " | ".join(contexts) + " |",
           "|---|---|" + "---|" * len(contexts)]
    first = rows[0][1]["result"]["workloads"]
    out.append("| compute floor | | " + " | ".join(_ms(w.get("floor_ms")) for w in first) + " |")
    for header, line in rows:
        base = line["result"]["workloads"]
        point = ", ".join(f"{k}={v}" for k, v in line["params"].items())
        out.append(f"| baseline (timed with {header['label']} #{line['number']}) | | " + " | ".join(
            _ms(w["baseline_ms"], w.get("baseline_ci_ms")) for w in base) + " |")
        out.append(f"| {header['label']} | {point} | " + " | ".join(
            f"{_ms(w['candidate_ms'], w.get('candidate_ci_ms'))}<br>{w['speedup']:.2f}x"
            f"{'*' if w.get('significant') else ''}, {100 * (w.get('roofline_fraction') or 0):.0f}% of floor"
            for w in base) + " |")
    return out + ["", "`*` significant: Mann–Whitney p < 0.01, CI excluding 1, beyond the run's A/A noise floor.", ""]


def e2e_table(runs: list[tuple[dict, list[dict]]]) -> list[str]:
    out = ["| op | kernel | point | verdict | end-to-end decode step (CUDA graphs) | dispatch |",
           "|---|---|---|---|---|---|"]
    for header, lines in runs:
        for line in lines:
            result = line["result"]
            e2e = result.get("e2e") or {}
            delta = (f"{e2e['delta_pct']:+.1f}% [{e2e['delta_ci_pct'][0]:+.1f}%, {e2e['delta_ci_pct'][1]:+.1f}%]; "
                     f"{e2e['baseline_ms']:.2f} → {e2e['candidate_ms']:.2f} ms"
                     if e2e.get("delta_pct") is not None else "not measured for this op")
            dispatch = (result.get("dispatch") or {}).get("summary", "–")
            point = ", ".join(f"{k}={v}" for k, v in line["params"].items())
            out.append(f"| {header['op']} | {header['label']} | {point} | {result['verdict']} | {delta} | {dispatch} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "docs/benchmarks/h200")
    args = parser.parse_args()
    runs = load(args.results)
    if not runs:
        raise SystemExit(f"no results files (sweep_*.jsonl) under {args.results}")
    lines: list[str] = []
    for op in sorted({header["op"] for header, _ in runs}):
        lines += timing_table(op, runs)
    lines += e2e_table(runs)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
