"""Profile evidence: the three export formats, the bottleneck class, bad uploads, and
``manage.py evidence``. The parser is pure, so none of this needs the database."""

from __future__ import annotations

import csv
import gzip
import io
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from django.core.management import call_command

from research.evidence import (
    MAX_TEXT_BYTES,
    MAX_TOP_KERNELS,
    EvidenceError,
    LABEL_WIDTH,
    EvidenceSummary,
    kernel_label,
    parse_evidence,
)
from research.charts import evidence_kernel_time_figure

PROJECT_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = PROJECT_ROOT / "tests" / "fixtures" / "evidence"
NCU_FIXTURE = FIXTURES / "ncu_details.csv"
NSYS_FIXTURE = FIXTURES / "nsys_kern_sum.csv"
TORCH_FIXTURE = FIXTURES / "torch_gpu_trace.json"
# Real exports of bench/h200/profile_step.py on an H200 (bench/h200/profile_exports.sh):
# `ncu --csv --page details` of ncu 2025.3.1 with its default sections, its ==PROF== lines
# above the table, over the program's first 40 launches (weight init, the warm-up step);
# and a torch.profiler trace of 3 steps. Both gzip-compressed as users upload them.
H200_NCU = FIXTURES / "h200_ncu_details.csv.gz"
H200_TORCH = FIXTURES / "h200_torch_trace.json.gz"
FIXTURE_FORMATS = [
    pytest.param(path, fmt, id=fmt)
    for path, fmt in [
        (NCU_FIXTURE, "ncu-csv"), (NSYS_FIXTURE, "nsys-csv"), (TORCH_FIXTURE, "torch-trace"),
    ]
]

GEMM = "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn"
NCU_HEADER = [
    "ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
    "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
    "Metric Value",
]
SUMMARY_KEYS = {
    "format", "top_kernels", "bottleneck", "reason", "notes", "total_ms", "kernel_count",
}


def parse_file(path: Path) -> EvidenceSummary:
    return parse_evidence(path.read_bytes(), path.name)


def rows_by_name(summary: EvidenceSummary) -> dict[str, dict[str, object]]:
    return {row["name"]: dict(row) for row in summary["top_kernels"]}


def ncu_csv(launches: list[tuple[str, float, float, float]]) -> bytes:
    """An ncu details export: one (kernel, duration µs, SM %, memory %) per launch."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 1 (/usr/bin/python3)\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(NCU_HEADER)
    section = "GPU Speed Of Light Throughput"
    for launch_id, (name, duration_us, sm_pct, memory_pct) in enumerate(launches):
        base = [launch_id, 1, "python3", "127.0.0.1", name, 1, 7, "(256, 1, 1)", "(80, 1, 1)",
                0, "9.0"]
        writer.writerow([*base, section, "Duration", "usecond", f"{duration_us:,.2f}"])
        writer.writerow([*base, section, "Compute (SM) Throughput", "%", f"{sm_pct:.2f}"])
        writer.writerow([*base, section, "Memory Throughput", "%", f"{memory_pct:.2f}"])
    return out.getvalue().encode()


def nsys_csv(kernels: list[tuple[str, int, int]]) -> bytes:
    """A cuda_gpu_kern_sum export: one (name, total ns, instances) per kernel."""
    out = io.StringIO()
    out.write('"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)",'
              '"Max (ns)","StdDev (ns)","Name"\n')
    total = sum(total_ns for _, total_ns, _ in kernels) or 1
    writer = csv.writer(out, lineterminator="\n")
    for name, total_ns, instances in kernels:
        average = total_ns / instances
        writer.writerow([f"{100 * total_ns / total:.1f}", total_ns, instances, average, average,
                         average, average, 0.0, name])
    return out.getvalue().encode()


def torch_trace(kernels: list[tuple[str, float, float]]) -> bytes:
    """A Chrome trace with one GPU kernel per (name, start µs, duration µs)."""
    events = [
        {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start, "dur": duration,
         "args": {"device": 0, "stream": 7}}
        for name, start, duration in kernels
    ]
    return json.dumps({"traceEvents": events}).encode()


def real_cpu_trace(path: Path) -> Path:
    """Profile a small matmul/relu loop on the CPU, exactly as a user would."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    weights = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            torch.relu(weights @ weights)
    prof.export_chrome_trace(str(path))
    return path


