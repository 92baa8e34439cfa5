"""Turn an uploaded profile into a short summary of where the GPU time goes.

Three exports are understood, recognised by their content (never by the file name):

- ``torch-trace``: a PyTorch profiler Chrome trace (``prof.export_chrome_trace``),
  plain or gzip-compressed;
- ``ncu-csv``: ``ncu --csv --page details``, one row per metric per kernel launch;
- ``nsys-csv``: ``nsys stats --report cuda_gpu_kern_sum --format csv`` (or the older
  ``gpukernsum``, or the per-launch ``cuda_gpu_trace``).

Pure Python, no Django: the thesis form and ``manage.py evidence`` both call
``parse_evidence``, which returns a whole summary or raises ``EvidenceError`` with a
one-line reason, never anything in between.
"""

from __future__ import annotations

import csv
import json
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, TypedDict

MAX_EVIDENCE_BYTES = 25 * 1024 * 1024
# A gzip trace may expand to this many times the upload limit: real traces compress
# about 10x, and the cap keeps a gzip bomb from exhausting memory.
MAX_GZIP_EXPANSION = 8
# Whatever the upload's size, the text parsed is at most this long: a trace is parsed
# whole, and Python holds several times its text's size in objects.
MAX_TEXT_BYTES = 64 * 1024 * 1024
# JSON amplifies: `{},` is 3 bytes of text and about 70 bytes of dict, so a 386 KB gzip
# upload once grew the server by 3.8 GB. The count of what opens a value or separates one
# ({ [ , :) bounds the objects json.loads could make; it is taken before parsing. Real
# torch traces run about 11 bytes per such character: this admits traces of ~30 MB.
MAX_JSON_TOKENS = 2_500_000
# CSV amplifies too (`a,` is 2 bytes of text and ~100 of row dict entry). A real ncu
# details export of 1,000 kernels with the default sections holds about 1.5 million.
MAX_CSV_CELLS = 2_500_000
# Every character str.splitlines() ends a line at: each makes a line, whatever is counted.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
MAX_TOP_KERNELS = 20

# Launch overhead: many launches that are each too short to amortise their launch cost,
# or a GPU that sits idle for much of the span between the first and last kernel.
OVERHEAD_MIN_LAUNCHES = 50
SHORT_KERNEL_US = 10.0
MIN_GPU_BUSY_FRACTION = 0.5

# Nsight Compute throughput: when neither unit reaches this share of its peak, the
# kernels are latency-bound and calling them compute- or memory-bound would mislead.
LATENCY_BOUND_PCT = 30.0
# Throughput percentages must cover this fraction of the GPU time to be trusted.
MIN_THROUGHPUT_COVERAGE = 0.5
# Kernel names must classify this fraction of the GPU time to name a bottleneck.
MIN_CLASSIFIED_SHARE = 0.5

TOTAL_MS_DIGITS = 6
SHARE_DIGITS = 4

Format = Literal["torch-trace", "ncu-csv", "nsys-csv"]
Bottleneck = Literal["compute", "memory", "overhead", "unknown"]


class KernelRow(TypedDict):
    name: str
    total_ms: float
    calls: int
    share: float


class EvidenceSummary(TypedDict):
    """CONTRACTS §5, extended with ``reason``, ``total_ms`` and ``kernel_count``.

    ``total_ms`` is the GPU time of every kernel (not only the top rows) and
    ``kernel_count`` the number of distinct kernels; for a CPU-only trace both
    describe the top-level CPU operators instead.
    """

    format: Format
    top_kernels: list[KernelRow]
    bottleneck: Bottleneck
    reason: str
    notes: list[str]
    total_ms: float
    kernel_count: int


class EvidenceError(ValueError):
    """The upload can't be summarised; the message is one line meant for its author."""


# --- entry points ------------------------------------------------------------------


def parse_evidence(
    data: bytes, filename: str = "", *, max_bytes: int = MAX_EVIDENCE_BYTES
) -> EvidenceSummary:
    """Summarise a profile export. ``filename`` only sharpens error messages."""
    check_evidence_size(len(data), max_bytes=max_bytes)
    text = _decode(_gunzip(data, min(max_bytes * MAX_GZIP_EXPANSION, MAX_TEXT_BYTES)), filename)
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        profile = _parse_torch_trace(stripped)
    else:
        profile = _parse_csv(text)
    return _summarise(profile)


