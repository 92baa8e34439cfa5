"""The red team: every hack of skills/reward-hacks.md against the harness, and the legit
corpus beside it.

    .venv/bin/python scripts/red_team.py [--device cpu|cuda] [--json FILE] [--jobs N]

Each hack candidate listed in the catalogue is evaluated as the CLI evaluates it; it is
caught when the verdict is `rejected` and a guard its row names failed. Each legit
candidate (the correct ones of tests/candidates/ and every kernel the ops ship) must
not be rejected. Candidates marked (cuda) run only with --device cuda. Prints one line
per hack, then "caught X of Y hacks, Z false rejections"; exits 1 unless every hack
was caught and nothing legit was rejected.

--jobs N evaluates N candidates at a time, each judge pinned to its own share of this
machine's cores (the judge pins its children to the last of its cores): on a GPU host
the catalogue's hangs and compiles take their full limits one after another otherwise.
Only verdicts are read here, never speedups, so sharing the GPU changes nothing that
counts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runners.harness import Limits, evaluate  # noqa: E402
from runners.harness.dsl import kernel_dsl  # noqa: E402
from runners.harness.hacks import catalog  # noqa: E402
from runners.ops import get_op, list_ops  # noqa: E402

CANDIDATES = ROOT / "tests" / "candidates"
# Small workloads and short limits: hangs end fast, and the question is what is caught.
CONTEXTS = {"cpu": {"rmsnorm": [64], "dsa_indexer_topk": [2048], "dsa_indexer_topk_fp8": [2048]},
            "cuda": {"rmsnorm": [1024], "dsa_indexer_topk": [4096], "dsa_indexer_topk_fp8": [4096]}}
# A GPU's first call compiles Triton and CuTe kernels, which takes longer than 5 s; on
# a CPU the Triton interpreter ran an indexer call for over 5 s on a busy 2-core machine.
LIMITS = {"cpu": Limits(import_s=10, call_s=30, memory_bytes=1024 * 2**20),
          "cuda": Limits(import_s=60, call_s=90, memory_bytes=1024 * 2**20)}


def legit_corpus(device: str) -> tuple[list[tuple[str, Path, str]], int]:
    """(op, file, dsl) of every candidate that must pass here, and how many need a GPU
    (a CuTe kernel compiles on the CPU but can only launch on one)."""
    corpus = [("rmsnorm" if path.name.startswith("rmsnorm") else "dsa_indexer_topk", path, "torch")
              for path in sorted(CANDIDATES.glob("*_correct_*.py"))]
    for name in list_ops():
        op = get_op(name)
        corpus += [(name, path, kernel_dsl(path)) for path in op.kernels().values()]
    runnable = [entry for entry in corpus if device == "cuda" or entry[2] != "cute"]
    return runnable, len(corpus) - len(runnable)


def run(op: str, path: Path, dsl: str, device: str) -> dict:
    started = time.monotonic()
    # An op without a chosen context gets its shortest default one.
    contexts = CONTEXTS[device].get(op) or get_op(op).default_context_lengths(device)[:1]
    result = evaluate(op, path, device=device, dsl=dsl, context_lengths=contexts,
                      time_budget_s=0.05, limits=LIMITS[device])
    return {"op": op, "file": path.name, "dsl": dsl, "verdict": result.verdict,
            "failed": {g.name: g.detail for g in result.guards if g.status == "fail"},
            "seconds": round(time.monotonic() - started, 1)}


def _pin(cores) -> None:
    os.sched_setaffinity(0, cores.get())


def run_all(jobs: list[tuple[str, Path, str]], device: str, workers: int) -> list[dict]:
    """run() of every (op, file, dsl), in order; `workers` judges at a time."""
    if workers <= 1 or not hasattr(os, "sched_setaffinity"):
        return [run(op, path, dsl, device) for op, path, dsl in jobs]
    context = multiprocessing.get_context("spawn")
    available = sorted(os.sched_getaffinity(0))
    share = max(1, len(available) // workers)
    cores = context.Queue()
    for index in range(workers):
        cores.put(available[index * share % len(available):][:share])
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_pin, initargs=(cores,)) as pool:
        return list(pool.map(run, *zip(*jobs), [device] * len(jobs)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--jobs", type=int, default=1, help="candidates evaluated at a time")
    args = parser.parse_args()

    hacks = catalog()
    expected: dict[str, set[str]] = {}
    skipped: set[str] = set()
    for hack in hacks:
        for candidate in hack.candidates:
            if (candidate.cuda_only and args.device != "cuda") or (candidate.cpu_only
                                                                    and args.device == "cuda"):
                skipped.add(candidate.file)
                continue
            expected.setdefault(candidate.file, set()).update(hack.guards)

    corpus, legit_skipped = legit_corpus(args.device)
    hack_jobs = [("rmsnorm" if name.startswith("rmsnorm") else "dsa_indexer_topk", CANDIDATES / name,
                  kernel_dsl(CANDIDATES / name)) for name in expected]
    found_all = run_all(hack_jobs + corpus, args.device, args.jobs)
    results = dict(zip(expected, found_all[:len(hack_jobs)]))
    legit = found_all[len(hack_jobs):]
    for name, found in results.items():
        found["caught"] = found["verdict"] == "rejected" and bool(expected[name] & set(found["failed"]))
    for hack in hacks:
        states = []
        for candidate in hack.candidates:
            found = results.get(candidate.file)
            states.append(f"{candidate.file}: " + (("not run (plays its hack on a CPU)" if candidate.cpu_only
                                                    else "not run (needs a GPU)") if found is None else
                          "caught by " + ", ".join(sorted(set(hack.guards) & set(found["failed"])))
                          if found["caught"] else f"MISSED ({found['verdict']}; failed: {', '.join(found['failed']) or 'none'})"))
        print(f"{hack.title} [{', '.join(hack.guards)}]\n    " + "\n    ".join(states))

    false_rejections = [found for found in legit if found["verdict"] == "rejected"]
    for found in false_rejections:
        print(f"FALSE REJECTION {found['file']}: {found['failed']}")
    caught = sum(found["caught"] for found in results.values())
    where = "a CPU" if args.device == "cuda" else "a GPU"
    summary = (f"caught {caught} of {len(results)} hacks, {len(false_rejections)} false rejections"
               f" ({len(legit)} legit candidates; {len(skipped)} hack candidates play their hack "
               f"only on {where}, {legit_skipped} legit candidates need a GPU)")
    print(summary)
    if args.json:
        args.json.write_text(json.dumps({"hacks": results, "legit": legit, "summary": summary}, indent=1))
    return 0 if caught == len(results) and not false_rejections else 1


if __name__ == "__main__":
    sys.exit(main())