# --- the three formats -----------------------------------------------------------------


def test_it_reads_an_ncu_details_export_into_kernels_with_launch_counts() -> None:
    summary = parse_file(NCU_FIXTURE)

    assert summary["format"] == "ncu-csv"
    assert summary["kernel_count"] == 3
    # 1,234.56 + 1,198.44 µs of GEMM, 3 x ~100 µs of SiLU, 45,120 ns of RMSNorm.
    assert summary["total_ms"] == pytest.approx(2.77812)
    rows = rows_by_name(summary)
    assert rows[GEMM] == {"name": GEMM, "total_ms": pytest.approx(2.433), "calls": 2,
                          "share": pytest.approx(0.8758, abs=1e-4)}
    [norm] = [row for name, row in rows.items() if "rms_norm" in name]
    assert norm["total_ms"] == pytest.approx(0.04512)
    assert norm["calls"] == 1
    [silu] = [row for name, row in rows.items() if "silu" in name]
    assert silu["calls"] == 3


def test_it_reads_a_real_ncu_2025_export_whose_metric_rows_are_shorter_than_its_header() -> None:
    text = gzip.decompress(H200_NCU.read_bytes()).decode()
    table = text[text.index('"ID",'):].splitlines()
    widths = {len(row) for row in csv.reader(table[1:])}
    assert len(next(csv.reader(table[:1]))) == 20 and widths == {16, 20}  # the shape that was refused

    summary = parse_file(H200_NCU)

    assert summary["format"] == "ncu-csv" and summary["kernel_count"] == 17
    assert not any("skipped" in note or "without a Duration" in note for note in summary["notes"])
    assert summary["top_kernels"][0]["name"] == "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
    assert summary["top_kernels"][0]["calls"] == 4
    # Every launch's Speed Of Light percentages count: the throughput decides, not names.
    assert summary["bottleneck"] == "compute"
    assert summary["reason"] == "kernels run at 65% of compute throughput vs 50% of memory (time-weighted)"


def test_a_real_h200_torch_trace_counts_cublaslt_and_cudnn_kernels_as_compute() -> None:
    summary = parse_file(H200_TORCH)

    names = [row["name"] for row in summary["top_kernels"]]
    assert names[0].startswith("nvjet_sm90_tst_") and names[1].startswith("cudnn_generated_fort_native_sdpa")
    assert summary["bottleneck"] == "compute"
    assert summary["reason"].startswith("84% of GPU time is in compute kernels")


def test_a_row_too_short_to_reach_the_metric_value_is_skipped_and_counted() -> None:
    data = ncu_csv([(GEMM, 100.0, 80.0, 20.0)]) + b'"7","1","python3"\n'
    summary = parse_evidence(data)

    assert summary["kernel_count"] == 1
    assert "skipped 1 lines that don't fit the Nsight Compute table" in summary["notes"]


def test_kernel_labels_keep_what_tells_two_instantiations_apart() -> None:
    names = [row["name"] for row in parse_file(H200_TORCH)["top_kernels"]]
    elementwise = [name for name in names if "vectorized_elementwise_kernel" in name]
    labels = [kernel_label(name) for name in elementwise]

    assert len(elementwise) == 2 and len(set(labels)) == 2
    assert labels == ["vectorized_elementwise_kernel<launch_clamp_scalar>",
                      "vectorized_elementwise_kernel<CUDAFunctor_add<BFloat16>>"]
    assert all(len(kernel_label(name)) <= LABEL_WIDTH for name in names)
    assert kernel_label("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_NNT") == "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_NNT"
    # ncu spells lambdas its own way; the function that owns them is what is left.
    assert kernel_label(
        "void at::unrolled_elementwise_kernel<at::direct_copy_kernel_cuda(at::TensorIteratorBase &)::"
        "[lambda() (instance 3)]::operator ()() const::[lambda(float) (instance 1)], std::array<char *, 2>, 4, "
        "TrivialOffsetCalculator<1, unsigned int>>(int, T1, T2)"
    ) == "unrolled_elementwise_kernel<direct_copy_kernel_cuda, …>"


