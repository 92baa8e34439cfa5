"""The shipped CuTe DSL kernels: every SPACE point compiles for Hopper, here on the CPU.

CuTe DSL compiles without a GPU (CUTE_DSL_ARCH=sm_90a) but cannot launch without one.
So on a machine with no GPU, every point is compiled and its PTX checked, and the
launch is shown to fail for the one expected reason: no CUDA driver or device. On a
machine with a GPU the same test launches every point and checks its output.

Each kernel's work runs in one child process with the environment a candidate's child
gets (`child_environment("cute", ...)`): CuTe DSL reads its target when first imported.
Two kernels ship: rmsnorm's rows_cute and the indexer's logits_topk_cute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runners.harness.dsl import child_environment, kernel_dsl, launch_counter, static_check
from runners.ops import get_op, list_ops
from runners.space import grid_points, read_literals

import cutlass.cute  # noqa: F401,E402 — a dependency: its absence must fail, not skip

ROOT = Path(__file__).resolve().parents[1]
KERNEL = get_op("rmsnorm").kernels()["rows_cute"]
ON_GPU = torch.cuda.is_available()
# What a launch without a GPU fails with: no driver at all, or a driver and no device.
NO_GPU_ERRORS = ("cudaErrorInsufficientDriver", "cudaErrorNoDevice")

CHILD = textwrap.dedent("""
    import importlib.util, json, re, sys
    from pathlib import Path

    import torch

    from runners.harness.dsl import launch_counter
    from runners.ops import get_op
    from runners.space import grid_points, materialize, read_literals
    from tests.kernel_checks import check_failures

    path, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    source, op, on_gpu = path.read_text(), get_op("rmsnorm"), torch.cuda.is_available()

    def load(text, name):
        candidate = scratch / f"{name}.py"
        candidate.write_text(text)
        spec = importlib.util.spec_from_file_location(name, candidate)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def failures(module):
        return check_failures(op, module.forward, op.workloads("cuda", [37, 1000], [1]), (11, 12))

    points = {}
    for index, point in enumerate(grid_points(read_literals(source)[1])):
        module = load(materialize(source, point), f"point{index}")
        compiled = {}
        for dtype in (torch.float32, torch.bfloat16):
            vec = module._vector(1024)
            ptx = module.compiled(dtype, 37, 1024, point["threads"], vec).artifacts.PTX
            compiled[str(dtype)] = {"targets": re.findall(r"[.]target (\\S+)", ptx),
                                    "wide_loads": ptx.count("ld.global.v4")}
        key = ",".join(f"{name}={value}" for name, value in point.items())
        points[key] = {"compiled": compiled, "failures": failures(module) if on_gpu else None}

    module = load(source, "launched")
    device = "cuda" if on_gpu else "cpu"
    x = torch.randn(37, 1024, device=device)
    with launch_counter("cute") as launches:
        try:
            module.forward(x, torch.ones(1024, device=device), 1e-6)
            error = None
        except Exception as failure:
            error = {"type": type(failure).__name__, "message": str(failure)}
    launch = {"count": launches.count, "compiles": launches.compiles, "error": error}
    print(json.dumps({"points": points, "launch": launch}))
