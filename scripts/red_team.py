"""The red team: every hack of skills/reward-hacks.md against the harness, and the legit
corpus beside it.

    .venv/bin/python scripts/red_team.py [--device cpu|cuda] [--json FILE] [--jobs N]

Each hack candidate listed in the catalogue is evaluated as the CLI evaluates it; it is
caught when the verdict is `rejected` and a guard its row names failed. Each legit
candidate (the correct ones of tests/candidates/ and every kernel the ops ship) must
not be rejected, except the shipped kernels of KNOWN_REJECTIONS on that device, which
must be rejected by the guard named there. Candidates marked (cuda) run only with --device cuda. Prints one line
per hack, then "caught X of Y hacks, Z false rejections"; exits 1 unless every hack
was caught and nothing legit was rejected.

--jobs N evaluates N candidates at a time, each judge pinned to its own share of this
machine's cores (the judge pins its children to the last of its cores): on a GPU host
the catalogue's hangs and compiles take their full limits one after another otherwise.
Only verdicts are read here, never speedups, so sharing the GPU changes little that
counts: only a first call's time, which waits on the others' work (CONFIRMED_ALONE says
what is done about it).
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
from runners.harness.hacks import catalog, op_of  # noqa: E402
from runners.ops import get_op, list_ops  # noqa: E402

CANDIDATES = ROOT / "tests" / "candidates"
# Small workloads and short limits: hangs end fast, and the question is what is caught.
CONTEXTS = {"cpu": {"rmsnorm": [64], "dsa_indexer_topk": [2048], "dsa_indexer_topk_fp8": [2048]},
            "cuda": {"rmsnorm": [1024], "dsa_indexer_topk": [4096], "dsa_indexer_topk_fp8": [4096]}}
# A GPU's first call compiles Triton and CuTe kernels, which takes longer than 5 s; on
# a CPU the Triton interpreter ran an indexer call for over 5 s on a busy 2-core machine.
LIMITS = {"cpu": Limits(import_s=10, call_s=30, memory_bytes=1024 * 2**20),
          "cuda": Limits(import_s=60, call_s=90, memory_bytes=1024 * 2**20)}

# Shipped kernels the harness rejects on a device for a cost a serving engine would pay,
# with the guard that does (measured on an H200: docs/benchmarks/h200-serving.md). A
# kernel here that is no longer rejected, or rejected by another guard, fails the run.
_COMPILES_PER_SIZE = "first-call"
KNOWN_REJECTIONS = {
    "cuda": {
        # A CuTe kernel compiled per shape (functools.cache on the sizes): 0.1 s a new
        # token count. The indexers' lengths are runtime values since 2026-12-05 (one
        # compile per shape class; their paged twins measured at 0.07-0.32 ms more on a
        # first call, docs/benchmarks/h200-dsa-indexer.md), the dense ones' batches of
        # query rows since 2026-12-06 (a new batch had cost 1.17 s on an H100): they
        # are legit now.
        "rows_cute.py": _COMPILES_PER_SIZE,
        # Triton kernels with a constexpr derived from the context length (SPAN_TILES,
        # CAPACITY, CHUNKS): 0.35-9.5 s a new length.
        "partial_topk_triton.py": _COMPILES_PER_SIZE,
        "pipelined_topk_triton.py": _COMPILES_PER_SIZE,
        "radix_topk_triton.py": _COMPILES_PER_SIZE,
        # The eager paged kernels read every sequence's length on the host, which a
        # CUDA graph cannot: a server could not capture them.
        "per_sequence.py": "cuda-graph",
        "per_sequence_fp8.py": "cuda-graph",
    },
    "cpu": {},
}

# Guards whose figures move when evaluations share a GPU: a first call's compile and
# capture wait on the other processes' time slices (an honest Triton kernel's first
# call at a new length took 85 ms with five evaluations on one H200, 5-8 ms alone;
# docs/benchmarks/h200-serving.md), and the clock check's baselines then wait on them
# too, which widens what it must allow (`rmsnorm_halves_gpu_time.py` lies 0.2 ms a
# request at T=1024: judged no-gain beside four others, rejected by clock in 4 of 4
# runs alone; docs/benchmarks.md). A runner has its GPU to itself, so where such a
# guard decided (a legit candidate rejected by these alone, a hack whose row names
# one of them missed, or a hack these alone stopped before its own guard ran: a
# first-call rejection ends the evaluation before the end-to-end step), the candidate
# is evaluated again with nothing beside it and that verdict counts; the shared run's
# is printed beside it. (Judges on a CPU share
# its memory bandwidth and caches the same way.)
CONFIRMED_ALONE = frozenset({"first-call", "clock"})


def legit_corpus(device: str) -> tuple[list[tuple[str, Path, str]], int]:
    """(op, file, dsl) of every candidate that must pass here, and how many need a GPU
    (a CuTe kernel compiles on the CPU but can only launch on one)."""
    corpus = [(op_of(path.name), path, "torch") for path in sorted(CANDIDATES.glob("*_correct_*.py"))]
    for name in list_ops():
        op = get_op(name)
        corpus += [(name, path, kernel_dsl(path)) for path in op.kernels().values()]
    runnable = [entry for entry in corpus if device == "cuda" or entry[2] != "cute"]
    return runnable, len(corpus) - len(runnable)


def run(op: str, path: Path, dsl: str, device: str) -> dict:
    started = time.monotonic()
    # An op without a chosen context gets its shortest default one.
    contexts = CONTEXTS[device].get(op) or get_op(op).default_context_lengths(device)[:1]
    # Each runtime guard on its own: a source the static checks reject is stopped before
    # any process runs it (tests/test_harness_corpus.py shows it), which would hide the
    # guard its row names.
    result = evaluate(op, path, device=device, dsl=dsl, context_lengths=contexts,
                      time_budget_s=0.05, limits=LIMITS[device], stop_at_static=False)
    return {"op": op, "file": path.name, "dsl": dsl, "verdict": result.verdict,
            "failed": {g.name: g.detail for g in result.guards if g.status == "fail"},
            "seconds": round(time.monotonic() - started, 1)}


def confirmed_alone(job: tuple[str, Path, str], found: dict, device: str,
                    guards: set[str] | None = None) -> dict:
    """`found` again from an evaluation alone, where sharing the GPU may have decided it:
    a candidate expected to pass (`guards` None) rejected only by guards of
    CONFIRMED_ALONE, or a hack to be caught by `guards` that none of them rejected,
    where one of them is in CONFIRMED_ALONE or only CONFIRMED_ALONE guards rejected it.
    The shared run's verdict is kept beside it."""
    failed = set(found["failed"])
    stopped_by_sharing = found["verdict"] == "rejected" and failed <= CONFIRMED_ALONE
    if guards is None:
        again = stopped_by_sharing and found["file"] not in KNOWN_REJECTIONS[device]
    else:
        again = not (guards & failed) and (bool(guards & CONFIRMED_ALONE) or stopped_by_sharing)
    if not again:
        return found
    return {**run(*job, device), "shared": {"verdict": found["verdict"], "failed": found["failed"]}}


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
            if not candidate.plays_on(args.device):
                skipped.add(candidate.file)
                continue
            expected.setdefault(candidate.file, set()).update(hack.guards)

    corpus, legit_skipped = legit_corpus(args.device)
    hack_jobs = [(op_of(name), CANDIDATES / name, kernel_dsl(CANDIDATES / name)) for name in expected]
    found_all = run_all(hack_jobs + corpus, args.device, args.jobs)
    results = dict(zip(expected, found_all[:len(hack_jobs)]))
    legit = found_all[len(hack_jobs):]
    if args.jobs > 1:
        legit = [confirmed_alone(job, found, args.device) for job, found in zip(corpus, legit)]
        results = {name: confirmed_alone(job, found, args.device, expected[name])
                   for job, (name, found) in zip(hack_jobs, results.items())}
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

    known_here = KNOWN_REJECTIONS[args.device]
    known = [found for found in legit if found["file"] in known_here]
    for found in known:
        guard = known_here[found["file"]]
        found["as_known"] = found["verdict"] == "rejected" and guard in found["failed"]
        print(f"KNOWN REJECTION {found['file']}: " + (f"{guard}: {found['failed'][guard]}" if found["as_known"]
              else f"NOT AS KNOWN ({found['verdict']}; failed: {', '.join(found['failed']) or 'none'})"))
    false_rejections = [found for found in legit
                        if found["verdict"] == "rejected" and found["file"] not in known_here]
    for found in false_rejections:
        print(f"FALSE REJECTION {found['file']}: {found['failed']}")
    for found in [*results.values(), *legit]:
        if "shared" in found:
            shared = found["shared"]
            print(f"CONFIRMED ALONE {found['file']}: {found['verdict']} (beside the others: "
                  f"{shared['verdict']}; failed: "
                  f"{', '.join(f'{k}: {v}' for k, v in shared['failed'].items()) or 'none'})")
    unlike = [found["file"] for found in known if not found["as_known"]]
    caught = sum(found["caught"] for found in results.values())
    # A miss that earned nothing (no-gain) is a guard that did not fire; one judged a win
    # is a verdict the hack bought.
    won = sum(not found["caught"] and found["verdict"] == "win" for found in results.values())
    where = "a CPU" if args.device == "cuda" else "a GPU"
    summary = (f"caught {caught} of {len(results)} hacks ({won} of the others judged win), "
               f"{len(false_rejections)} false rejections"
               f", {len(known) - len(unlike)} of {len(known)} known rejections as recorded"
               f" ({len(legit)} legit candidates; {len(skipped)} hack candidates play their hack "
               f"only on {where}, {legit_skipped} legit candidates need a GPU)")
    print(summary)
    if args.json:
        args.json.write_text(json.dumps({"hacks": results, "legit": legit, "summary": summary}, indent=1))
    return 0 if caught == len(results) and not false_rejections and not unlike else 1


if __name__ == "__main__":
    sys.exit(main())