def test_the_kernel_chart_draws_one_bar_per_kernel_even_where_labels_coincide() -> None:
    twins = [("void k<at::native::Add<float>>(int)", 0.0, 30.0), ("void k<at::Add<float>>(long)", 40.0, 20.0)]
    summary = parse_evidence(torch_trace(twins))
    figure = evidence_kernel_time_figure(summary)
    [bars] = figure["data"]

    assert [kernel_label(name) for name, _, _ in twins] == ["k<Add<float>>", "k<Add<float>>"]
    assert bars["x"] == [0.02, 0.03] and len(set(bars["y"])) == 2  # keyed by position, never stacked
    assert figure["layout"]["yaxis"]["ticktext"] == ["k&lt;Add&lt;float&gt;&gt;"] * 2
    assert figure["layout"]["yaxis"]["automargin"] is True
    assert {row[2] for row in bars["customdata"]} == {
        "void k&lt;at::native::Add&lt;float&gt;&gt;(int)", "void k&lt;at::Add&lt;float&gt;&gt;(long)"}


def test_it_ranks_ncu_kernels_by_total_duration() -> None:
    totals = [row["total_ms"] for row in parse_file(NCU_FIXTURE)["top_kernels"]]

    assert totals == sorted(totals, reverse=True)
    assert parse_file(NCU_FIXTURE)["top_kernels"][0]["name"] == GEMM


def test_it_reads_an_nsys_kernel_summary_after_the_lines_nsys_prints_first() -> None:
    summary = parse_file(NSYS_FIXTURE)

    assert summary["format"] == "nsys-csv"
    assert summary["total_ms"] == pytest.approx(100.0)
    assert [(row["total_ms"], row["calls"], row["share"]) for row in summary["top_kernels"]] == [
        (60.0, 4000, 0.6), (25.0, 1000, 0.25), (15.0, 500, 0.15),
    ]


def test_it_reads_an_nsys_gpu_trace_export_launch_by_launch() -> None:
    data = (
        '"Start (ns)","Duration (ns)","CorrId","Strm","Name"\n'
        '1000,5000,1,7,"gemm_kernel"\n'
        '7000,3000,2,7,"[CUDA memcpy Host-to-Device]"\n'
        '11000,5000,3,7,"gemm_kernel"\n'
    ).encode()

    summary = parse_evidence(data)

    assert summary["format"] == "nsys-csv"
    assert rows_by_name(summary)["gemm_kernel"]["calls"] == 2
    assert rows_by_name(summary)["gemm_kernel"]["total_ms"] == pytest.approx(0.010)
    assert summary["total_ms"] == pytest.approx(0.013)


def test_it_counts_gpu_kernels_and_copies_in_a_torch_trace_but_not_cpu_or_annotations() -> None:
    summary = parse_file(TORCH_FIXTURE)

    assert summary["format"] == "torch-trace"
    # 2 GEMMs (120.5 + 119.5 µs), 2 ReLUs (10 µs each), a 30 µs copy and a 2 µs memset; the
    # cpu_op, cuda_runtime and gpu_user_annotation events around them add nothing.
    assert summary["total_ms"] == pytest.approx(0.292)
    rows = rows_by_name(summary)
    assert rows["ampere_sgemm_128x64_tn"]["calls"] == 2
    assert rows["Memcpy HtoD (Pageable -> Device)"]["total_ms"] == pytest.approx(0.030)
    assert rows["Memset (Device)"]["calls"] == 1
    assert not any(name.startswith(("aten::", "cuda", "forward")) for name in rows)
    assert "GPU time includes 2 memcpy/memset operations (0.032 ms)" in summary["notes"]


