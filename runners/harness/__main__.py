"""Command line: `python -m runners.harness evaluate OP CANDIDATE ...`, `... sweep OP KERNEL
... --out FILE` (runners.harness.sweep), `... compound STAGES.json` (the kept kernels'
waterfall, runners.harness.compound) and `... ops`.

With --json, stdout carries exactly one JSON object. Candidates run in child processes
whose output goes to stderr; still, before anything runs the real stdout is moved to a
private descriptor and descriptor 1 (and sys.stdout) point at stderr, so nothing a
library prints can land between the result's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, TextIO

from runners.harness import compound, roofline
from runners.harness.e2e_command import BUDGET_S as E2E_COMMAND_BUDGET_S
from runners.harness.evaluate import DSLS, UsageError, evaluate
from runners.harness.result import EvaluationResult
from runners.harness.sweep import sweep
from runners.ops import Op, UnknownOpError, WorkloadError, get_op, list_ops
from runners.space import STRATEGIES, grid_points, read_literals

PROG = "python -m runners.harness"


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2, which scripts can show as is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {' '.join(message.split())}\n")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def _json_points(text: str) -> list[Any]:
    """A JSON list given inline, or @FILE holding one."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as error:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {error.strerror}") from None
    try:
        points = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"the points are not JSON: {error.msg} "
                                         f"(character {error.pos})") from None
    if not isinstance(points, list):
        raise argparse.ArgumentTypeError("the points must be a JSON list of objects")
    return points


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Evaluate GPU kernel candidates.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("evaluate", help="check a candidate and time it against the baseline")
    run.add_argument("op", help="op name, e.g. rmsnorm")
    run.add_argument("candidate", help="candidate file, or 'baseline' for an A/A run")
    run.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    run.add_argument("--dsl", choices=DSLS, default="torch")
    run.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    run.add_argument("--ctx", type=_int_list, help="context lengths, e.g. 2048,8192")
    run.add_argument("--batch", type=_int_list, help="batch sizes, e.g. 4")
    run.add_argument("--time-budget", type=float, default=1.0, help="seconds of timing per workload")
    run.add_argument("--seed", type=int, help="repeat a run: the seed its result revealed")
    run.add_argument("--baseline", help="kernel file to time against (default: the op's baseline.py); "
                                        "its DSL is read from its name, e.g. kept_triton.py")
    run.add_argument("--lib", metavar="DIR",
                     help="the lib folder whose shared code (runners.kernel_lib) the candidate imports, "
                          "e.g. a workspace checkout's kernels/lib (default: the shipped runners/kernel_lib)")
    run.add_argument("--baseline-lib", metavar="DIR", help="the same for the baseline")
    run.add_argument("--e2e-command", metavar="CMD",
                     help="your end-to-end program, run with the kept kernel and with the candidate "
                          "(KERNEL_FILE names the kernel to load); its last stdout line is JSON such as "
                          '{"metric": "step_ms", "value": 12.5}')
    run.add_argument("--e2e-command-budget", type=float, default=E2E_COMMAND_BUDGET_S, metavar="SECONDS",
                     help="seconds for the end-to-end command's runs, all rounds together")

    swept = commands.add_parser(
        "sweep", help="evaluate points of a kernel's SPACE, one JSON line per candidate in --out")
    swept.add_argument("op", help="op name, e.g. rmsnorm")
    swept.add_argument("kernel", help="a kernel file with PARAMS and SPACE, or the name of one the op ships")
    swept.add_argument("--strategy", choices=STRATEGIES, default="grid")
    swept.add_argument("--budget", type=int, help="the most candidates to evaluate "
                                                  "(needed, except with --strategy listed: all of them)")
    swept.add_argument("--seed", type=int, help="the random strategy's sampling seed (default: drawn)")
    swept.add_argument("--points", type=_json_points, metavar="JSON",
                       help='with --strategy listed: the points to evaluate, e.g. \'[{"block": 128}]\' '
                            "or @FILE holding such a list")
    swept.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    swept.add_argument("--dsl", choices=DSLS, help="default: the kernel file's, by its name")
    swept.add_argument("--ctx", type=_int_list, help="context lengths, e.g. 2048,8192")
    swept.add_argument("--batch", type=_int_list, help="batch sizes, e.g. 4")
    swept.add_argument("--time-budget", type=float, default=1.0, help="seconds of timing per workload")
    swept.add_argument("--baseline", help="kernel file to time against (default: the op's baseline.py): "
                                          "the thesis's kept kernel, as GET /api/theses/ID shows it")
    swept.add_argument("--e2e-command", metavar="CMD", help="as for evaluate")
    swept.add_argument("--e2e-command-budget", type=float, default=E2E_COMMAND_BUDGET_S, metavar="SECONDS")
    swept.add_argument("--out", required=True, help="the results file to write (JSON Lines; must not exist)")

    stacked = commands.add_parser(
        "compound", help="time the decode loop with each stage's kept kernels stacked in (a waterfall)")
    stacked.add_argument("stages", help="the stages file (runners/harness/compound.py says its format)")
    stacked.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    stacked.add_argument("--time-budget", type=float, default=10.0, help="seconds of timing in all")
    stacked.add_argument("--seed", type=int, help="repeat a run: the seed its result revealed")
    stacked.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    ops = commands.add_parser("ops", help="list the ops and their default workloads")
    ops.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def _protect_stdout() -> TextIO:
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(private, "w", encoding="utf-8")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _summary(result: EvaluationResult) -> str:
    lines = [f"{result.op} on {result.device}: {result.verdict}"
             f" ({'correct' if result.correct else 'not correct'})"]
    lines += [f"  {guard.status:<4}  {guard.name}: {guard.detail}" for guard in result.guards]
    for workload in result.workloads:
        if workload.speedup is None:
            lines.append(f"  {workload.name}: not timed")
            continue
        low, high = workload.speedup_ci or (float("nan"), float("nan"))
        lines.append(
            f"  {workload.name}: baseline {workload.baseline_ms:.4g} ms, candidate "
            f"{workload.candidate_ms:.4g} ms, {workload.speedup:.3f}x [{low:.3f}, {high:.3f}]"
            + (" significant" if workload.significant else "")
        )
    return "\n".join(lines)


