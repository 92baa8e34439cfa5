"""Kernels that import shared code (runners.kernel_lib): the harness evaluates a candidate
with exactly the lib files it imports, read once, checked like the candidate and hashed
(runners/harness/imports.py). Each attack is first shown to do its harm outside the
harness, in a plain Python process, then rejected inside it for its reason.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runners.harness import Limits, evaluate, imports

ROOT = Path(__file__).resolve().parent.parent
LIMITS = Limits(import_s=20, call_s=20, memory_bytes=1024 * 2**20)

HONEST_LIB = '''
"""RMSNorm's arithmetic, shared."""
import torch


def rms_normalize(x, weight, eps):
    hidden = x.float()
    return (hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
'''

# Outside the harness, importing it turns TF32 on for every matmul that follows.
SETTINGS_LIB = HONEST_LIB + '''
torch.backends.cuda.matmul.allow_tf32 = True
'''

# The swap a racing writer makes after the judge hashed the file: right shape, wrong values.
SWAPPED_LIB = '''
import torch


def rms_normalize(x, weight, eps):
    return torch.zeros_like(x)
'''

CANDIDATE = '''
from runners.kernel_lib.norms import rms_normalize


def forward(x, weight, eps):
    return rms_normalize(x, weight, eps)
'''

DYNAMIC_CANDIDATE = '''
import importlib

_lib = importlib.import_module("runners.kernel_" + "lib.norms")


def forward(x, weight, eps):
    return _lib.rms_normalize(x, weight, eps)
'''


def _lib(folder: Path, **modules: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in modules.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    return folder


def _candidate(folder: Path, text: str = CANDIDATE) -> Path:
    path = folder / "candidate.py"
    path.write_text(text)
    return path


def _outside(lib: Path, candidate: Path, body: str) -> str:
    """Runs `body` in a plain Python process where runners.kernel_lib is `lib` (as a
    GPU host that imports the kernel directly has it); returns its stdout."""
    program = textwrap.dedent(f"""
        import importlib.util, sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from runners.harness import imports
        imports.install(Path({str(lib)!r}))
        spec = importlib.util.spec_from_file_location("candidate", {str(candidate)!r})
        candidate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(candidate)
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=True)
    return done.stdout


def _evaluate(candidate: Path, lib: Path, **extra):
    return evaluate("rmsnorm", candidate, context_lengths=[64], time_budget_s=0.2,
                    limits=LIMITS, seed=20261205, lib=lib, **extra)


def _failing(result) -> dict[str, str]:
    return {guard.name: guard.detail for guard in result.guards if guard.status == "fail"}


# -- reading the imports ---------------------------------------------------------------

def test_imports_are_followed_through_the_lib_and_only_its_files_listed(tmp_path):
    lib = _lib(tmp_path / "lib", norms="from runners.kernel_lib import scales\nfrom . import rows\n",
               scales="X = 1\n", rows="from .scales import X\n", unused="Y = 2\n")
    (lib / "__init__.py").write_text('"""shared"""\n')
    source = "import torch\nfrom runners.kernel_lib.norms import *\ndef forward(x): return x\n"
    files = imports.resolve(source, "candidate.py", lib)
    assert [file.path for file in files] == ["__init__.py", "norms.py", "scales.py", "rows.py"]
    norms = files[1]
    assert norms.sha256 == hashlib.sha256((lib / "norms.py").read_bytes()).hexdigest()
    assert imports.resolve("import torch\ndef forward(x): return x\n", "candidate.py", lib) == []


def test_the_shipped_kernels_import_only_files_of_the_shipped_lib():
    from runners.ops import get_op, list_ops

    imported = set()
    for name in list_ops():
        for path in get_op(name).kernels().values():
            for file in imports.resolve(path.read_text(), path.name):
                assert (imports.SHIPPED_LIB / file.path).read_bytes() == file.data
                imported.add(file.path)
    assert imported, "no shipped kernel imports shared code"


@pytest.mark.parametrize("source, fragment", [
    ("from runners.kernel_lib.nowhere import f\n", "not a module of the shared code"),
    ("import runners.kernel_lib.norms.deeper\n", "not a module of the shared code"),
    ("import importlib\nm = importlib.import_module('runners.' + name)\n", "computed at run time"),
    ("from importlib import import_module as im\nm = im(f'{a}.b')\n", "computed at run time"),
    ("m = __import__(name)\n", "computed at run time"),
    ("import importlib\nm = importlib.import_module('runners.kernel_lib.norms')\n",
     "import shared code with an import statement"),
])
def test_imports_the_judge_cannot_read_are_refused(tmp_path, source, fragment):
    lib = _lib(tmp_path / "lib", norms=HONEST_LIB)
    with pytest.raises(imports.ImportRefused, match=fragment):
        imports.resolve(source, "candidate.py", lib)


def test_a_lib_file_that_builds_an_import_is_refused_naming_it(tmp_path):
    lib = _lib(tmp_path / "lib", norms="import importlib\nm = importlib.import_module(name)\n")
    with pytest.raises(imports.ImportRefused, match=r"runners/kernel_lib/norms\.py line 2"):
        imports.resolve(CANDIDATE, "candidate.py", lib)


def test_lib_files_are_checked_like_the_candidate_naming_the_file(tmp_path):
    lib = _lib(tmp_path / "lib", norms=SETTINGS_LIB, launch="import cutlass.cute as cute\n")
    files = imports.resolve("from runners.kernel_lib import norms, launch\n", "candidate.py", lib)
    wrong_dsl, settings = imports.check(files, "triton")
    assert wrong_dsl[0] == "fail" and "runners/kernel_lib/launch.py imports cutlass.cute" in wrong_dsl[1]
    assert settings[0] == "fail" and "runners/kernel_lib/norms.py" in settings[1]
    assert "torch backend flag" in settings[1]
    # The kept kernel's same file already made that change, which a reviewer accepted.
    assert imports.check(files, "triton", kept=files)[1] is None
    assert imports.check(files, "torch") == (None, settings)


# -- attacks, outside the harness and in it -----------------------------------------------

def test_an_honest_candidate_runs_with_its_lib_and_the_result_names_each_file(tmp_path):
    lib = _lib(tmp_path / "lib", norms=HONEST_LIB)
    result = _evaluate(_candidate(tmp_path), lib)
    assert result.verdict != "rejected", result.guards
    digest = hashlib.sha256((lib / "norms.py").read_bytes()).hexdigest()
    assert result.lib_files == [{"path": "norms.py", "sha256": digest}]
    shown = {guard.name: guard.detail for guard in result.guards}["imports"]
    assert "runners/kernel_lib/norms.py" in shown and digest[:12] in shown


def test_a_lib_file_that_changes_a_protected_setting_rejects_its_candidate(tmp_path):
    lib = _lib(tmp_path / "lib", norms=SETTINGS_LIB)
    candidate = _candidate(tmp_path)
    outside = _outside(lib, candidate, "import torch; print(torch.backends.cuda.matmul.allow_tf32)")
    assert outside.strip() == "True"
    failing = _failing(_evaluate(candidate, lib))
    assert "runners/kernel_lib/norms.py" in failing.get("protected-settings", ""), failing
    assert "allow_tf32" in failing["protected-settings"]


def test_a_lib_path_that_leads_out_of_the_lib_folder_is_refused(tmp_path):
    elsewhere = _lib(tmp_path / "elsewhere", norms=SWAPPED_LIB)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "norms.py").symlink_to(elsewhere / "norms.py")
    candidate = _candidate(tmp_path)
    outside = _outside(lib, candidate, """
        import torch
        x = torch.randn(4, 8)
        print(bool(candidate.forward(x, torch.ones(8), 1e-6).eq(0).all()))
    """)
    assert outside.strip() == "True"  # outside, it ran the file the link leads to
    result = _evaluate(candidate, lib)
    assert result.verdict == "rejected"
    assert "leads out of the lib folder" in _failing(result).get("imports", ""), result.guards


def test_an_import_built_at_run_time_is_refused(tmp_path):
    lib = _lib(tmp_path / "lib", norms=HONEST_LIB)
    candidate = _candidate(tmp_path, DYNAMIC_CANDIDATE)
    outside = _outside(lib, candidate, "print(candidate._lib.__file__)")
    assert outside.strip() == str(lib / "norms.py")  # outside, it imports a file nobody read
    result = _evaluate(candidate, lib)
    assert result.verdict == "rejected"
    assert "computed at run time" in _failing(result).get("imports", ""), result.guards


def test_a_lib_file_swapped_after_it_was_hashed_never_runs(tmp_path):
    lib = _lib(tmp_path / "lib", norms=HONEST_LIB)
    candidate = _candidate(tmp_path)
    digest = hashlib.sha256((lib / "norms.py").read_bytes()).hexdigest()
    swapped = []

    def swap_once_read(message: str) -> None:
        # The judge says this once it has read and hashed the files, before any process
        # of the candidate starts: the worst moment for a writer to change one.
        if not swapped:
            (lib / "norms.py").write_text(SWAPPED_LIB)
            swapped.append(message)

    result = _evaluate(candidate, lib, progress=swap_once_read)
    assert swapped
    outside = _outside(lib, candidate, """
        import torch
        print(bool(candidate.forward(torch.randn(4, 8), torch.ones(8), 1e-6).eq(0).all()))
    """)
    assert outside.strip() == "True"  # the swapped file, imported directly, is wrong
    assert result.lib_files == [{"path": "norms.py", "sha256": digest}]
    assert result.correct and result.verdict != "rejected", result.guards


def test_the_child_cannot_read_the_projects_own_lib(tmp_path):
    # The copy the judge served is the child's only route to shared code.
    lib = _lib(tmp_path / "lib", norms=HONEST_LIB)
    shipped = imports.SHIPPED_LIB / "__init__.py"
    assert shipped.is_file()
    probe = CANDIDATE + textwrap.dedent(f"""
        import os
        if os.path.exists({str(shipped)!r}):
            raise RuntimeError("the project's runners/kernel_lib is visible")
    """)
    result = _evaluate(_candidate(tmp_path, probe), lib)
    assert result.verdict != "rejected", result.guards
    assert os.path.exists(shipped)


# -- the results file: what a sweep's candidates ran with ----------------------------------

@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> list[dict]:
    """One real sweep line of a shipped kernel (it imports no shared code)."""
    import json

    from runners.harness.sweep import sweep

    out = tmp_path_factory.mktemp("swept") / "results.jsonl"
    sweep("rmsnorm", "blocked", strategy="grid", budget=1, device="cpu", context_lengths=[64],
          batch_sizes=[1], time_budget_s=0.05, out=out)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _read(lines: list[dict]):
    import json

    from runners.harness import results_file

    return results_file.read("\n".join(json.dumps(line) for line in lines).encode())


def test_a_results_file_holds_each_lib_file_and_every_result_names_only_those(swept):
    import copy

    from runners.harness.results_file import ResultsFileError

    header, line = swept
    assert header["lib_files"] == [] and line["result"]["lib_files"] == []
    norms = textwrap.dedent(HONEST_LIB)
    held = {"path": "norms.py", "sha256": hashlib.sha256(norms.encode()).hexdigest(), "source": norms}
    good = copy.deepcopy(swept)
    good[0]["lib_files"] = [held]
    good[1]["result"]["lib_files"] = [{"path": "norms.py", "sha256": held["sha256"]}]
    assert _read(good).header["lib_files"] == [held]

    swapped = copy.deepcopy(good)
    swapped[0]["lib_files"][0]["source"] = textwrap.dedent(SWAPPED_LIB)
    with pytest.raises(ResultsFileError, match="norms.py: its sha256 is not that of its source"):
        _read(swapped)
    unheld = copy.deepcopy(good)
    unheld[1]["result"]["lib_files"] = [{"path": "other.py", "sha256": held["sha256"]}]
    with pytest.raises(ResultsFileError, match="ran lib file 'other.py'"):
        _read(unheld)
    outside = copy.deepcopy(good)
    outside[0]["lib_files"][0]["path"] = "../norms.py"
    with pytest.raises(ResultsFileError, match="a relative path of a .py file"):
        _read(outside)


def test_a_compound_stage_kernel_that_imports_shared_code_runs_with_the_served_copy(tmp_path):
    # The jail hides the project's runners/kernel_lib: without the served copy this
    # stage could not even load.
    import json

    from tests.test_compound import _stages_file

    loop = "dsa_indexer_topk_paged"
    kernel = tmp_path / "shared_rmsnorm.py"
    kernel.write_text(textwrap.dedent('''
        import runners.kernel_lib as shared
        import torch

        assert shared.__doc__, "the served package, docstring and all"


        def forward(x, weight, eps):
            hidden = x.float()
            return (hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + eps)
                    * weight.float()).to(x.dtype)
    '''))
    baselines = {"rmsnorm": ROOT / "runners/ops/rmsnorm/baseline.py",
                 loop: ROOT / f"runners/ops/{loop}/baseline.py"}
    stages = _stages_file(tmp_path, loop, [("shipped baselines", baselines),
                                           ("shared rmsnorm", {**baselines, "rmsnorm": kernel})])
    done = subprocess.run([sys.executable, "-m", "runners.harness", "compound", str(stages), "--json",
                           "--seed", "7", "--time-budget", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [stage["label"] for stage in json.loads(done.stdout)["stages"]] == ["shipped baselines", "shared rmsnorm"]


def test_a_lib_folder_that_is_not_there_is_a_usage_error(tmp_path):
    from runners.harness.evaluate import UsageError

    with pytest.raises(UsageError, match="no lib folder at"):
        _evaluate(_candidate(tmp_path), tmp_path / "missing")


def test_a_shipped_triton_kernel_runs_in_the_jail_with_its_served_shared_code():
    # Triton reads a jit function's source where it is defined: in the child that is the
    # served copy, the only one the jail shows.
    from runners.ops import get_op

    kernel = get_op("dsa_indexer_topk").kernels()["partial_topk_triton"]
    shared = imports.resolve(kernel.read_text(), kernel.name)
    assert [file.path for file in shared] == ["__init__.py", "topk_triton.py"]
    result = evaluate("dsa_indexer_topk", kernel, dsl="triton", context_lengths=[2048], batch_sizes=[1],
                      time_budget_s=0.05, limits=Limits(import_s=60, call_s=60), seed=20261205)
    assert result.correct is True, result.guards
    assert result.lib_files == [file.provenance() for file in shared]
    assert {guard.name: guard.status for guard in result.guards}["imports"] == "pass"