""")


def _run_child(script, kernel, scratch, timeout, *args):
    env = {
        **os.environ,
        **child_environment("cute", "cuda" if ON_GPU else "cpu", scratch),
        # Keep each compile's PTX (written under CUTE_DSL_DUMP_DIR) to read its target.
        "CUTE_DSL_KEEP": "ptx",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", script, str(kernel), str(scratch), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    return _run_child(CHILD, KERNEL, tmp_path_factory.mktemp("cute-points"), 240)


# A GPU host short of time may check each paged kernel's shipped point (PARAMS) alone:
# CUTE_TEST_POINTS=shipped (bench/h200/paged_indexer.py --shipped-point).
SHIPPED_POINT_ONLY = os.environ.get("CUTE_TEST_POINTS") == "shipped"


def _labels(kernel=KERNEL, shipped_only=False):
    params, space = read_literals(kernel.read_text())
    for point in ([params] if shipped_only else grid_points(space)):
        yield ",".join(f"{key}={value}" for key, value in point.items())


@pytest.mark.parametrize("label", list(_labels()))
def test_every_space_point_compiles_for_the_target_and_is_correct_where_it_can_run(child, label):
    point = child["points"][label]
    for dtype, compiled in point["compiled"].items():
        if not ON_GPU:
            assert compiled["targets"] == ["sm_90a"], dtype
        # Wider vectors must really become 128-bit loads, not be scalarised.
        vec = int(label.split("vec=")[1])
        assert compiled["wide_loads"] > 0 or vec * (4 if "float32" in dtype else 2) < 16, dtype
    if ON_GPU:
        assert point["failures"] == []


def _assert_failed_for_want_of_a_gpu(launch: dict) -> None:
    assert launch["error"]["type"] == "DSLCudaRuntimeError"
    assert any(name in launch["error"]["message"] for name in NO_GPU_ERRORS), launch["error"]


@pytest.mark.skipif(ON_GPU, reason="a GPU is present: the launch runs")
def test_without_a_gpu_the_launch_fails_for_want_of_one_and_counts_no_launch(child):
    launch = child["launch"]
    _assert_failed_for_want_of_a_gpu(launch)
    assert (launch["compiles"], launch["count"]) == (1, 0)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to launch")
def test_on_a_gpu_forward_compiles_once_and_launches_once(child):
    assert child["launch"] == {"count": 1, "compiles": 1, "error": None}


def test_the_static_check_finds_the_launched_cute_kernel():
    status, detail = static_check(KERNEL.read_text(), "cute")
    assert (status, detail) == ("pass", "forward launches @cute.kernel _rmsnorm_row (forward → compiled → _launch)")


# --- the indexer: logits_topk_cute ----------------------------------------------------

INDEXER = get_op("dsa_indexer_topk").kernels()["logits_topk_cute"]

# What both indexer kernels' children share: the op, its workloads, loading a point,
# and the facts read from a kernel's PTX.
INDEXER_COMMON = textwrap.dedent("""
    import dataclasses, importlib.util, json, os, re, sys
    from pathlib import Path

    import torch

    from runners.harness.dsl import launch_counter, torch_compute
    from runners.kernel_lib.indexer_select import BITMAP_TOKENS
    from runners.ops import get_op
    from runners.space import grid_points, materialize, read_literals
    from tests.kernel_checks import DISTRIBUTIONS, check_failures

    path, scratch, op_name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    source, op, on_gpu = path.read_text(), get_op(op_name), torch.cuda.is_available()
    # The model's heads and head size; 3 query rows leave a partial group of rows, 5000
    # tokens a partial key tile and uneven spans per CTA.
    workloads = op.workloads("cuda", [2048, 5000], [3, 64])

    def load(text, name):
        candidate = scratch / f"{name}.py"
        candidate.write_text(text)
        spec = importlib.util.spec_from_file_location(name, candidate)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def ptx_facts(kernel):
        ptx = kernel.artifacts.PTX
        return {
            "targets": re.findall(r"[.]target (\\S+)", ptx),
            # shape.A type.B type of every warpgroup MMA, accumulating in float32
            "wgmma": sorted({".".join(found) for found in re.findall(
                r"wgmma[.]mma_async[.]sync[.]aligned[.](m\\d+n\\d+k\\d+)[.]f32[.](\\w+)[.](\\w+)", ptx)}),
            "tma_loads": ptx.count("cp.async.bulk.tensor"),
            "smem_atomics": ptx.count("atom.shared.add"),
            # bits set in a bitmap of the chosen tokens
            "smem_or_atomics": ptx.count("atom.shared.or"),
            "ballots": ptx.count("vote.sync.ballot"),
            "wide_loads": ptx.count("ld.global.v4"),
            # pingpong's hand-over of the MMA issue between warpgroups
            "named_arrives": len(re.findall(r"\\bbar[.]arrive", ptx)),
            "threads": re.findall(r"[.]reqntid (\\d+)", ptx),
        }

    def out_of_order(module):
        # Up to BITMAP_TOKENS the select marks the chosen in a bitmap and writes them in
        # token order; past it, it lists them and sorts the list. Both must be right, and
        # ascending. (3 query rows: the long context's reference logits stay small.)
        wrong = []
        for context in (5000, BITMAP_TOKENS + 5000):
            inputs = op.make_inputs(op.build_workloads("cuda", [context], [3])[0], 15, "normal")
            got = module.forward(*inputs.values())
            correct, detail = op.check(got, op.reference(inputs), inputs)
            if not correct:
                wrong.append(f"{context}: {detail}")
            if not torch.equal(got, got.sort(dim=1).values):
                wrong.append(f"{context}: not in token order")
        return wrong

    def launched(module, *calls):
        # forward on each argument list in turn (one call unless more are given),
        # counting the compiles and launches of them all; the last error.
        calls = calls if isinstance(calls[0], list) else [calls]
        error = None
        with launch_counter("cute") as launches:
            for args in calls:
                try:
                    module.forward(*args)
                except Exception as failure:
                    error = {"type": type(failure).__name__, "message": str(failure)}
        return {"count": launches.count, "compiles": launches.compiles, "error": error,
                "torch_compute": dict(torch_compute(launches.torch_ops))}