def check_evidence_size(size: int, *, max_bytes: int = MAX_EVIDENCE_BYTES) -> None:
    """Refuse a file by its size alone, before anyone reads it."""
    if size > max_bytes:
        raise EvidenceError(f"file is {_format_size(size)}; the limit is {_format_size(max_bytes)}")


# --- bytes to text ------------------------------------------------------------------

GZIP_MAGIC = b"\x1f\x8b"
# Binary reports people upload instead of the text export, with the command that
# turns each into something this parser reads.
EXPORT_HINTS = {
    ".ncu-rep": "export it with `ncu --csv --page details -i FILE > FILE.csv`",
    ".nsys-rep": "export it with `nsys stats --report cuda_gpu_kern_sum --format csv FILE`",
    ".qdrep": "export it with `nsys stats --report cuda_gpu_kern_sum --format csv FILE`",
    ".sqlite": "export it with `nsys stats --report cuda_gpu_kern_sum --format csv FILE`",
}


def _gunzip(data: bytes, max_bytes: int) -> bytes:
    if not data.startswith(GZIP_MAGIC):
        return data
    # wbits=31: gzip header and trailer; max_length stops a bomb before it lands in memory.
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise EvidenceError(f"corrupt gzip data ({exc})") from exc
    if len(out) > max_bytes:
        raise EvidenceError(f"gzip data expands past {_format_size(max_bytes)}, the limit")
    if not inflater.eof:
        raise EvidenceError(f"gzip data ends early at byte {len(data):,}")
    return out


def _decode(data: bytes, filename: str) -> str:
    if not data.strip():
        raise EvidenceError("empty file")
    try:
        text: str | None = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        hint = next((h for ext, h in EXPORT_HINTS.items() if filename.lower().endswith(ext)), "")
        raise EvidenceError("binary data, not text" + (f": {hint}" if hint else ""))
    return text


# --- the common shape every format is read into --------------------------------------


@dataclass
class _Kernel:
    total_us: float = 0.0
    calls: int = 0


@dataclass
class _Throughput:
    """Nsight Compute percent-of-peak figures, weighted by kernel duration."""

    compute_weighted: float = 0.0
    memory_weighted: float = 0.0
    covered_us: float = 0.0

    def add(self, duration_us: float, compute_pct: float, memory_pct: float) -> None:
        self.compute_weighted += compute_pct * duration_us
        self.memory_weighted += memory_pct * duration_us
        self.covered_us += duration_us


@dataclass
class _Profile:
    format: Format
    on_gpu: bool = True
    kernels: dict[str, _Kernel] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # (start, end) of each GPU operation, in µs, when the export has timestamps.
    intervals: list[tuple[float, float]] = field(default_factory=list)
    throughput: _Throughput = field(default_factory=_Throughput)

    def add(self, name: str, duration_us: float, calls: int = 1) -> None:
        if "\0" in name:
            # JSON may spell one (\u0000); no database column stores it.
            raise EvidenceError(f"a kernel name contains a NUL character: {_short(name)!r}")
        kernel = self.kernels.setdefault(name, _Kernel())
        kernel.total_us += duration_us
        kernel.calls += calls

    @property
    def launches(self) -> int:
        return sum(k.calls for k in self.kernels.values())


# --- PyTorch profiler Chrome trace ---------------------------------------------------

# Kineto's categories for GPU work; the capitalised ones come from torch < 1.9.
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
GPU_COPY_CATEGORIES = GPU_CATEGORIES - {"kernel"}
CPU_OP_CATEGORY = "cpu_op"


def _parse_torch_trace(text: str) -> _Profile:
    spans = _complete_spans(_trace_events(_load_json(text)))
    gpu = [s for s in spans if s.category in GPU_CATEGORIES]
    if gpu:
        return _gpu_trace_profile(gpu)
    cpu_ops = [s for s in spans if s.category == CPU_OP_CATEGORY]
    if cpu_ops:
        return _cpu_trace_profile(cpu_ops)
    raise EvidenceError(
        'trace has no GPU kernels (cat "kernel") and no CPU operators (cat "cpu_op"): '
        "export it with torch.profiler's export_chrome_trace"
    )


