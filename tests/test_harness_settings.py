"""What a candidate may not change: the configuration watch (read before the import and
after calls), the source check against the kept kernel, and the plausibility flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runners.harness import Limits, evaluate, protected
from runners.harness.configuration import ConfigurationWatch
from runners.ops import get_op, list_ops

LIMITS = Limits(import_s=5, call_s=5, memory_bytes=512 * 2**20)
RMSNORM = '''
import torch


def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
'''


@pytest.fixture
def restored():
    """Whatever a test changes in this process's configuration is put back after it."""
    saved = (dict(os.environ), torch.backends.cuda.matmul.allow_tf32, torch.get_num_threads(),
             dict(type(get_op("rmsnorm")).tolerances))
    yield
    environ, tf32, threads, tolerances = saved
    os.environ.clear()
    os.environ.update(environ)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_num_threads(threads)
    type(get_op("rmsnorm")).tolerances.clear()
    type(get_op("rmsnorm")).tolerances.update(tolerances)


def test_an_untouched_configuration_reads_the_same_twice(restored):
    watch = ConfigurationWatch(get_op("rmsnorm"), "cpu")
    assert watch.changes() == []
    assert len(watch.before) > 30


def test_each_kind_of_change_is_named_with_its_before_and_after(restored):
    watch = ConfigurationWatch(get_op("rmsnorm"), "cpu")
    os.environ["NCCL_P2P_DISABLE"] = "1"
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(torch.get_num_threads() + 1)
    type(get_op("rmsnorm")).tolerances[torch.float32] = (1e-1, 1e-1)
    changes = "\n".join(watch.changes())
    assert "env NCCL_P2P_DISABLE: unset → 1" in changes
    assert "torch.backends.cuda.matmul.allow_tf32: " in changes
    assert "torch.get_num_threads: " in changes
    # A long value is cut around its first difference, so the change itself shows.
    assert "rmsnorm tolerances: …" in changes and "(0.1, 0.1)" in changes


def test_a_removed_variable_and_a_mutated_constant_are_changes(restored):
    watch = ConfigurationWatch(get_op("rmsnorm"), "cpu")
    import runners.ops.rmsnorm as rmsnorm_module

    os.environ.pop("PATH", None)
    hidden = dict(rmsnorm_module.HIDDEN)
    rmsnorm_module.HIDDEN["cpu"] = 8
    try:
        changes = "\n".join(watch.changes())
    finally:
        rmsnorm_module.HIDDEN.update(hidden)
    assert "env PATH: " in changes and "→ unset" in changes
    assert "runners.ops.rmsnorm constants: " in changes
    assert "rmsnorm workloads: " in changes


@pytest.mark.parametrize(("line", "what"), [
    ("torch.backends.cudnn.benchmark = True", "changes a torch backend flag"),
    ('os.environ["TORCHINDUCTOR_CUDAGRAPHS"] = "0"', "changes a CUDA-graph setting"),
    ('os.environ.setdefault("NCCL_ALGO", "ring")', "changes an all-reduce setting"),
    ('os.environ["OMP_NUM_THREADS"] = "64"', "changes the environment"),
    ("get_op('rmsnorm').tolerances[torch.float32] = (1e-2, 1e-2)", "changes a tolerance"),
    ("type(get_op('rmsnorm')).default_batch_sizes = lambda self, d: [1]", "changes the batch sizes"),
    ("type(get_op('rmsnorm')).max_context = 1024", "changes the workloads or context lengths"),
    ("setattr(rmsnorm_module, 'EPS', 1.0)", "changes the harness's own state"),
    ("torch.set_flush_denormal(True)", "changes a torch backend flag"),
])
def test_the_source_check_names_the_line_and_what_it_changes(line, what):
    source = ("import os\nimport torch\nfrom runners.ops import get_op\n"
              "import runners.ops.rmsnorm as rmsnorm_module\n"
              f"if os.environ.get('NEVER_SET'):\n    {line}\n" + RMSNORM)
    found = [str(finding) for finding in protected.findings(source)]
    assert f"line 6 {what}: `{line}`" in found, found


def test_the_source_check_leaves_the_candidates_own_names_alone():
    source = "import torch\natol = 1e-2\nclass Config:\n    batch_sizes = [1]\n" + RMSNORM.replace(
        "    hidden = x.float()", "    config = Config()\n    config.context_lengths = [4]\n    hidden = x.float()")
    assert protected.findings(source) == []
    assert protected.check(source, None)[0] == "pass"


def test_only_what_the_candidate_adds_to_the_kept_kernel_counts():
    kept = "import torch\ntorch.backends.cudnn.benchmark = True\n" + RMSNORM
    candidate = kept + "\ntorch.backends.cuda.matmul.allow_tf32 = True\n"
    status, detail = protected.check(candidate, kept)
    assert status == "fail"
    assert "allow_tf32" in detail and "cudnn.benchmark" not in detail
    assert protected.check(kept, kept)[0] == "pass"