""")

INDEXER_CHILD = INDEXER_COMMON + textwrap.dedent("""
    def float32_failures(module):
        # float32 inputs take their own path and the tight float32 tolerance.
        found = []
        for workload in workloads:
            for distribution in DISTRIBUTIONS:
                inputs = {name: value.float() if torch.is_tensor(value) else value
                          for name, value in op.make_inputs(workload, 13, distribution).items()}
                correct, detail = op.check(module.forward(*inputs.values()), op.reference(inputs), inputs)
                if not correct:
                    found.append(f"{workload.name} float32 {distribution}: {detail}")
        return found

    def repeats_differ(module):
        inputs = op.make_inputs(workloads[-1], 14, "uniform_outliers")
        return not torch.equal(module.forward(*inputs.values()), module.forward(*inputs.values()))

    def equal_scores_wrong(module):
        # Zero keys make every score 0.0: all tie, and the lowest indices must win. At
        # 5000 tokens the tied bin fits in shared memory; at 20000 it does not, and the
        # select takes its passes over the row instead.
        wrong = []
        for context in (5000, 20000):
            q = torch.randn(64, 64, 128, device="cuda").bfloat16()
            k = torch.zeros(context, 128, device="cuda").bfloat16()
            got = module.forward(q, k, torch.rand(64, 64, device="cuda"), 2048)
            if not torch.equal(got, torch.arange(2048, device="cuda").expand(64, -1)):
                wrong.append(context)
        return wrong

    def duplicate_keys_wrong(module):
        # Every key four times: the top-k-th score is most often one of four equal ones,
        # of which only some fit, and the lowest-indexed copies must be the ones taken.
        distinct = 1250
        q = torch.randn(64, 64, 128, device="cuda").bfloat16()
        k = torch.randn(distinct, 128, device="cuda").bfloat16().repeat(4, 1)
        inputs = {"q": q, "k": k, "weights": torch.rand(64, 64, device="cuda"), "topk": 2048}
        got = module.forward(*inputs.values())
        correct, detail = op.check(got, op.reference(inputs), inputs)
        wrong = [] if correct else [detail]
        chosen = torch.zeros(64, 4 * distinct, dtype=torch.bool, device="cuda").scatter_(1, got, True)
        # A copy taken whose lower-indexed twin was not.
        skipped = chosen[:, distinct:] & ~chosen[:, :-distinct]
        if bool(skipped.any()):
            wrong.append(f"{int(skipped.sum())} copies taken over a lower-indexed equal key")
        return wrong

    points = {}
    for index, point in enumerate(grid_points(read_literals(source)[1])):
        module = load(materialize(source, point), f"point{index}")
        scores = module.compiled_scores_mma(
            torch.bfloat16, 64, 128, module.mma_rows(point["ROWS"], 64, point["SCHEDULE"]),
            point["STAGES"], torch.float32, point["SCHEDULE"], point["REDUCE"])
        select = module.compiled_select(2048, point["SELECT_THREADS"], *module.select_bucket(5000))
        key = ",".join(f"{name}={value}" for name, value in point.items())
        points[key] = {"scores": ptx_facts(scores), "select": ptx_facts(select),
                       "failures": check_failures(op, module.forward, workloads, (11, 12)) if on_gpu else None}

    module = load(source, "shipped")
    simt = ptx_facts(module.compiled_scores_simt(64, 128))
    gpu = ({"float32_failures": float32_failures(module), "repeats_differ": repeats_differ(module),
            "equal_scores_wrong": equal_scores_wrong(module),
            "duplicate_keys_wrong": duplicate_keys_wrong(module), "out_of_order": out_of_order(module)}
           if on_gpu else None)

    device = "cuda" if on_gpu else "cpu"
    launch = launched(load(source, "launched"), torch.randn(3, 64, 128, device=device).bfloat16(),
                      torch.randn(5000, 128, device=device).bfloat16(), torch.randn(3, 64, device=device), 2048)
    # Two context lengths (and so two split counts) of one select bucket at two batches of
    # query rows, as a serving engine's steps bring them, in a fresh module.
    lengths = launched(load(source, "lengths"), *[
        [torch.randn(rows_m, 64, 128, device=device).bfloat16(), torch.randn(context, 128, device=device).bfloat16(),
         torch.randn(rows_m, 64, device=device), 2048] for rows_m, context in ((3, 5000), (5, 70000))])
    print(json.dumps({"points": points, "simt": simt, "gpu": gpu, "launch": launch, "lengths": lengths}))