def _load_json(text: str) -> object:
    tokens = sum(text.count(character) for character in "{[,:")
    if tokens > MAX_JSON_TOKENS:
        raise EvidenceError(
            f"trace holds {tokens:,} JSON values and separators; at most {MAX_JSON_TOKENS:,} are parsed: "
            "profile fewer steps (torch.profiler's schedule) or upload `nsys stats` CSV")
    try:
        return json.loads(text)
    except RecursionError:
        raise EvidenceError(
            "not a PyTorch profiler trace: lists and objects nest deeper than a trace's few levels"
        ) from None
    except json.JSONDecodeError as exc:
        body = text.rstrip()
        if exc.pos >= len(body) or exc.msg.startswith("Unterminated string"):
            raise EvidenceError(
                f"not a PyTorch profiler trace: JSON ends early at byte {len(body.encode()):,}"
            ) from exc
        raise EvidenceError(
            f"not a PyTorch profiler trace: invalid JSON at line {exc.lineno}, "
            f"column {exc.colno} ({exc.msg})"
        ) from exc


def _trace_events(doc: object) -> list[dict[str, object]]:
    # The Chrome trace format allows a bare list of events as well as the object form.
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise EvidenceError("not a PyTorch profiler trace: the JSON has no traceEvents list")
    events = [e for e in events if isinstance(e, dict) and "ph" in e]
    if not events:
        raise EvidenceError("not a PyTorch profiler trace: the JSON holds no trace events")
    return events


@dataclass(frozen=True)
class _Span:
    """A complete ("ph": "X") trace event; times in µs, as the trace writes them."""

    name: str
    category: str
    thread: tuple[object, object]
    start: float
    end: float


def _complete_spans(events: list[dict[str, object]]) -> list[_Span]:
    spans = []
    for event in events:
        start, duration = _json_number(event.get("ts")), _json_number(event.get("dur"))
        if event.get("ph") != "X" or start is None or duration is None or duration < 0:
            continue
        spans.append(_Span(
            name=str(event.get("name", "?")),
            category=str(event.get("cat", "")).lower(),
            thread=(event.get("pid"), event.get("tid")),
            start=start,
            end=start + duration,
        ))
    return spans


def _gpu_trace_profile(spans: list[_Span]) -> _Profile:
    profile = _Profile("torch-trace")
    copies_us, copies = 0.0, 0
    for span in spans:
        profile.add(span.name, span.end - span.start)
        profile.intervals.append((span.start, span.end))
        if span.category in GPU_COPY_CATEGORIES:
            copies_us += span.end - span.start
            copies += 1
    if copies:
        profile.notes.append(
            f"GPU time includes {copies:,} memcpy/memset operations ({copies_us / 1000:.3f} ms)"
        )
    return profile


def _cpu_trace_profile(spans: list[_Span]) -> _Profile:
    """Only operators that no other operator on their thread encloses: aten::matmul
    calls aten::mm, and counting both would double the time."""
    profile = _Profile("torch-trace", on_gpu=False)
    by_thread: dict[tuple[object, object], list[_Span]] = {}
    for span in spans:
        by_thread.setdefault(span.thread, []).append(span)
    for ops in by_thread.values():
        # Longest first among equal starts, so a parent precedes the child it encloses.
        ops.sort(key=lambda op: (op.start, -op.end))
        enclosing_end = -math.inf
        for op in ops:
            # Only the start is compared: the trace rounds a child's end past its parent's.
            if op.start < enclosing_end:
                continue
            profile.add(op.name, op.end - op.start)
            enclosing_end = op.end
    profile.notes.append("no GPU kernels in this trace: CPU operators are shown instead")
    return profile


# --- CSV exports ---------------------------------------------------------------------


@dataclass(frozen=True)
class _CsvFormat:
    label: str
    columns: tuple[str, ...]
    export_hint: str


NCU_DETAILS = _CsvFormat(
    "Nsight Compute",
    ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"),
    "export it with `ncu --csv --page details`",
)
NSYS_KERNEL_SUMMARY = _CsvFormat(
    "Nsight Systems kernel summary",
    ("Name", "Total Time (ns)", "Instances"),
    "export it with `nsys stats --report cuda_gpu_kern_sum --format csv`",
)
NSYS_GPU_TRACE = _CsvFormat(
    "Nsight Systems GPU trace",
    ("Name", "Start (ns)", "Duration (ns)"),
    "export it with `nsys stats --report cuda_gpu_kern_sum --format csv`",
)
CSV_FORMATS = (NCU_DETAILS, NSYS_KERNEL_SUMMARY, NSYS_GPU_TRACE)
# Columns too common to say which tool wrote a CSV; every header has one of the others.
GENERIC_COLUMNS = {"ID", "Name"}
SIGNATURE_COLUMNS = {column for fmt in CSV_FORMATS for column in fmt.columns} - GENERIC_COLUMNS


