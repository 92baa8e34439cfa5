"""What an evaluation reports: the JSON of CONTRACTS §4, extended."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "warn", "fail"]
Verdict = Literal["win", "no-gain", "rejected"]
# The evaluation's stages, cheapest first (runners.harness.evaluate): once a guard has
# failed, the later ones are skipped.
Stage = Literal["static", "load", "first-check", "correctness", "timing", "end-to-end"]


@dataclass
class Guard:
    name: str
    status: Status
    detail: str


@dataclass
class WorkloadResult:
    name: str
    baseline_ms: float | None = None
    candidate_ms: float | None = None
    speedup: float | None = None
    significant: bool = False
    speedup_ci: list[float] | None = None
    p_value: float | None = None
    samples: int | None = None
    baseline_ci_ms: list[float] | None = None
    candidate_ci_ms: list[float] | None = None
    # The A/A effect between the two baseline processes of this run, and the smallest
    # speedup (as |speedup - 1|) that counts as real here because of it.
    aa_speedup: float | None = None
    noise_floor: float | None = None
    # On the judge's clock, how much longer than reported the candidate's requests took
    # (median), and the baseline processes' ones: the harness's own cost around a request.
    overhead_ms: float | None = None
    baseline_overhead_ms: float | None = None
    # The clock check's own figure (measure.clock_excess): how much longer than the
    # baselines' the candidate's calls took beyond their reported times, at the least;
    # it fails above clock_margin_ms.
    clock_excess_ms: float | None = None
    clock_margin_ms: float | None = None
    # How many calls each timed request ran (runners.harness.measure): the clock check's
    # figures and the overheads are per request, the times per call.
    calls_per_request: int | None = None
    # The physical floor of one call on this hardware, and the fraction of it reached.
    floor_ms: float | None = None
    roofline_fraction: float | None = None
    # The first call at a new shape beside this workload (runners.harness.new_shapes):
    # its name, and what that call cost the candidate and the baseline on the judge's
    # clock, preparing included.
    first_call_shape: str | None = None
    first_call_ms: float | None = None
    first_call_baseline_ms: float | None = None


@dataclass
class EvaluationResult:
    op: str
    device: str
    verdict: Verdict
    correct: bool
    guards: list[Guard] = field(default_factory=list)
    workloads: list[WorkloadResult] = field(default_factory=list)
    # The end-to-end check (runners.harness.endtoend): baseline_ms, candidate_ms and
    # delta_pct (CONTRACTS §4), plus delta_ci_pct, p_value, headline, points and graphs;
    # None when the candidate was rejected before it ran or the op is not in the step.
    # With a declared end-to-end command (runners.harness.e2e_command), its report is
    # under "command": alone when the op is not in the step.
    # dispatch is the range where the candidate wins.
    e2e: dict[str, Any] | None = None
    dispatch: dict[str, Any] | None = None
    candidate: str = ""
    dsl: str = "torch"
    params: dict[str, Any] | None = None
    threads: int | None = None
    # False where times say nothing about the hardware (Triton's CPU interpreter):
    # they are reported, but never make a win.
    timing_meaningful: bool = True
    # The secret seed, revealed only once the run is over, so a run can be repeated.
    seed: int | None = None
    error: str | None = None
    # The stage a rejected candidate was stopped at (a Stage; None for a candidate
    # that was not rejected): every stage after it was skipped, and `error` says why.
    stopped_at: Stage | None = None
    duration_s: float | None = None
    # The machine and its settings (runners.harness.machine), as the harness read them.
    machine: dict[str, Any] | None = None
    # The shared code the candidate ran with (runners.harness.imports): each file's path
    # in the lib folder and the sha256 of the bytes its process imported.
    lib_files: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    """NaN and infinity are not JSON: an impossible number is reported as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