""")

FP8_CHILD = INDEXER_COMMON + textwrap.dedent("""
    points = {}
    for index, point in enumerate(grid_points(read_literals(source)[1])):
        module = load(materialize(source, point), f"point{index}")
        scores = module.compiled_scores_mma(64, 128, module.mma_rows(point["ROWS"], 64, point["SCHEDULE"]),
                                            point["STAGES"], torch.float32, point["SCHEDULE"],
                                            point["REDUCE"])
        key = ",".join(f"{name}={value}" for name, value in point.items())
        points[key] = {"scores": ptx_facts(scores),
                       "failures": check_failures(op, module.forward, workloads, (11, 12)) if on_gpu else None}

    gpu = {"out_of_order": out_of_order(load(source, "shipped"))} if on_gpu else None
    # 3 query rows and 5000 tokens, made where this machine can hold them.
    workload = dataclasses.replace(workloads[1], device="cuda" if on_gpu else "cpu")
    launch = launched(load(source, "launched"), *op.make_inputs(workload, 13, "normal").values())
    lengths = launched(load(source, "lengths"), *[
        list(op.make_inputs(dataclasses.replace(w, device=workload.device), 13, "normal").values())
        for w in op.workloads("cuda", [2048], [3]) + op.workloads("cuda", [5000], [5])])
    print(json.dumps({"points": points, "gpu": gpu, "launch": launch, "lengths": lengths}))
""")


def _compiled_rows(label: str) -> int:
    """ROWS as the point compiles at 64 heads: two when three warpgroups take turns (their
    accumulators share the registers), else the label's."""
    rows = int(label.split("ROWS=")[1].split(",")[0])
    return min(rows, 2) if "SCHEDULE=roundrobin" in label else rows


