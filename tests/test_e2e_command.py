"""The user's own end-to-end command: their program, run with the kept kernel and with the
candidate, compared on the one number it prints.

Real programs in real subprocesses: tests/e2e_programs/ holds a timing program that loads
KERNEL_FILE and two broken ones; the shorter cases are `python -c` one-liners. Only the
tests that go through a whole evaluation import torch in the program (about 2 s a run
here), so they keep to few rounds.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runners.harness import Limits, evaluate
from runners.harness import e2e_command
from runners.harness.stats import P_THRESHOLD, mann_whitney_p

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "e2e_programs"
CORRECT = ROOT / "tests" / "candidates" / "rmsnorm_correct_rows.py"
KEPT = ROOT / "runners" / "ops" / "rmsnorm" / "baseline.py"
TIMING = f"{shlex.quote(sys.executable)} {shlex.quote(str(PROGRAMS / 'rmsnorm_forward_time.py'))}"
LIMITS = Limits(import_s=10, call_s=10, memory_bytes=512 * 2**20)
BUILT_IN_E2E_KEYS = {"baseline_ms", "candidate_ms", "delta_pct", "points"}


def _program(path: Path) -> str:
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(path))}"


def _one_liner(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(textwrap.dedent(code))}"


def _check(command: str, **options):
    return e2e_command.check(command, op="rmsnorm", candidate=CORRECT, baseline=KEPT,
                             secret_seed=7, **options)


def _guard(result):
    return next(guard for guard in result.guards if guard.name == "e2e-command")


def test_six_runs_a_side_are_the_fewest_that_can_ever_be_significant():
    def best_p(runs: int) -> float:  # every candidate run above every baseline run
        return mann_whitney_p(np.arange(runs, dtype=float), np.arange(runs, 2 * runs, dtype=float))

    assert best_p(e2e_command.ROUNDS - 1) >= P_THRESHOLD > best_p(e2e_command.ROUNDS)


def test_each_run_gets_the_kernel_file_the_op_and_its_role():
    command = _one_liner(f"""
        import json, os
        expected = {{"baseline": {str(KEPT)!r}, "candidate": {str(CORRECT)!r}}}
        assert os.environ["KERNEL_FILE"] == expected[os.environ["KERNEL_ROLE"]], os.environ["KERNEL_FILE"]
        assert os.environ["KERNEL_OP"] == "rmsnorm"
        print(json.dumps({{"metric": "step_ms", "value": 10.0}}))
    """)
    report, guard = _check(command, budget_s=0.01)  # room for the first round only
    assert guard.status == "pass", guard.detail
    assert report["baseline_values"] == report["candidate_values"] == [10.0]
    assert report["metric"] == "step_ms" and report["higher_is_better"] is False
    assert report["runs"] == 1 and report["delta_pct"] == 0 and report["significant"] is False
    assert guard.detail == (
        "no significant change: step_ms 10 with the candidate vs 10 with the kept kernel (+0.0%, "
        "95% CI [+0.0%, +0.0%], p=1; median of 1 run each, lower is better); only 1 run a side "
        "fit in the budget of 0.01 s, and 6 are needed before a difference can reach p < 0.01")


@pytest.mark.parametrize(
    ("candidate_value", "status", "detail"),
    [
        (50.0, "fail", "significantly worse end to end: tokens_per_s 50 with the candidate vs 100 "
                       "with the kept kernel (-50.0%, 95% CI [-50.0%, -50.0%], p=0.0013; median of 6 "
                       "runs each, higher is better)"),
        (200.0, "pass", "significantly better end to end: tokens_per_s 200 with the candidate vs 100 "
                        "with the kept kernel (+100.0%, 95% CI [+100.0%, +100.0%], p=0.0013; median "
                        "of 6 runs each, higher is better)"),
    ],
)
def test_a_higher_is_better_metric_fails_when_it_drops_and_passes_when_it_rises(
        candidate_value, status, detail):
    command = _one_liner(f"""
        import json, os
        value = {candidate_value} if os.environ["KERNEL_ROLE"] == "candidate" else 100.0
        print(json.dumps({{"metric": "tokens_per_s", "value": value, "higher_is_better": True}}))
    """)
    report, guard = _check(command)
    assert (guard.status, guard.detail) == (status, detail)
    assert report["runs"] == 6 and report["significant"] is True
    assert report["worse"] is (status == "fail")


@pytest.mark.parametrize(
    ("command", "options", "status", "detail"),
    [
        (_program(PROGRAMS / "prints_no_json.py"), {}, "warn",
         'the end-to-end command could not run: run 1 with the kept kernel printed no JSON on its '
         'last stdout line: "forward took 12.5 ms"'),
        (_program(PROGRAMS / "exits_1.py"), {}, "warn",
         "the end-to-end command could not run: run 1 with the kept kernel exited with status 1: "
         "loading the model...\nRuntimeError: checkpoint not found: /models/llama.safetensors"),
        ("no-such-e2e-program --steps 3", {}, "warn",
         "the end-to-end command could not run: command not found: 'no-such-e2e-program' "
         "(neither a file nor on PATH)"),
        ('python3 "bench.py', {}, "warn",
         "the end-to-end command could not run: cannot split 'python3 \"bench.py' into "
         "arguments: No closing quotation"),
        ("  ", {}, "warn", "the end-to-end command could not run: the declared command is empty"),
        (_one_liner('print(\'{"metric": "step_ms", "value": NaN}\')'), {}, "warn",
         'the end-to-end command could not run: run 1 with the kept kernel printed "value": nan, '
         "not a positive finite number"),
        (_one_liner('print(\'{"metric": "step_ms", "value": "fast"}\')'), {}, "warn",
         'the end-to-end command could not run: run 1 with the kept kernel printed "value": '
         '"fast", not a number'),
        (_one_liner("print('[12.5]')"), {}, "warn",
         "the end-to-end command could not run: run 1 with the kept kernel printed JSON that is "
         'not an object on its last stdout line: "[12.5]"'),
        (_one_liner("""
            import json, os
            print(json.dumps({"metric": os.environ["KERNEL_ROLE"] + "_ms", "value": 1.0}))
         """), {}, "warn",
         "the end-to-end command could not run: the metric changed between runs: 'baseline_ms' "
         "(lower is better) at first, then 'candidate_ms' (lower is better) with the candidate"),
        (_one_liner("import time; time.sleep(30)"), {"run_timeout_s": 0.5}, "warn",
         "the end-to-end command could not run: run 1 with the kept kernel ran past its timeout "
         "of 0.5 s and was killed"),
        # It ran with the kept kernel: the candidate is what breaks the user's program.
        (_one_liner("""
            import json, os, sys
            if os.environ["KERNEL_ROLE"] == "candidate":
                sys.exit("forward() got an unexpected keyword argument 'residual'")
            print(json.dumps({"metric": "step_ms", "value": 1.0}))
         """), {}, "fail",
         "the end-to-end command breaks with the candidate: run 1 with the candidate exited with "
         "status 1: forward() got an unexpected keyword argument 'residual'"),
    ],
    ids=["no-json", "exits-1", "not-found", "unsplittable", "empty", "nan", "not-a-number",
         "not-an-object", "metric-changes", "timeout", "breaks-with-the-candidate"],
)
def test_a_command_that_gives_no_usable_number_is_a_guard_that_says_why(command, options, status, detail):
    report, guard = _check(command, **options)
    assert (guard.name, guard.status, guard.detail) == ("e2e-command", status, detail)
    assert report == {"command": command, "error": detail}


def test_a_correct_candidate_passes_through_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm", str(CORRECT), "--json",
         "--ctx", "64", "--batch", "1", "--time-budget", "0.02",
         "--e2e-command", TIMING, "--e2e-command-budget", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["verdict"] != "rejected", result["guards"]
    guard = next(guard for guard in result["guards"] if guard["name"] == "e2e-command")
    assert guard["status"] == "pass"
    assert guard["detail"].startswith("no significant change: forward_ms ")
    # The built-in decode step's keys stay; the command's report sits next to them.
    assert BUILT_IN_E2E_KEYS <= set(result["e2e"])
    command = result["e2e"]["command"]
    assert command["command"] == TIMING and command["metric"] == "forward_ms"
    # The budget leaves room for the first round only.
    assert command["runs"] == 1 and len(command["baseline_values"]) == 1
    assert command["baseline"] > 0 and command["candidate"] > 0
    assert "end-to-end command, run 1 with the candidate: forward_ms = " in done.stderr


def test_a_candidate_slower_end_to_end_is_rejected_with_both_numbers(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text(CORRECT.read_text() + textwrap.dedent("""
        import time

        _correct = forward


        def forward(x, weight, eps):
            time.sleep(0.001)
            return _correct(x, weight, eps)
    """))
    result = evaluate("rmsnorm", slow, context_lengths=[64], batch_sizes=[1], time_budget_s=0.02,
                      limits=LIMITS, e2e_command=TIMING)
    assert result.correct is True and result.verdict == "rejected"
    guard = _guard(result)
    report = result.e2e["command"]
    assert guard.status == "fail" and report["worse"] is True and report["runs"] == 6
    assert report["candidate"] > 10 * report["baseline"]  # 20 sleeps of 1 ms in 20 calls
    assert guard.detail.startswith(
        f"significantly worse end to end: forward_ms {report['candidate']:.4g} with the candidate "
        f"vs {report['baseline']:.4g} with the kept kernel (+")
    assert "median of 6 runs each, lower is better" in guard.detail


def test_the_app_runs_the_command_declared_for_the_op(settings, tmp_path, monkeypatch):
    from config.env import env_toml_strings
    from research.evaluation import evaluate_source

    declared = tmp_path / "e2e_commands.toml"
    declared.write_text(f"rmsnorm = {json.dumps(_program(PROGRAMS / 'exits_1.py'))}\n")
    monkeypatch.setenv("E2E_COMMANDS_FILE", str(declared))
    settings.E2E_COMMANDS = env_toml_strings("E2E_COMMANDS_FILE")
    result = evaluate_source(op="rmsnorm", source=CORRECT.read_text(), device="cpu",
                             context_lengths=[64], batch_sizes=[1])
    # A command that cannot run is a warning for the reviewer, not a rejection.
    assert result["verdict"] != "rejected", result["guards"]
    guard = next(guard for guard in result["guards"] if guard["name"] == "e2e-command")
    assert guard["status"] == "warn"
    assert "run 1 with the kept kernel exited with status 1: loading the model..." in guard["detail"]
    assert result["e2e"]["command"] == {"command": _program(PROGRAMS / "exits_1.py"),
                                        "error": guard["detail"]}


def test_a_declared_command_that_is_not_a_string_is_refused_at_startup(tmp_path, monkeypatch):
    from config.env import env_toml_strings

    declared = tmp_path / "e2e_commands.toml"
    declared.write_text('rmsnorm = ["python3", "bench.py"]\n')
    monkeypatch.setenv("E2E_COMMANDS_FILE", str(declared))
    with pytest.raises(ValueError, match="rmsnorm must be a string, not list"):
        env_toml_strings("E2E_COMMANDS_FILE")