def test_it_accepts_a_trace_written_as_a_bare_list_of_events() -> None:
    events = json.loads(TORCH_FIXTURE.read_text())["traceEvents"]

    summary = parse_evidence(json.dumps(events).encode())

    assert summary == parse_file(TORCH_FIXTURE)


@pytest.mark.parametrize(("path", "expected_format"), FIXTURE_FORMATS)
def test_shares_of_every_format_sum_to_one(path: Path, expected_format: str) -> None:
    summary = parse_file(path)

    assert summary["format"] == expected_format
    assert sum(row["share"] for row in summary["top_kernels"]) == pytest.approx(1.0, abs=1e-3)
    assert all(0 < row["share"] <= 1 for row in summary["top_kernels"])


def test_it_summarises_a_real_cpu_only_pytorch_profiler_trace(tmp_path: Path) -> None:
    path = real_cpu_trace(tmp_path / "trace.json")

    summary = parse_file(path)

    assert summary["format"] == "torch-trace"
    names = {row["name"] for row in summary["top_kernels"]}
    assert {"aten::matmul", "aten::relu"} <= names
    # aten::mm runs inside aten::matmul: counting it too would count its time twice.
    assert "aten::mm" not in names
    assert rows_by_name(summary)["aten::matmul"]["calls"] == 5
    assert "no GPU kernels in this trace: CPU operators are shown instead" in summary["notes"]
    assert summary["bottleneck"] == "unknown"
    assert "no GPU kernels" in summary["reason"]


def test_it_reads_a_gzip_compressed_trace(tmp_path: Path) -> None:
    path = real_cpu_trace(tmp_path / "trace.json.gz")
    assert path.read_bytes()[:2] == b"\x1f\x8b"

    assert parse_file(path)["format"] == "torch-trace"
    gpu = gzip.compress(TORCH_FIXTURE.read_bytes())
    assert parse_evidence(gpu, "trace.json.gz") == parse_file(TORCH_FIXTURE)


def test_it_detects_the_format_from_the_content_not_the_filename() -> None:
    assert parse_evidence(NCU_FIXTURE.read_bytes(), "trace.json")["format"] == "ncu-csv"
    assert parse_evidence(TORCH_FIXTURE.read_bytes(), "kernels.csv")["format"] == "torch-trace"


def test_it_keeps_the_top_kernels_and_notes_how_many_were_left_out() -> None:
    kernels = [(f"kernel_{i:02d}", (i + 1) * 1000, 1) for i in range(30)]

    summary = parse_evidence(nsys_csv(kernels))

    assert len(summary["top_kernels"]) == MAX_TOP_KERNELS
    assert summary["kernel_count"] == 30
    assert summary["top_kernels"][0]["name"] == "kernel_29"
    # Shares stay fractions of all 30 kernels' time, so the rows shown sum to less than 1.
    assert summary["top_kernels"][0]["share"] == pytest.approx(30 / sum(range(1, 31)), abs=1e-4)
    assert sum(row["share"] for row in summary["top_kernels"]) < 0.9
    assert any("top 20 of 30 kernels" in note for note in summary["notes"])


# --- the bottleneck class -----------------------------------------------------------------


def test_ncu_throughput_marks_a_profile_dominated_by_a_busy_gemm_as_compute() -> None:
    summary = parse_file(NCU_FIXTURE)

    assert summary["bottleneck"] == "compute"
    # Time-weighted: the GEMM's ~81% SM dominates; the 1,530 Gbyte/second "Memory
    # Throughput" of Memory Workload Analysis is a bandwidth, not a percentage, and is ignored.
    assert summary["reason"] == (
        "kernels run at 73% of compute throughput vs 41% of memory (time-weighted)"
    )


def test_ncu_throughput_marks_memory_heavy_kernels_as_memory() -> None:
    data = ncu_csv([
        ("fused_gemm_kernel", 400.0, 22.0, 81.0),
        ("fused_gemm_kernel", 400.0, 20.0, 75.0),
        ("softmax_kernel", 50.0, 90.0, 10.0),
    ])

    summary = parse_evidence(data)

    # Measured throughput wins over the kernel's name.
    assert summary["bottleneck"] == "memory"
    assert "74% of memory throughput vs 25% of compute" in summary["reason"]