def _describe_op(op: Op) -> dict[str, Any]:
    kernels = []
    for name, path in op.kernels().items():
        params, space = read_literals(path.read_text(encoding="utf-8"))
        kernels.append({"name": name, "path": str(path), "params": params, "space": space,
                        "points": len(grid_points(space)) if space else 0})
    devices = {}
    for device in ("cpu", "cuda"):
        low, high = op.context_length_range(device)
        devices[device] = {
            "context_lengths": op.default_context_lengths(device),
            "batch_sizes": op.default_batch_sizes(device),
            "context_length_range": [low, high],
            "max_batch_size": op.max_batch_size(device),
            "workloads": [
                {**workload.to_dict(), "flops": op.flops(workload), "bytes": op.bytes(workload)}
                for workload in op.workloads(device)
            ],
        }
    return {"name": op.name, "title": op.title, "description": op.description,
            "signature": op.signature, "baseline": str(op.baseline_path),
            "kernels": kernels, "devices": devices}


def _ops_command(args: argparse.Namespace, out: TextIO) -> int:
    described = [_describe_op(get_op(name)) for name in list_ops()]
    if args.json:
        out.write(json.dumps({"ops": described}) + "\n")
        return 0
    for op in described:
        out.write(f"{op['name']}: {op['title']} — {op['signature']}\n")
        for device, facts in op["devices"].items():
            names = ", ".join(workload["name"] for workload in facts["workloads"])
            out.write(f"  {device}: {names}\n")
        for kernel in op["kernels"]:
            out.write(f"  kernel {kernel['name']}: {kernel['points']} points\n")
    return 0


def _evaluate_command(args: argparse.Namespace, out: TextIO) -> int:
    result = evaluate(
        args.op, args.candidate, device=args.device, context_lengths=args.ctx,
        batch_sizes=args.batch, time_budget_s=args.time_budget, progress=_say,
        dsl=args.dsl, seed=args.seed, baseline=args.baseline,
        lib=args.lib, baseline_lib=args.baseline_lib,
        e2e_command=args.e2e_command, e2e_command_budget_s=args.e2e_command_budget,
    )
    out.write((result.to_json() if args.json else _summary(result)) + "\n")
    return 0


def _sweep_command(args: argparse.Namespace, out: TextIO) -> int:
    if args.budget is None:
        if args.strategy != "listed" or args.points is None:
            raise UsageError("--budget is needed: the most candidates to evaluate")
        args.budget = len(args.points)
    try:
        lines = sweep(
            args.op, args.kernel, out=args.out, strategy=args.strategy, budget=args.budget,
            seed=args.seed, points=args.points, device=args.device, dsl=args.dsl, context_lengths=args.ctx,
            batch_sizes=args.batch, baseline=args.baseline, time_budget_s=args.time_budget,
            e2e_command=args.e2e_command, e2e_command_budget_s=args.e2e_command_budget, progress=_say,
        )
    except FileExistsError:
        raise UsageError(f"{args.out} exists: a results file is never overwritten") from None
    verdicts = [line["result"]["verdict"] for line in lines]
    tally = ", ".join(f"{verdicts.count(v)} {v}" for v in ("win", "no-gain", "rejected"))
    out.write(f"{len(lines)} candidates in {args.out}: {tally}\n")
    return 0


def _compound_command(args: argparse.Namespace, out: TextIO) -> int:
    if not args.time_budget > 0:
        raise UsageError(f"the time budget must be positive, not {args.time_budget}")
    try:
        loop, stages = compound.read_stages(Path(args.stages))
        report = compound.measure(loop, stages, device=args.device, budget_s=args.time_budget,
                                  seed=args.seed, hardware=roofline.hardware_key(args.device),
                                  progress=_say)
    except compound.CompoundError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        out.write(json.dumps(report) + "\n")
        return 0
    out.write(f"{loop} loop, ctx={report['context_length']}, batch {report['batch']}, "
              f"{report['decode_steps']} steps a call; A/A noise floor {report['noise_floor_pct']:.2g}%\n")
    for stage in report["stages"]:
        change = (f"  {stage['speedup']:.3f}x over the stage before"
                  + (" significant" if stage["significant"] else "")) if "speedup" in stage else ""
        out.write(f"  {stage['tokens_per_s']:>12,.0f} tokens/s  {stage['label']}{change}\n")
    if report["roofline_tokens_per_s"]:
        out.write(f"  {report['roofline_tokens_per_s']:>12,.0f} tokens/s  roofline\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = _protect_stdout()
    try:
        if args.command == "ops":
            return _ops_command(args, out)
        if args.command == "sweep":
            return _sweep_command(args, out)
        if args.command == "compound":
            return _compound_command(args, out)
        return _evaluate_command(args, out)
    except (UsageError, UnknownOpError, WorkloadError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    finally:
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