def test_a_setting_on_a_branch_never_taken_is_still_rejected(tmp_path):
    candidate = tmp_path / "candidate.py"
    candidate.write_text("import os\nimport torch\n"
                         "if os.environ.get('NEVER_SET'):\n"
                         "    torch.backends.cuda.matmul.allow_tf32 = True\n" + RMSNORM)
    result = evaluate("rmsnorm", candidate, context_lengths=[64], time_budget_s=0.05, limits=LIMITS)
    guards = {guard.name: guard for guard in result.guards}
    # It is in the diff: rejected by its source, before any process ran it...
    assert result.verdict == "rejected" and result.stopped_at == "static"
    assert guards["protected-settings"].status == "fail"
    assert "line 4 changes a torch backend flag" in guards["protected-settings"].detail
    assert "config" not in guards
    # ... and run past that stage, the line never runs: only the diff could see it.
    result = evaluate("rmsnorm", candidate, context_lengths=[64], time_budget_s=0.05, limits=LIMITS,
                      stop_at_static=False)
    guards = {guard.name: guard for guard in result.guards}
    assert result.verdict == "rejected"
    assert guards["config"].status == "pass"
    assert guards["protected-settings"].status == "fail"


def test_a_tenfold_win_is_flagged_for_scrutiny(tmp_path):
    slow_kept = tmp_path / "kept.py"
    slow_kept.write_text("import time\n" + RMSNORM.replace(
        "    hidden = x.float()", "    time.sleep(0.02)\n    hidden = x.float()"))
    fast = tmp_path / "candidate.py"
    fast.write_text(RMSNORM)
    result = evaluate("rmsnorm", fast, baseline=slow_kept, context_lengths=[64],
                      time_budget_s=0.3, limits=LIMITS)
    plausibility = next(guard for guard in result.guards if guard.name == "plausibility")
    assert plausibility.status == "warn", result.guards
    assert plausibility.detail.startswith("needs scrutiny: more than 10x faster than the baseline")
    assert result.verdict == "win"  # a flag for the reviewer, not a rejection


def test_the_baseline_against_itself_passes_every_settings_guard():
    result = evaluate("rmsnorm", "baseline", context_lengths=[64], time_budget_s=0.05, limits=LIMITS)
    guards = {guard.name: guard.status for guard in result.guards}
    assert guards["config"] == guards["protected-settings"] == guards["plausibility"] == "pass"


def test_the_shipped_kernels_change_nothing_protected():
    for name in list_ops():
        op = get_op(name)
        kept = op.baseline_path.read_text()
        for path in op.kernels().values():
            assert protected.check(path.read_text(), kept)[0] == "pass", path


# -- a source that declares another encoding than the UTF-8 every check reads ------------

UTF7_CANDIDATE = Path(__file__).parent / "candidates" / "rmsnorm_hides_code_in_utf7.py"


def test_outside_the_harness_a_utf7_declaration_runs_a_line_every_check_reads_as_a_comment():
    text = UTF7_CANDIDATE.read_text(encoding="utf-8")
    # Read as UTF-8, as the checks and a reviewer read it: no import of the harness.
    assert "import runners.harness" not in text
    assert all(finding.what != "imports the harness" for finding in protected.findings(text))
    # Imported as Python imports it: the hidden line ran.
    done = subprocess.run(
        [sys.executable, "-c",
         "import importlib.util, sys\n"
         f"spec = importlib.util.spec_from_file_location('candidate', {str(UTF7_CANDIDATE)!r})\n"
         "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
         "print(module._harness.__name__)"],
        capture_output=True, text=True, timeout=120, check=True, cwd=Path(__file__).parents[1])
    assert done.stdout.strip() == "runners.harness.timing"


def test_a_utf7_declaration_is_rejected_by_its_source_and_never_loaded():
    result = evaluate("rmsnorm", UTF7_CANDIDATE, context_lengths=[64], time_budget_s=0.05, limits=LIMITS)
    guards = {guard.name: guard for guard in result.guards}
    assert result.verdict == "rejected" and result.stopped_at == "static"
    assert guards["protected-settings"].status == "fail"
    assert "line 1 declares an encoding other than UTF-8" in guards["protected-settings"].detail
    assert "`# coding: utf-7`" in guards["protected-settings"].detail
    # Run past the static stage, the child refuses to import it.
    result = evaluate("rmsnorm", UTF7_CANDIDATE, context_lengths=[64], time_budget_s=0.05, limits=LIMITS,
                      stop_at_static=False)
    failed = {guard.name: guard.detail for guard in result.guards if guard.status == "fail"}
    assert result.verdict == "rejected"
    assert "declares an encoding other than UTF-8 (line 1: # coding: utf-7)" in failed["loads"]


def test_a_shared_file_that_declares_utf7_is_rejected_naming_it(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    # The shared file is the attack, the candidate that imports it plain.
    (lib / "rows.py").write_bytes(UTF7_CANDIDATE.read_bytes())
    candidate = tmp_path / "candidate.py"
    candidate.write_text("from runners.kernel_lib.rows import forward as _rows\n\n\n"
                         "def forward(x, weight, eps):\n    return _rows(x, weight, eps)\n")
    result = evaluate("rmsnorm", candidate, context_lengths=[64], time_budget_s=0.05, limits=LIMITS, lib=lib)
    failed = {guard.name: guard.detail for guard in result.guards if guard.status == "fail"}
    assert result.verdict == "rejected" and result.stopped_at == "static"
    assert "rows.py" in failed["protected-settings"]
    assert "declares an encoding other than UTF-8" in failed["protected-settings"]


@pytest.mark.parametrize("first_lines", ["# coding: utf-8\n", "# -*- coding: UTF8 -*-\n", "#!/usr/bin/env python\n",
                                         "#!/usr/bin/env python\n# vim: set fileencoding=ascii :\n"])
def test_utf8_and_ascii_declarations_are_not_findings(first_lines):
    assert protected.findings(first_lines + RMSNORM) == []