def test_ncu_kernels_that_keep_neither_unit_busy_are_latency_bound_not_classified() -> None:
    summary = parse_evidence(ncu_csv([("gemv_kernel", 200.0, 12.0, 18.0)]))

    assert summary["bottleneck"] == "unknown"
    assert summary["reason"].startswith("kernels reach only 18% of memory and 12% of compute")


def test_many_short_launches_are_launch_overhead() -> None:
    data = nsys_csv([("void at::native::vectorized_elementwise_kernel<4>", 412 * 3_100, 412)])

    summary = parse_evidence(data)

    assert summary["bottleneck"] == "overhead"
    assert summary["reason"].startswith("412 launches averaging 3.1 µs")


def test_a_gpu_idle_between_its_kernels_is_launch_overhead() -> None:
    # 100 GEMMs of 50 µs, one every 200 µs: long enough each, but the GPU waits 3/4 of the time.
    data = torch_trace([("ampere_sgemm_128x64_tn", 200.0 * i, 50.0) for i in range(100)])

    summary = parse_evidence(data)

    assert summary["bottleneck"] == "overhead"
    assert summary["reason"].startswith("the GPU is busy only 25% of the 19.9 ms")


def test_kernels_running_at_once_on_two_streams_count_once_toward_busy_time() -> None:
    # Summed, the two streams' kernels would fill half the span; at once, they fill a quarter.
    kernels = [(f"ampere_sgemm_{stream}", 200.0 * i, 50.0) for i in range(100) for stream in (0, 1)]

    summary = parse_evidence(torch_trace(kernels))

    assert summary["bottleneck"] == "overhead"
    assert "busy only 25%" in summary["reason"]


def test_without_throughput_metrics_kernel_names_decide() -> None:
    assert parse_file(NSYS_FIXTURE)["bottleneck"] == "memory"
    assert parse_file(NSYS_FIXTURE)["reason"].startswith(
        "85% of GPU time is in memory-bound kernels"
    )
    assert parse_file(TORCH_FIXTURE)["bottleneck"] == "compute"
    assert parse_file(TORCH_FIXTURE)["reason"].startswith("82% of GPU time is in compute kernels")


@pytest.mark.parametrize(("kernel", "bottleneck"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "compute"),
    ("flash_fwd_splitkv_kernel", "compute"),
    ("triton_tem_fused_mm_0", "compute"),
    ("cutlass_wgmma_kernel", "compute"),
    ("implicit_convolve_sgemm", "compute"),
    ("triton_poi_fused_add_mul_0", "memory"),
    ("GammaBetaBackwardCUDAKernel", "unknown"),  # "gamma" is not an mma
    ("unrolled_elementwise_kernel_convert", "memory"),  # "convert" is not a convolution
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy", "memory"),
    ("my_custom_kernel", "unknown"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "compute"),  # cuBLASLt on Hopper
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "compute"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<>>", "compute"),
    ("cutlass_80_wmma_tensorop_bf16_s161616gemm", "compute"),
    ("void deep_gemm::sm90_fp8_mqa_logits<64, 128>", "compute"),
    ("void flash::flash_fwd_splitkv_mla_kernel<>", "compute"),
    ("void at::native::reduce_kernel<512, 1>", "memory"),
])
def test_kernel_names_sort_into_compute_and_memory_work(kernel: str, bottleneck: str) -> None:
    assert parse_evidence(nsys_csv([(kernel, 5_000_000, 10)]))["bottleneck"] == bottleneck


def test_unrecognisable_kernel_names_leave_the_bottleneck_unknown_with_the_reason() -> None:
    summary = parse_evidence(nsys_csv([("kernel_a", 700_000, 7), ("gemm_b", 300_000, 3)]))

    assert summary["bottleneck"] == "unknown"
    assert summary["reason"] == (
        "kernel names tell compute from memory work for only 30% of the GPU time"
    )


# --- bad uploads -----------------------------------------------------------------------


