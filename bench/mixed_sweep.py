"""Candidates judged per hour on a sweep whose candidates are mostly bad, as an agent's are.

    .venv/bin/python bench/mixed_sweep.py [--op rmsnorm] [--device cpu] [--candidates 20]
                                          [--bad-share 0.8] [--time-budget 1.0] [--ctx 64,512,4096]
    python3 bench/mixed_sweep.py --op dsa_indexer_topk_paged_fp8 --device cuda ...   # a GPU host

The talk's loop rejects about 80% of what it tries. This makes such a sweep: the bad
candidates are the op's hacks of the catalogue (skills/reward-hacks.md: wrong answers,
work hidden from the clock, tampering; the ones that play only on a GPU left out on a
CPU), each a real attack; the good ones are points of the op's shipped kernels' SPACE.
They are mixed in an order drawn from --seed, every source fixed before the first runs,
and judged one after another in this process as `python -m runners.harness sweep` judges
its candidates: one secret seed, one memo (runners.harness.memo), the default checks
(static ones first). Reports candidates an hour, the wall of the bad ones by the stage
that stopped them and of the good ones, and exits 1 if a bad one was not rejected.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runners import space  # noqa: E402
from runners.harness import evaluate  # noqa: E402
from runners.harness.dsl import kernel_dsl  # noqa: E402
from runners.harness.hacks import catalog  # noqa: E402
from runners.harness.memo import Memo, limit_bytes  # noqa: E402
from runners.harness.seeds import draw_secret_seed  # noqa: E402
from runners.ops import get_op  # noqa: E402
from scripts.red_team import KNOWN_REJECTIONS  # noqa: E402

CANDIDATES = ROOT / "tests" / "candidates"


def bad_pool(op: str, device: str) -> list[Path]:
    """The catalogue's hacks of `op` that play on `device`, each once."""
    found = {candidate.file for hack in catalog() for candidate in hack.candidates
             if candidate.op == op and candidate.plays_on(device)}
    return [CANDIDATES / name for name in sorted(found)]


def good_pool(op: str, device: str, folder: Path) -> list[Path]:
    """Every SPACE point of the op's shipped kernels that run on `device` and that the
    harness does not reject there for a cost a serving engine would pay (the red team's
    KNOWN_REJECTIONS: on a GPU the eager paged kernels cannot be captured), as files."""
    files = []
    for name, path in get_op(op).kernels().items():
        if kernel_dsl(path) == "cute" and device != "cuda":
            continue  # compiles on a CPU, but launches only on a GPU
        if path.name in KNOWN_REJECTIONS[device]:
            continue
        source = path.read_text(encoding="utf-8")
        _, parameter_space = space.read_literals(source)
        for number, point in enumerate(space.grid_points(parameter_space) if parameter_space else [{}]):
            target = folder / f"{name}_{number}" / path.name
            target.parent.mkdir()
            target.write_text(space.materialize(source, point) if point else source, encoding="utf-8")
            target.chmod(0o644)
            files.append(target)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="rmsnorm")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--candidates", type=int, default=20)
    parser.add_argument("--bad-share", type=float, default=0.8)
    parser.add_argument("--time-budget", type=float, default=1.0)
    parser.add_argument("--ctx", help="context lengths, e.g. 64,512,4096 (default: the op's)")
    parser.add_argument("--seed", type=int, default=0, help="the mix's order and picks")
    args = parser.parse_args()
    contexts = [int(part) for part in args.ctx.split(",")] if args.ctx else None
    draw = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="mixed-sweep-") as scratch:
        bad, good = bad_pool(args.op, args.device), good_pool(args.op, args.device, Path(scratch))
        bad_count = round(args.candidates * args.bad_share)
        if not bad or not good:
            sys.exit(f"{args.op} on {args.device}: {len(bad)} hacks and {len(good)} kernel points to draw from")
        picked = ([(path, "bad") for path in draw.choices(bad, k=bad_count)]
                  + [(path, "good") for path in draw.sample(good, min(len(good), args.candidates - bad_count))])
        draw.shuffle(picked)
        seed, memo = draw_secret_seed(), Memo(limit_bytes(args.device))
        rows: list[tuple[str, str, float, str, str | None]] = []
        began = time.monotonic()
        for number, (path, kind) in enumerate(picked, start=1):
            started = time.monotonic()
            result = evaluate(args.op, path, device=args.device, dsl=kernel_dsl(path),
                              context_lengths=contexts, time_budget_s=args.time_budget,
                              seed=seed, memo=memo)
            wall = time.monotonic() - started
            rows.append((path.name, kind, wall, result.verdict, result.stopped_at))
            failed = next((f"{guard.name}: {guard.detail}" for guard in result.guards
                           if guard.status == "fail"), "")
            print(f"{number:3d} {kind:4s} {wall:7.2f} s  {result.verdict:8s} "
                  f"{result.stopped_at or '':12s} {path.name}  {failed[:160]}", file=sys.stderr)
        total = time.monotonic() - began
    missed = [name for name, kind, _, verdict, _ in rows if kind == "bad" and verdict != "rejected"]
    print(f"{args.op} on {args.device}: {len(rows)} candidates ({bad_count} bad) in {total:.1f} s: "
          f"{3600 * len(rows) / total:.0f} candidates an hour")
    by_stage: dict[str, list[float]] = defaultdict(list)
    for _, kind, wall, _, stage in rows:
        if kind == "bad":
            by_stage[stage or "not stopped"].append(wall)
    for stage, walls in sorted(by_stage.items(), key=lambda item: statistics.median(item[1])):
        print(f"  bad, stopped at {stage:12s} {len(walls):3d}: median {statistics.median(walls):6.2f} s, "
              f"max {max(walls):6.2f} s")
    good_walls = [wall for _, kind, wall, _, _ in rows if kind == "good"]
    good_verdicts = [verdict for _, kind, _, verdict, _ in rows if kind == "good"]
    print(f"  good {len(good_walls):3d}: median {statistics.median(good_walls):6.2f} s, max {max(good_walls):6.2f} s; "
          + ", ".join(f"{v} {good_verdicts.count(v)}" for v in sorted(set(good_verdicts))))
    print(f"  the memo: {memo.summary()}")
    if missed:
        print("  NOT REJECTED: " + ", ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
