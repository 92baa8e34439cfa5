"""How far an honest kernel moves the decode step's output, sequence by sequence, and
how far a kernel that cuts corners inside the step moves it: what the e2e guard's
output check (runners/harness/endtoend.py, STEP_OUTPUT_DIFFERENCE) rests on.

    python3 bench/step_output_spread.py [--device cpu] [--ctx 2048] [--batch 4] [--seeds 40]

For each seed it builds the step with the kept kernels, with an honest indexer that
sums its heads in another order (tests/candidates/dsa_correct_per_head.py), and with
an rmsnorm that skips the norm inside the step
(tests/candidates/rmsnorm_cuts_corners_in_the_step.py), and prints the distribution of
every sequence's relative L2 distance from the kept kernels' output, and how many of a
batch's sequences lay beyond the check's limit.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runners.e2e.model import SHAPES, DecodeStep, Dispatch  # noqa: E402
from runners.e2e.step import kept_dispatch  # noqa: E402
from runners.harness.endtoend import STEP_OUTPUT_DIFFERENCE  # noqa: E402

CANDIDATES = ROOT / "tests" / "candidates"
KERNELS = {"honest indexer": ("dsa_indexer_topk", "dsa_correct_per_head.py"),
           "norm skipped in the step": ("rmsnorm", "rmsnorm_cuts_corners_in_the_step.py")}


def _forward(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forward


def _sequences(found: torch.Tensor, expected: torch.Tensor) -> list[float]:
    found, expected = found.double().flatten(1), expected.double().flatten(1)
    return ((found - expected).norm(dim=1) / expected.norm(dim=1)).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    forwards = {label: (op, _forward(CANDIDATES / name)) for label, (op, name) in KERNELS.items()}

    def step_output(seed: int, op: str | None = None, forward=None) -> torch.Tensor:
        kernels = kept_dispatch()
        if op is not None:
            kernels[op] = forward
        step = DecodeStep(SHAPES[args.device], context_length=args.ctx, batch=args.batch,
                          device=args.device, seed=seed, dispatch=Dispatch(**kernels))
        return step().cpu()

    rows: dict[str, list[float]] = {label: [] for label in forwards}
    most_beyond: dict[str, int] = {label: 0 for label in forwards}
    for seed in range(args.seeds):
        kept = step_output(seed)
        for label, (op, forward) in forwards.items():
            found = _sequences(step_output(seed, op, forward), kept)
            rows[label] += found
            most_beyond[label] = max(most_beyond[label], sum(d > STEP_OUTPUT_DIFFERENCE for d in found))
    print(f"{args.device}, ctx={args.ctx}, batch {args.batch}, {args.seeds} seeds; "
          f"limit {100 * STEP_OUTPUT_DIFFERENCE:g}% a sequence")
    print(f"{'kernel':<26} {'sequences':>9} {'min':>7} {'p50':>7} {'p95':>7} {'max':>7} {'most beyond in a batch':>23}")
    for label, found in rows.items():
        found.sort()
        at = lambda q: 100 * found[min(len(found) - 1, int(q * len(found)))]  # noqa: E731
        print(f"{label:<26} {len(found):>9} {100 * found[0]:>6.2f}% {at(0.5):>6.2f}% {at(0.95):>6.2f}% "
              f"{100 * found[-1]:>6.2f}% {most_beyond[label]:>20} of {args.batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