def truncated_trace() -> bytes:
    data = TORCH_FIXTURE.read_bytes()
    return data[: len(data) // 2]


NO_KERNEL_TRACE = json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}]})
OTHER_TOOL_CSV = "date,open,high,low,close\n2024-01-02,187.15,188.44,183.89,185.64\n"
NCU_WITHOUT_UNITS = (
    '"ID","Kernel Name","Metric Name","Metric Value"\n"0","gemm","Duration","12.5"\n'
)
NCU_WITHOUT_DURATION = (
    '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    '"0","gemm","Launch Statistics","Registers Per Thread","register/thread","128"\n'
)
NSYS_API_SUMMARY = (
    '"Time (%)","Total Time (ns)","Num Calls","Avg (ns)","Name"\n'
    '90.0,1000000,10,100000.0,"cudaLaunchKernel"\n'
)


@pytest.mark.parametrize(("data", "filename", "message"), [
    (b"", "", "empty file"),
    (b" \n\t\n", "", "empty file"),
    (b"PK\x03\x04\x00\x00binary", "", "binary data, not text"),
    (b"\xff\xfe\x81ncu", "", "binary data, not text"),
    (b"NVIDIA\x00\x01\x02", "run.ncu-rep", "binary data, not text: export it with `ncu --csv"),
    (truncated_trace(), "", "not a PyTorch profiler trace: JSON ends early at byte "),
    (b'{"traceEvents": [{"ph": "X",, }]}', "", "invalid JSON at line 1, column 29"),
    (b'{"model": "llama", "layers": 32}', "", "the JSON has no traceEvents list"),
    (b"[1, 2, 3]", "", "the JSON holds no trace events"),
    (NO_KERNEL_TRACE.encode(), "", "trace has no GPU kernels"),
    (OTHER_TOOL_CSV.encode(), "",
     "CSV has none of the columns of an Nsight Compute or Nsight Systems export"),
    (b"hello, I am not a profile\n", "", "CSV has none of the columns"),
    (b"just some notes\nabout a kernel\n", "", "neither JSON nor CSV"),
    (NCU_WITHOUT_UNITS.encode(), "",
     "looks like an Nsight Compute CSV but lacks the column(s) Metric Unit"),
    (NSYS_API_SUMMARY.encode(), "", "lacks the column(s) Instances"),
    (ncu_csv([]), "", "Nsight Compute CSV has a header but no kernel launches"),
    (NCU_WITHOUT_DURATION.encode(), "", "Nsight Compute CSV has no Duration metric"),
    (nsys_csv([]), "", "Nsight Systems CSV has a header but no kernels"),
    (b'"Total Time (ns)","Instances","Name"\nlots,3,"gemm"\n', "",
     "Total Time (ns) is 'lots', not a number"),
    (nsys_csv([("gemm", 0, 4)]), "", "the kernels in this file add up to 0 ms"),
    (gzip.compress(TORCH_FIXTURE.read_bytes())[:200], "trace.json.gz",
     "gzip data ends early at byte 200"),
])
def test_unreadable_evidence_is_refused_with_one_readable_line(
    data: bytes, filename: str, message: str
) -> None:
    with pytest.raises(EvidenceError) as refused:
        parse_evidence(data, filename)

    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_file_over_the_limit_is_refused_by_its_size() -> None:
    with pytest.raises(EvidenceError, match=r"^file is 31\.2 MB; the limit is 25 MB$"):
        parse_evidence(b"x" * int(31.2 * 1024 * 1024))
    with pytest.raises(EvidenceError, match=r"^file is 1\.5 KB; the limit is 1 KB$"):
        parse_evidence(b"x" * 1536, max_bytes=1024)


def test_a_gzip_file_that_expands_past_the_limit_is_refused() -> None:
    bomb = gzip.compress(b" " * 100_000)

    with pytest.raises(EvidenceError, match="gzip data expands past"):
        parse_evidence(bomb, max_bytes=len(bomb))