def _parse_csv(text: str) -> _Profile:
    # Each cell becomes a string in a row's dict, ~100 bytes for a 2-byte cell: a bound
    # on the cells (separators plus lines) is a bound on memory, taken before splitting.
    cells = text.count(",") + sum(text.count(mark) for mark in LINE_BREAKS)
    if cells > MAX_CSV_CELLS:
        raise EvidenceError(f"the table holds {cells:,} cells; at most {MAX_CSV_CELLS:,} are read: export "
                            "fewer kernels or sections (ncu --kernel-name, --section) or the nsys summary")
    lines = text.splitlines()
    near_miss: str | None = None
    # Both tools may print their own lines (==PROF==, "Processing [...]"), and ncu the
    # profiled program's output too, before the table: the header is wherever it is.
    for index, line in enumerate(lines):
        if not any(column in line for column in SIGNATURE_COLUMNS):
            continue
        header = [cell.strip() for cell in next(csv.reader([line]))]
        for fmt in CSV_FORMATS:
            missing = [c for c in fmt.columns if c not in header]
            if not missing:
                return _parse_table(fmt, header, lines[index + 1 :])
            if near_miss is None and SIGNATURE_COLUMNS & set(header) & set(fmt.columns):
                near_miss = (
                    f"looks like an {fmt.label} CSV but lacks the column(s) "
                    f"{', '.join(missing)}: {fmt.export_hint}"
                )
    if near_miss:
        raise EvidenceError(near_miss)
    if not any("," in line for line in lines):
        raise EvidenceError(
            "neither JSON nor CSV: expected a PyTorch profiler trace or an "
            "Nsight Compute / Nsight Systems CSV export"
        )
    raise EvidenceError("CSV has none of the columns of an Nsight Compute or Nsight Systems export")


def _parse_table(fmt: _CsvFormat, header: list[str], lines: list[str]) -> _Profile:
    rows, skipped = _table_rows(header, lines, fmt.columns)
    if fmt is NCU_DETAILS:
        profile = _ncu_profile(rows)
    elif fmt is NSYS_KERNEL_SUMMARY:
        profile = _nsys_summary_profile(rows)
    else:
        profile = _nsys_trace_profile(rows)
    if skipped:
        profile.notes.append(f"skipped {skipped:,} lines that don't fit the {fmt.label} table")
    return profile


_Rows = list[tuple[int, dict[str, str]]]


def _table_rows(header: list[str], lines: list[str], needed: tuple[str, ...]) -> tuple[_Rows, int]:
    """Rows as (offset after the header, column -> cell). A row may be shorter than the
    header: ncu 2025 writes its metric rows with 16 cells under a 20-column header (the
    rule columns left off) and its rule rows whole, so a row is read when it reaches
    every column the format needs, its missing cells empty. Rows wider than the header
    or too short are counted, not read: the tools print lines of their own after it."""
    rows: _Rows = []
    skipped = 0
    reach = max(header.index(column) for column in needed) + 1
    for offset, cells in enumerate(csv.reader(lines)):
        if not any(cell.strip() for cell in cells):
            continue
        if not reach <= len(cells) <= len(header):
            skipped += 1
            continue
        padded = [cell.strip() for cell in cells] + [""] * (len(header) - len(cells))
        rows.append((offset, dict(zip(header, padded))))
    return rows, skipped


# Nsight Compute: metric names as the SpeedOfLight section prints them (current and
# older releases) and as raw metrics when exported with --metrics.
NCU_DURATION_METRICS = {"Duration", "gpu__time_duration.sum"}
NCU_COMPUTE_METRICS = {
    "Compute (SM) Throughput",
    "Compute (SM) [%]",
    "SM [%]",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
}
NCU_MEMORY_METRICS = {
    "Memory Throughput",
    "Memory [%]",
    "DRAM Throughput",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
}
# Memory Workload Analysis also reports a "Memory Throughput", in Gbyte/second: only
# percentages compare compute with memory.
PERCENT_UNIT = "%"
TIME_UNIT_US = {
    "nsecond": 1e-3, "ns": 1e-3,
    "usecond": 1.0, "us": 1.0,
    "msecond": 1e3, "ms": 1e3,
    "second": 1e6, "s": 1e6,
}