def _assert_schedule(scores: dict, label: str) -> None:
    """Taking turns (pingpong: two MMA warpgroups, roundrobin: three) adds a loading
    warpgroup and hands the MMA issue on through named barriers; cooperative has
    neither. The reduction's histogram counts show which REDUCE the point compiled."""
    threads = {"cooperative": "256", "pingpong": "384", "roundrobin": "512"}
    schedule = label.split("SCHEDULE=")[1].split(",")[0]
    assert scores["threads"] == [threads[schedule]]
    assert (scores["named_arrives"] > 0) == (schedule != "cooperative")
    # Each lane counts the sums it stores: all 2*ROWS of the quad's under divergent
    # branches ("shuffle"), or the ROWS/2 the reduce-scatter or the head-sum MMA left
    # it ("scatter", "mma").
    rows = _compiled_rows(label)
    assert scores["smem_atomics"] == (2 * rows if "REDUCE=shuffle" in label else rows // 2)


def _wgmma(label: str, scores_mma: str) -> list[str]:
    """The scores' wgmma, and with REDUCE="mma" the head sum's: N=8, bfloat16 A from
    registers (the ReLU'd scores) and B (the weights), whatever the scores' dtype."""
    return sorted([scores_mma] + (["m64n8k16.bf16.bf16"] if "REDUCE=mma" in label else []))


@pytest.fixture(scope="module")
def indexer_child(tmp_path_factory):
    # On a GPU every point is checked on 4 shapes, each compiled anew: allow for that.
    return _run_child(INDEXER_CHILD, INDEXER, tmp_path_factory.mktemp("cute-indexer"), 600, "dsa_indexer_topk")


@pytest.mark.parametrize("label", list(_labels(INDEXER)))
def test_every_indexer_space_point_compiles_to_wgmma_fed_by_tma(indexer_child, label):
    point = indexer_child["points"][label]
    scores, select = point["scores"], point["select"]
    if not ON_GPU:
        assert scores["targets"] == select["targets"] == ["sm_90a"]
    # bfloat16 in, float32 accumulated; the MMA's N is ROWS query rows of 64 heads.
    rows = _compiled_rows(label)
    assert scores["wgmma"] == _wgmma(label, f"m64n{64 * rows}k16.bf16.bf16")
    assert scores["tma_loads"] > 0
    _assert_schedule(scores, label)
    # The select's first digit, counted in shared memory as the scores are made.
    assert scores["smem_atomics"] > 0
    # One wide pass over the row feeding shared memory, where the later digits are
    # counted; for a bin too full for it, passes whose slots are handed out by ballots.
    assert select["wgmma"] == [] and select["smem_atomics"] > 0 and select["ballots"] > 0
    # 5000 tokens: the chosen are marked in a bitmap, no sort.
    assert select["smem_or_atomics"] > 0
    assert select["wide_loads"] > 0
    if ON_GPU:
        assert point["failures"] == []


def test_the_indexer_float32_scores_compile_for_the_target_off_the_tensor_cores(indexer_child):
    simt = indexer_child["simt"]
    if not ON_GPU:
        assert simt["targets"] == ["sm_90a"]
    # wgmma would round float32 inputs to TF32, too coarse for float32's tolerance.
    assert simt["wgmma"] == [] and simt["tma_loads"] == 0 and simt["smem_atomics"] > 0


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to launch")
def test_on_a_gpu_the_indexer_is_right_in_float32_deterministic_and_breaks_ties_low(indexer_child):
    assert indexer_child["gpu"] == {"float32_failures": [], "repeats_differ": False, "equal_scores_wrong": [],
                                    "duplicate_keys_wrong": [], "out_of_order": []}


# --- the FP8 indexer: logits_topk_fp8_cute -------------------------------------------

FP8_INDEXER = get_op("dsa_indexer_topk_fp8").kernels()["logits_topk_fp8_cute"]


@pytest.fixture(scope="module")
def fp8_child(tmp_path_factory):
    return _run_child(FP8_CHILD, FP8_INDEXER, tmp_path_factory.mktemp("cute-fp8"), 600, "dsa_indexer_topk_fp8")


@pytest.mark.parametrize("label", list(_labels(FP8_INDEXER)))
def test_every_fp8_indexer_space_point_compiles_to_e4m3_wgmma_fed_by_tma(fp8_child, label):
    point = fp8_child["points"][label]
    scores = point["scores"]
    if not ON_GPU:
        assert scores["targets"] == ["sm_90a"]
    # e4m3 in, float32 accumulated, 32 of D per instruction; N is ROWS query rows of 64 heads.
    rows = _compiled_rows(label)
    assert scores["wgmma"] == _wgmma(label, f"m64n{64 * rows}k32.e4m3.e4m3")
    assert scores["tma_loads"] > 0 and scores["smem_atomics"] > 0
    _assert_schedule(scores, label)
    if ON_GPU:
        assert point["failures"] == []


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to launch")
def test_on_a_gpu_the_fp8_indexer_writes_its_choice_in_token_order_from_bitmap_and_sort(fp8_child):
    assert fp8_child["gpu"] == {"out_of_order": []}


# Both dense indexers (bf16 and FP8), each through its own child.
DENSE_CHILDREN = ["indexer_child", "fp8_child"]


@pytest.mark.skipif(ON_GPU, reason="a GPU is present: the launch runs")
@pytest.mark.parametrize("child_name", DENSE_CHILDREN)
def test_without_a_gpu_a_dense_indexer_launch_fails_for_want_of_one_and_runs_no_torch_compute(request, child_name):
    launch = request.getfixturevalue(child_name)["launch"]
    _assert_failed_for_want_of_a_gpu(launch)
    # The scores kernel compiled, then its launch failed before the select's turn.
    assert (launch["compiles"], launch["count"], launch["torch_compute"]) == (1, 0, {})


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to launch")
@pytest.mark.parametrize("child_name", DENSE_CHILDREN)
def test_on_a_gpu_a_dense_indexer_forward_launches_its_two_kernels_and_no_torch_compute(request, child_name):
    assert request.getfixturevalue(child_name)["launch"] == {
        "count": 2, "compiles": 2, "error": None, "torch_compute": {}}


@pytest.mark.parametrize("child_name", DENSE_CHILDREN)
def test_a_dense_indexer_compiles_once_for_two_context_lengths_and_batches(request, child_name):
    # 5000 tokens at 3 query rows, then 70000 at 5 (2048 and 5000 for the e4m3 kernel):
    # the rows, the lengths and the spans are runtime values. Without a GPU only the
    # scores kernel is reached (its launch fails, and the second call reaches it again:
    # a kernel compiled per batch would compile twice); with one, both kernels compile
    # once and each launches twice.
    want = {"count": 4, "compiles": 2, "error": None} if ON_GPU else {"count": 0, "compiles": 1}
    assert {key: request.getfixturevalue(child_name)["lengths"][key] for key in want} == want


def _torch_files():
    for op_name in list_ops():
        op = get_op(op_name)
        yield op.baseline_path
        yield from (path for path in op.kernels().values() if kernel_dsl(path) == "torch")


@pytest.mark.parametrize("path", list(_torch_files()), ids=lambda path: f"{path.parent.name}/{path.name}")
def test_torch_kernels_fail_the_cute_check(path):
    status, detail = static_check(path.read_text(), "cute")
    assert status == "fail"
    assert "does not import cutlass.cute" in detail


# --- the paged indexers: logits_topk_paged_cute, logits_topk_paged_fp8_cute -----------

PAGED = get_op("dsa_indexer_topk_paged").kernels()["logits_topk_paged_cute"]
PAGED_FP8 = get_op("dsa_indexer_topk_paged_fp8").kernels()["logits_topk_paged_fp8_cute"]

# What both paged kernels' children share: every SPACE point's PTX facts (the scores
# kernel compiled by `scores_kernel(module, point, next_n)`, its signature being the
# kernel's own), and on a GPU the op's workloads, graph replays and a tie plateau.
PAGED_COMMON = INDEXER_COMMON + textwrap.dedent("""
    def on(workload, device):
        return dataclasses.replace(workload, device=device)

    def replays_differ(module):
        # 20 replays of one captured graph give the same output bit for bit.
        inputs = op.make_inputs(op.workloads("cuda", [65536], [8])[0], 14, "uniform_outliers")
        args = list(inputs.values())
        for _ in range(2):
            module.forward(*args)  # compiled before capture, which cannot compile
        graph, outputs = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            out = module.forward(*args)
        for _ in range(20):
            graph.replay()
            outputs.append(out.clone())
        return sum(not torch.equal(outputs[0], other) for other in outputs[1:])

    def plateau_wrong(module):
        # Most keys point away from every query: their logits are negative, ReLU makes
        # them exactly 0.0, and the top-k is the few positive scores then the
        # lowest-indexed zeros, exactly (the select's ties go to the lowest index). Signs
        # are flipped in float32 and cast back: exact in bfloat16 and in e4m3, and the
        # FP8 op's key scales are positive already.
        inputs = op.make_inputs(op.workloads("cuda", [8192], [8])[0], 15, "normal")
        inputs["q"] = inputs["q"].float().abs().to(inputs["q"].dtype)
        inputs["weights"] = inputs["weights"].abs()
        cache = inputs["kv_cache"]
        loud = torch.rand(cache.shape[:2], device=cache.device) < 0.05
        keys = cache.float().abs()
        inputs["kv_cache"] = torch.where(loud.unsqueeze(-1), keys, -keys).to(cache.dtype)
        got = module.forward(*inputs.values())
        scores = op.reference(inputs)
        # A stable sort keeps equal scores in token order: the exact top-k, ties to the
        # lowest index. (Every positive score is chosen: about 5% of 8192 tokens.)
        want = scores.sort(dim=1, descending=True, stable=True).indices[:, :inputs["topk"]]
        want = want.masked_fill(scores.gather(1, want) == float("-inf"), -1).sort(dim=1).values
        # The plateau is most of each sequence's real tokens (positions past a length are -inf).
        zeros, real = int((scores == 0).sum()), int(torch.isfinite(scores).sum())
        wrong = []
        if zeros <= real // 2:
            wrong.append(f"no plateau: only {zeros} of {real} scores are 0.0")
        differ = int((got.sort(dim=1).values != want).sum())
        if differ:
            wrong.append(f"{differ} slots differ from the exact top-k ({zeros} zeros)")
        return wrong

    def paged_facts(scores_kernel):
        points = {}
        params, space = read_literals(source)
        shipped_only = os.environ.get("CUTE_TEST_POINTS") == "shipped"
        for index, point in enumerate([params] if shipped_only else grid_points(space)):
            module = load(materialize(source, point), f"point{index}")
            facts = {f"scores{next_n}": ptx_facts(scores_kernel(module, point, next_n)) for next_n in (1, 2)}
            facts["select"] = ptx_facts(module.compiled_select(1, 2048, point["SPAN"], point["SELECT_THREADS"]))
            key = ",".join(f"{name}={value}" for name, value in point.items())
            facts["failures"] = (check_failures(op, module.forward, op.workloads("cuda", [4096, 65536], [8]), (11, 12))
                                 if on_gpu else None)
            points[key] = facts

        module = load(source, "shipped")
        gpu = ({"replays_differ": replays_differ(module), "plateau_wrong": plateau_wrong(module),
                "failures": check_failures(op, module.forward, op.workloads("cuda", [262144], [64]), (11,))}
               if on_gpu else None)
        device = "cuda" if on_gpu else "cpu"
        # Two length mixes (mixed and equal), two table widths and two batch sizes of one
        # batch bucket (3 and 5 pad to 8), one token a sequence: one compile of each kernel.
        calls = [list(op.make_inputs(on(w, device), 13, "normal").values())
                 for w in op.workloads("cuda", [4096, 8192], [3, 5]) if w.params["next_n"] == 1]
        lengths = launched(load(source, "lengths"), *calls)
        return {"points": points, "gpu": gpu, "lengths": lengths, "calls": len(calls)}
""")

PAGED_CHILD = PAGED_COMMON + textwrap.dedent("""
    print(json.dumps(paged_facts(lambda module, point, next_n: module.compiled_scores_mma(
        torch.bfloat16, 64, 128, next_n, point["STAGES"], point["SCHEDULE"], point["REDUCE"], point["SPAN"]))))
""")

PAGED_FP8_CHILD = PAGED_COMMON + textwrap.dedent("""
    print(json.dumps(paged_facts(lambda module, point, next_n: module.compiled_scores_mma(
        64, 128, next_n, point["STAGES"], point["SCHEDULE"], point["REDUCE"], point["SPAN"]))))
""")


@pytest.fixture(scope="module")
def paged_child(tmp_path_factory):
    return _run_child(PAGED_CHILD, PAGED, tmp_path_factory.mktemp("cute-paged"), 600, "dsa_indexer_topk_paged")


@pytest.mark.parametrize("label", list(_labels(PAGED, SHIPPED_POINT_ONLY)))
def test_every_paged_indexer_space_point_compiles_to_wgmma_fed_by_tma(paged_child, label):
    point = paged_child["points"][label]
    for next_n in (1, 2):
        scores = point[f"scores{next_n}"]
        if not ON_GPU:
            assert scores["targets"] == ["sm_90a"]
        # One sequence's next_n query rows of 64 heads are the MMA's N; a cache block of
        # 64 tokens its M, loaded by TMA.
        assert scores["wgmma"] == _wgmma(label, f"m64n{64 * next_n}k16.bf16.bf16")
        assert scores["tma_loads"] > 0 and scores["smem_atomics"] > 0
        threads = {"pingpong": "384", "roundrobin": "512"}[label.split("SCHEDULE=")[1].split(",")[0]]
        assert scores["threads"] == [threads] and scores["named_arrives"] > 0
    select = point["select"]
    assert select["wgmma"] == [] and select["smem_atomics"] > 0 and select["ballots"] > 0
    assert select["smem_or_atomics"] > 0 and select["wide_loads"] > 0
    if ON_GPU:
        assert point["failures"] == []


def test_the_paged_indexer_compiles_once_for_new_lengths_widths_and_batches(paged_child):
    calls = paged_child["calls"]
    assert calls == 8  # (mixed, equal) x 2 widths x 2 batch sizes
    want = ({"count": 2 * calls, "compiles": 2, "error": None} if ON_GPU else {"count": 0, "compiles": 1})
    assert {key: paged_child["lengths"][key] for key in want} == want


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to launch")
def test_on_a_gpu_the_paged_indexer_replays_bit_identically_and_is_exact_on_a_tie_plateau(paged_child):
    # check_failures above also replays a captured graph on new lengths (another seed).
    assert paged_child["gpu"] == {"replays_differ": 0, "plateau_wrong": [], "failures": []}


@pytest.fixture(scope="module")
def paged_fp8_child(tmp_path_factory):
    return _run_child(PAGED_FP8_CHILD, PAGED_FP8, tmp_path_factory.mktemp("cute-paged-fp8"), 600,
                      "dsa_indexer_topk_paged_fp8")


@pytest.mark.parametrize("label", list(_labels(PAGED_FP8, SHIPPED_POINT_ONLY)))
def test_every_paged_fp8_indexer_space_point_compiles_to_e4m3_wgmma_fed_by_tma(paged_fp8_child, label):
    point = paged_fp8_child["points"][label]
    for next_n in (1, 2):
        scores = point[f"scores{next_n}"]
        if not ON_GPU:
            assert scores["targets"] == ["sm_90a"]
        # e4m3 in, float32 accumulated, 32 of D per instruction: one sequence's next_n
        # query rows of 64 heads are the MMA's N, a 64-token cache block its M, by TMA.
        assert scores["wgmma"] == _wgmma(label, f"m64n{64 * next_n}k32.e4m3.e4m3")
        assert scores["tma_loads"] > 0
        threads = {"pingpong": "384", "roundrobin": "512"}[label.split("SCHEDULE=")[1].split(",")[0]]
        assert scores["threads"] == [threads] and scores["named_arrives"] > 0
        # Each lane counts the scores it stores: all 2*next_n of its quad's under divergent
        # branches ("shuffle", and "scatter" at next_n = 1, which has no pair of rows to
        # scatter), or the one the reduce-scatter or the head-sum MMA left it.
        shuffles = "REDUCE=shuffle" in label or ("REDUCE=scatter" in label and next_n == 1)
        assert scores["smem_atomics"] == (2 * next_n if shuffles else 1)
    select = point["select"]
    assert select["wgmma"] == [] and select["smem_atomics"] > 0 and select["ballots"] > 0
    assert select["smem_or_atomics"] > 0 and select["wide_loads"] > 0
    if ON_GPU:
        assert point["failures"] == []


def test_the_paged_fp8_indexer_compiles_once_for_new_lengths_widths_and_batches(paged_fp8_child):
    calls = paged_fp8_child["calls"]
    assert calls == 8  # (mixed, equal) x 2 widths x 2 batch sizes
    # Both kernels compile before either launches (a shape or top-k one cannot run fails
    # before any work), so without a GPU both compile once and nothing launches.
    want = ({"count": 2 * calls, "compiles": 2, "error": None} if ON_GPU else {"count": 0, "compiles": 2})
    assert {key: paged_fp8_child["lengths"][key] for key in want} == want


@pytest.mark.skipif(ON_GPU, reason="a GPU is present: the launch runs")
@pytest.mark.parametrize("child_name", ["paged_child", "paged_fp8_child"])
def test_without_a_gpu_a_paged_indexer_launch_fails_for_want_of_one_and_runs_no_torch_compute(request, child_name):
    launch = request.getfixturevalue(child_name)["lengths"]
    _assert_failed_for_want_of_a_gpu(launch)
    assert launch["torch_compute"] == {}


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to launch")
def test_on_a_gpu_the_paged_fp8_indexer_replays_bit_identically_and_is_exact_on_a_tie_plateau(paged_fp8_child):
    # check_failures above also replays a captured graph on new lengths (another seed);
    # "failures" here is every 256K workload at 64 sequences, all-256K among them.
    assert paged_fp8_child["gpu"] == {"replays_differ": 0, "plateau_wrong": [], "failures": []}


def _paged_fp8_inputs(**changed):
    """Two sequences of one token's query, 64 heads of 128, in a cache of 4 blocks: the
    op's layout, with `changed` replacing any of them."""
    fp8 = torch.float8_e4m3fn
    inputs = {
        "q": torch.zeros(2, 1, 64, 128, dtype=fp8), "kv_cache": torch.zeros(4, 64, 128, dtype=fp8),
        "kv_scale": torch.ones(4, 64), "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "context_lens": torch.tensor([100, 30], dtype=torch.int32), "weights": torch.ones(2, 64), "topk": 16,
    }
    return {**inputs, **changed}


@pytest.mark.parametrize("changed, error, words", [
    ({"q": torch.zeros(2, 1, 64, 128, dtype=torch.bfloat16)}, TypeError, "float8_e4m3fn"),
    ({"kv_scale": torch.ones(4, 64, dtype=torch.bfloat16)}, TypeError, "kv_scale and weights in torch.float32"),
    ({"block_table": torch.tensor([[0, 1], [2, 3]])}, TypeError, "block_table and context_lens are torch.int32"),
    ({"kv_scale": torch.ones(4, 32)}, ValueError, "kv_scale [blocks, 64]"),
    ({"context_lens": torch.tensor([100], dtype=torch.int32)}, ValueError, "context_lens [B]"),
    ({"topk": 0}, ValueError, "top-0"),
])
def test_the_paged_fp8_indexer_names_what_is_wrong_with_its_inputs_before_compiling_or_launching(
        changed, error, words):
    spec = importlib.util.spec_from_file_location("paged_fp8_inputs", PAGED_FP8)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with launch_counter("cute") as launches, pytest.raises(error) as raised:
        module.forward(*_paged_fp8_inputs(**changed).values())
    assert words in str(raised.value)
    assert (launches.compiles, launches.count) == (0, 0)


@pytest.mark.parametrize("kernel", [INDEXER, FP8_INDEXER, PAGED, PAGED_FP8], ids=lambda path: path.stem)
def test_the_static_check_finds_each_indexers_launched_kernels(kernel):
    status, detail = static_check(kernel.read_text(), "cute")
    assert status == "pass", detail
    assert detail.startswith("forward launches @cute.kernel _")