def _peak_bytes(call) -> tuple[int, object]:
    """The most memory Python held while `call` ran (tracemalloc), and what it raised."""
    tracemalloc.start()
    try:
        call()
        raised = None
    except EvidenceError as error:
        raised = error
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, raised


def test_json_amplifies_a_small_upload_into_many_objects_outside_the_parser() -> None:
    # What the guard below stops: 3 bytes of `{},` become a dict of ~70 bytes once parsed.
    text = "[" + "{}," * 300_000 + "{}]"
    peak, _ = _peak_bytes(lambda: json.loads(text))
    assert peak > 15 * len(text)


def test_a_trace_of_empty_objects_is_refused_before_it_is_parsed_with_memory_bounded() -> None:
    # The security review's upload: a few hundred KB of gzip that unpacks into ~16 million
    # empty objects (48 MB of text, ~1.2 GB once parsed), under the text limit.
    text = b"[" + b"{}," * 16_000_000 + b"{}]"
    upload = gzip.compress(text, compresslevel=9)
    assert len(upload) < 400_000
    peak, raised = _peak_bytes(lambda: parse_evidence(upload))
    assert raised is not None and "JSON values and separators; at most 2,500,000 are parsed" in str(raised)
    # The text, its decoded copy, and nothing that grows with the values' count.
    assert peak < 3 * len(text), f"{peak:,} bytes at the peak for {len(text):,} of text"


def test_a_table_of_tiny_cells_is_refused_before_it_is_split_with_memory_bounded() -> None:
    # 6 KB of gzip, 4 MB of one-character cells under an ncu header: ~235 MB once parsed.
    header = next(line for line in NCU_FIXTURE.read_text().splitlines() if "Metric Name" in line)
    text = (header + "\n" + ("a," * 19 + "a\n") * 100_000 * 2).encode()
    upload = gzip.compress(text, compresslevel=9)
    peak, raised = _peak_bytes(lambda: parse_evidence(upload))
    assert raised is not None and "cells; at most 2,500,000 are read" in str(raised)
    assert peak < 3 * len(text), f"{peak:,} bytes at the peak for {len(text):,} of text"
    # Lines end where str.splitlines ends them, not only at "\n".
    for mark in ("\r", "\x0b", "\u2028"):
        with pytest.raises(EvidenceError, match="cells; at most"):
            parse_evidence((header + "\n" + ("ab" + mark) * 3_000_000).encode())


def test_a_gzip_upload_unpacks_to_at_most_the_text_limit_whatever_the_upload_limit() -> None:
    bomb = gzip.compress(b" " * (MAX_TEXT_BYTES + 1))
    with pytest.raises(EvidenceError, match="gzip data expands past 64 MB, the limit"):
        parse_evidence(bomb, max_bytes=len(bomb) * 1000)


# --- manage.py evidence -------------------------------------------------------------------


def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "evidence", *args],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(("path", "expected_format"), FIXTURE_FORMATS)
def test_the_command_prints_the_summary_as_one_json_object(
    path: Path, expected_format: str
) -> None:
    result = run_command(str(path), "--json")

    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == parse_file(path)
    assert set(printed) == SUMMARY_KEYS
    assert printed["format"] == expected_format
    assert set(printed["top_kernels"][0]) == {"name", "total_ms", "calls", "share"}


def test_the_command_exits_2_with_one_line_for_a_missing_file(tmp_path: Path) -> None:
    result = run_command(str(tmp_path / "missing.json"), "--json")

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0
    assert "No such file or directory" in result.stderr


def test_the_command_exits_2_with_one_line_for_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(truncated_trace())

    result = run_command(str(path), "--json")

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0
    assert "JSON ends early" in result.stderr


def test_without_json_the_command_prints_a_readable_table() -> None:
    out = io.StringIO()

    call_command("evidence", str(NSYS_FIXTURE), stdout=out)

    lines = out.getvalue().splitlines()
    assert lines[0] == "nsys-csv: 3 kernels, 100.000 ms in all"
    assert lines[1].startswith("bottleneck: memory — 85% of GPU time")
    assert "  60.0%      60.000     4,000  void at::native::vectorized" in out.getvalue()