@dataclass
class _NcuLaunch:
    name: str
    duration_us: float | None = None
    compute_pct: float | None = None
    memory_pct: float | None = None

    def record(self, metric: str, unit: str, raw_value: str) -> None:
        value = _csv_number(raw_value)
        if value is None:
            return
        if metric in NCU_DURATION_METRICS:
            if unit not in TIME_UNIT_US:
                raise EvidenceError(
                    f"Duration of {_short(self.name)} is in an unknown unit {unit!r}"
                )
            self.duration_us = value * TIME_UNIT_US[unit]
        elif unit == PERCENT_UNIT and metric in NCU_COMPUTE_METRICS:
            self.compute_pct = value
        elif unit == PERCENT_UNIT and metric in NCU_MEMORY_METRICS:
            # Memory Throughput is already the busiest memory unit; DRAM only adds when alone.
            self.memory_pct = max(value, self.memory_pct or 0.0)


def _ncu_profile(rows: Iterable[tuple[int, dict[str, str]]]) -> _Profile:
    launches: dict[tuple[str, str], _NcuLaunch] = {}
    for _, row in rows:
        name = row["Kernel Name"]
        launch = launches.setdefault((row["ID"], name), _NcuLaunch(name))
        launch.record(row["Metric Name"], row["Metric Unit"], row["Metric Value"])
    if not launches:
        raise EvidenceError("Nsight Compute CSV has a header but no kernel launches")
    timed = [(l, l.duration_us) for l in launches.values() if l.duration_us is not None]
    if not timed:
        raise EvidenceError(
            "Nsight Compute CSV has no Duration metric: export it with "
            "`ncu --csv --page details` (the GPU Speed Of Light section)"
        )
    profile = _Profile("ncu-csv")
    for launch, duration_us in timed:
        profile.add(launch.name, duration_us)
        if launch.compute_pct is not None and launch.memory_pct is not None:
            profile.throughput.add(duration_us, launch.compute_pct, launch.memory_pct)
    if len(timed) < len(launches):
        profile.notes.append(
            f"{len(launches) - len(timed):,} launches without a Duration metric are left out"
        )
    return profile


def _nsys_summary_profile(rows: Iterable[tuple[int, dict[str, str]]]) -> _Profile:
    profile = _Profile("nsys-csv")
    for line, row in rows:
        total_ns = _required_number(row, "Total Time (ns)", line)
        profile.add(row["Name"], total_ns / 1000, int(_required_number(row, "Instances", line)))
    if not profile.kernels:
        raise EvidenceError("Nsight Systems CSV has a header but no kernels")
    return profile


def _nsys_trace_profile(rows: Iterable[tuple[int, dict[str, str]]]) -> _Profile:
    profile = _Profile("nsys-csv")
    for line, row in rows:
        start_us = _required_number(row, "Start (ns)", line) / 1000
        duration_us = _required_number(row, "Duration (ns)", line) / 1000
        profile.add(row["Name"], duration_us)
        profile.intervals.append((start_us, start_us + duration_us))
    if not profile.kernels:
        raise EvidenceError("Nsight Systems CSV has a header but no GPU operations")
    return profile


def _required_number(row: dict[str, str], column: str, line: int) -> float:
    value = _csv_number(row[column])
    if value is None:
        raise EvidenceError(
            f"row {line + 1:,} after the header: {column} is {row[column]!r}, not a number"
        )
    return value


# --- summary and bottleneck ------------------------------------------------------------


def _summarise(profile: _Profile) -> EvidenceSummary:
    total_us = sum(kernel.total_us for kernel in profile.kernels.values())
    if total_us <= 0:
        raise EvidenceError("the kernels in this file add up to 0 ms")
    ranked = sorted(profile.kernels.items(), key=lambda item: (-item[1].total_us, item[0]))
    notes = list(profile.notes)
    if len(ranked) > MAX_TOP_KERNELS:
        noun = "kernels" if profile.on_gpu else "operators"
        notes.append(
            f"showing the top {MAX_TOP_KERNELS} of {len(ranked):,} {noun}; "
            f"shares are of the time of all {len(ranked):,}"
        )
    bottleneck, reason = _classify(profile, total_us)
    return EvidenceSummary(
        format=profile.format,
        top_kernels=[
            KernelRow(
                name=name,
                total_ms=round(kernel.total_us / 1000, TOTAL_MS_DIGITS),
                calls=kernel.calls,
                share=round(kernel.total_us / total_us, SHARE_DIGITS),
            )
            for name, kernel in ranked[:MAX_TOP_KERNELS]
        ],
        bottleneck=bottleneck,
        reason=reason,
        notes=notes,
        total_ms=round(total_us / 1000, TOTAL_MS_DIGITS),
        kernel_count=len(ranked),
    )


def _classify(profile: _Profile, total_us: float) -> tuple[Bottleneck, str]:
    """Measured evidence first (launch pattern, then ncu throughput), names last."""
    if not profile.on_gpu:
        return "unknown", "no GPU kernels in this trace, so there is no GPU bottleneck to name"
    return (
        _launch_overhead(profile, total_us)
        or _throughput_bound(profile, total_us)
        or _bound_by_kernel_names(profile, total_us)
    )


def _launch_overhead(profile: _Profile, total_us: float) -> tuple[Bottleneck, str] | None:
    launches = profile.launches
    if launches < OVERHEAD_MIN_LAUNCHES:
        return None
    average_us = total_us / launches
    if average_us < SHORT_KERNEL_US:
        return "overhead", (
            f"{launches:,} launches averaging {average_us:.1f} µs: "
            "launch overhead rivals the kernels' own run time"
        )
    busy_us, span_us = _busy_and_span(profile.intervals)
    if span_us > 0 and busy_us / span_us < MIN_GPU_BUSY_FRACTION:
        return "overhead", (
            f"the GPU is busy only {busy_us / span_us:.0%} of the {span_us / 1000:.3g} ms "
            f"between its first and last kernel ({launches:,} launches): "
            "it idles between launches"
        )
    return None


def _busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """Time with at least one GPU operation running (streams overlap), and the whole span."""
    if not intervals:
        return 0.0, 0.0
    ordered = sorted(intervals)
    busy = 0.0
    run_start, run_end = ordered[0]
    for start, end in ordered[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    return busy, max(end for _, end in ordered) - ordered[0][0]


def _throughput_bound(profile: _Profile, total_us: float) -> tuple[Bottleneck, str] | None:
    measured = profile.throughput
    if measured.covered_us < MIN_THROUGHPUT_COVERAGE * total_us:
        return None
    compute = measured.compute_weighted / measured.covered_us
    memory = measured.memory_weighted / measured.covered_us
    if max(compute, memory) < LATENCY_BOUND_PCT:
        return "unknown", (
            f"kernels reach only {memory:.0f}% of memory and {compute:.0f}% of compute "
            "throughput: latency-bound, neither unit is the limit"
        )
    if memory >= compute:
        return "memory", (
            f"kernels run at {memory:.0f}% of memory throughput vs {compute:.0f}% "
            "of compute (time-weighted)"
        )
    return "compute", (
        f"kernels run at {compute:.0f}% of compute throughput vs {memory:.0f}% "
        "of memory (time-weighted)"
    )


# Matched against lower-cased kernel names, compute first: "gemm_relu" is a GEMM with
# a fused epilogue. The lookarounds keep "gamma" from reading as mma, "convert" as a
# convolution and "_mm_" apart from other words.
# Vendor families by prefix: cuBLASLt's Hopper GEMMs are `nvjet_sm90_…`, cuDNN's fused
# attention `cudnn_generated_fort_native_sdpa_…`, CUTLASS's `cutlass_…`/`cutlass::…`,
# DeepGEMM's `fp8_gemm`/`fp8_mqa_logits`, FlashMLA's `flash_mla`.
COMPUTE_KERNEL_PATTERN = re.compile(
    r"gemm|(?<![a-z])(?:wg|x|h|i|w)?mma|matmul|(?<![a-z])b?mm(?![a-z])|conv(?!ert)"
    r"|attention|attn|flash|fmha|sdpa|mqa_logits|(?<![a-z])mla(?![a-z])|triton_tem"
    r"|(?<![a-z])nvjet_|(?<![a-z])cutlass|(?<![a-z])cublas"
)
MEMORY_KERNEL_PATTERN = re.compile(
    r"elementwise|copy|memcpy|memset|reduce|reduction|norm|softmax|relu|gelu|silu"
    r"|(?<![a-z])cat|concat|index|gather|scatter|transpose|fill|topk|sort"
    r"|triton_(?:poi|red|per)_"
)


def _bound_by_kernel_names(profile: _Profile, total_us: float) -> tuple[Bottleneck, str]:
    compute_us = memory_us = 0.0
    for name, kernel in profile.kernels.items():
        lowered = name.lower()
        if COMPUTE_KERNEL_PATTERN.search(lowered):
            compute_us += kernel.total_us
        elif MEMORY_KERNEL_PATTERN.search(lowered):
            memory_us += kernel.total_us
    compute, memory = compute_us / total_us, memory_us / total_us
    if compute + memory < MIN_CLASSIFIED_SHARE:
        return "unknown", (
            f"kernel names tell compute from memory work for only {compute + memory:.0%} "
            "of the GPU time"
        )
    if compute > memory:
        return "compute", (
            f"{compute:.0%} of GPU time is in compute kernels by name (gemm, conv, attention) "
            f"vs {memory:.0%} in memory-bound ones"
        )
    return "memory", (
        f"{memory:.0%} of GPU time is in memory-bound kernels by name (elementwise, copy, "
        f"reduce, norm) vs {compute:.0%} in compute ones"
    )


# --- labels for charts --------------------------------------------------------------

LABEL_WIDTH = 56
# What a C++ kernel name carries that tells two kernels apart least: the return type,
# namespaces, parameter lists (the kernel's own and its lambdas'), lambda and operator
# scopes, std::array<char *, N> pointer packs and numeric template arguments.
_LABEL_NOISE = [
    # Lambda scopes as ncu (`::[lambda() (instance 3)]`) and c++filt (`::{lambda()#1}`)
    # print them, with the operator() they are called through.
    (re.compile(r"::\[lambda[^\]]*\]|::\{lambda[^}]*\}|::operator\s*\(\)\s*\(\)\s*const"), ""),
    (re.compile(r"(?<!\w)void\s+"), ""),
    (re.compile(r"\(anonymous namespace\)::|<unnamed>::"), ""),
    (re.compile(r"\([^()]*\)"), ""),
    (re.compile(r"(?<![\w:])(?:[A-Za-z_]\w*::)+"), ""),
    (re.compile(r",?\s*array<char\s*\*,\s*\d+\w*\s*>"), ""),
    (re.compile(r"(?<=<)-?\d+\w*,\s*|,\s*-?\d+\w*(?=\s*[,>])"), ""),
    (re.compile(r"\s+"), " "),
    (re.compile(r"\s+(?=[>,*])|(?<=<)\s+"), ""),
]


def kernel_label(name: str, width: int = LABEL_WIDTH) -> str:
    """A kernel's name short enough for a chart's axis, keeping what tells it apart:
    `void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<
    c10::BFloat16>, std::array<char*, 3ul> >(int, …)` reads `vectorized_elementwise_
    kernel<CUDAFunctor_add<BFloat16>>`. Past `width` the middle gives way, never the
    end (the template's last arguments are often what differs); labels may still
    coincide, so a chart keys its bars by the full name."""
    text = name.strip()
    # Innermost parentheses first, until none is left: lambdas nest their signatures.
    for pattern, replacement in _LABEL_NOISE:
        previous = None
        while previous != text:
            previous, text = text, pattern.sub(replacement, text)
    text = text.strip() or name.strip()
    if len(text) > width:
        text = _first_template_argument(text)
    if len(text) <= width:
        return text
    tail = width // 2
    return text[: width - tail - 1] + "…" + text[-tail:]


def _first_template_argument(text: str) -> str:
    """`kernel<A<x>, B, C>` -> `kernel<A<x>, …>`: the first argument is most often the
    functor or policy that tells one instantiation from another."""
    start = text.find("<")
    if start < 0 or not text.endswith(">"):
        return text
    depth = 0
    for index in range(start, len(text)):
        depth += {"<": 1, ">": -1}.get(text[index], 0)
        if depth == 1 and text[index] == ",":
            return text[:index] + ", …>"
    return text


# --- small helpers -------------------------------------------------------------------


def _json_number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _csv_number(text: str) -> float | None:
    """'1,234.56' -> 1234.56: ncu groups thousands; 'n/a' and friends -> None."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _format_size(size: int) -> str:
    for unit, scale in (("MB", 1024 * 1024), ("KB", 1024)):
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{size:,} bytes"


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"
