"""From timing samples to a claim: medians, confidence intervals, significance.

Medians, not means: one slow outlier (a page fault, a context switch) moves a mean
but not a median, and a time driven toward zero cannot collapse it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CONFIDENCE_Z = 1.96  # two-sided 95%
BOOTSTRAP_RESAMPLES = 1000
P_THRESHOLD = 0.01
# However quiet the measurement, an effect under half a percent is not called real.
MIN_EFFECT = 0.005
# However quiet a run's own A/A pair was, an effect under its device's floor is not
# called real. Two processes running the same code differ by their own luck (where their
# memory landed, what else ran on their cores), and one A/A pair is a single draw of that
# luck: a small draw cannot vouch for the next process. Each floor sits above the largest
# effect A/A evaluations showed on that kind of device (bench/aa_noise.py, figures in
# docs/benchmarks.md): on a shared 2-core virtual machine a process running the baseline
# landed up to 30% faster than the baseline's own two at T=512 and 4096, so no CPU effect
# under 50% is called real (the CPU checks kernels; GPUs decide speed); on an H200 the
# baseline's A/A effects stayed within 3%.
MIN_NOISE_FLOOR = {"cpu": 0.50, "cuda": MIN_EFFECT}
# The candidate against two pooled baseline processes differs by process luck alone with
# a spread ~0.87 times that of the A/A pair: 2.5 A/A spreads is about 2.9 standard
# deviations, a false call in ~0.2% of workloads.
RUN_SPREAD_FACTOR = 2.5


def median_ci(samples: Sequence[float]) -> tuple[float, float]:
    """Distribution-free 95% CI of the median from order statistics (no resampling)."""
    ordered = np.sort(np.asarray(samples, dtype=float))
    n = len(ordered)
    half_width = CONFIDENCE_Z * math.sqrt(n) / 2
    # Ranks floor((n - z√n) / 2) and ceil(1 + (n + z√n) / 2), counted from 1.
    low = max(0, math.floor(n / 2 - half_width) - 1)
    high = min(n - 1, math.ceil(n / 2 + half_width))
    return float(ordered[low]), float(ordered[high])


def median_ci_relative_width(samples: Sequence[float]) -> float:
    """Half the CI's width as a fraction of the median: 0.01 means ±1%."""
    low, high = median_ci(samples)
    median = float(np.median(samples))
    return (high - low) / 2 / median if median > 0 else math.inf


def median_ratio_ci(first: Sequence[float], second: Sequence[float]) -> tuple[float, float]:
    """A quick 95% CI of median(first) / median(second), for a stop rule checked every
    few rounds: each median's own CI (order statistics, two sorts, no resampling) taken
    on a log scale and their half-widths added in quadrature, the samples being
    independent. It tracks the bootstrap CI `compare` reports without its cost."""
    ratio = float(np.median(first)) / float(np.median(second))
    widths = []
    for samples in (first, second):
        low, high = median_ci(samples)
        if not low > 0:
            return 0.0, math.inf
        widths.append(math.log(high / low) / 2)
    half = math.hypot(*widths)
    return ratio * math.exp(-half), ratio * math.exp(half)


def cannot_be_significant(ci: tuple[float, float], floor: float) -> bool:
    """True when a speedup whose CI is `ci` lies inside the noise floor `floor` in both
    directions: `compare` would not call it significant, however it moved within."""
    low, high = ci
    return 1 / (1 + floor) < low and high < 1 + floor


@dataclass(frozen=True)
class NoiseFloor:
    """The A/A effect: the baseline against itself, in two processes of the same run."""

    speedup: float
    speedup_ci: tuple[float, float]
    floor: float


@dataclass(frozen=True)
class Comparison:
    baseline_ms: float
    candidate_ms: float
    speedup: float
    speedup_ci: tuple[float, float]
    p_value: float
    significant: bool
    baseline_ci_ms: tuple[float, float]
    candidate_ci_ms: tuple[float, float]


def _bootstrap_medians(samples: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    picks = rng.integers(0, len(samples), size=(BOOTSTRAP_RESAMPLES, len(samples)))
    return np.median(samples[picks], axis=1)


def _speedup_ci(base: np.ndarray, cand: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    ratios = _bootstrap_medians(base, rng) / _bootstrap_medians(cand, rng)
    low, high = (float(value) for value in np.percentile(ratios, [2.5, 97.5]))
    return low, high


def mann_whitney_p(first: np.ndarray, second: np.ndarray) -> float:
    """Two-sided Mann–Whitney U p-value, normal approximation with tie and continuity
    corrections: what scipy.stats.mannwhitneyu gives for samples of this size, without
    the second it takes to import scipy in every evaluation."""
    n1, n2 = len(first), len(second)
    combined = np.concatenate([first, second])
    values, inverse, counts = np.unique(combined, return_inverse=True, return_counts=True)
    # Average rank of each distinct value, ties sharing the mean of their positions.
    upper = np.cumsum(counts)
    ranks = (upper - (counts - 1) / 2)[inverse]
    u1 = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2
    n = n1 + n2
    tie_term = float((counts**3 - counts).sum()) / (n * (n - 1))
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term))
    if sigma == 0:
        return 1.0
    u = max(u1, n1 * n2 - u1)
    z = (u - n1 * n2 / 2 - 0.5) / sigma
    return min(1.0, math.erfc(z / math.sqrt(2)))


def noise_floors(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], *,
                 rngs: Sequence[np.random.Generator], minimum: float) -> list[NoiseFloor]:
    """How far apart two processes running the same code land here, per workload.

    Each workload's floor is its own A/A effect, |1 - A/A speedup| plus the half-width
    of its CI, never under `minimum` (the device's MIN_NOISE_FLOOR). One A/A pair is a
    single draw of how much a process's luck moves its times (up to 30% on a shared
    CPU), and a small draw would let a lucky candidate process through; so the
    floor is also never under RUN_SPREAD_FACTOR times the run's typical A/A effect, the
    root mean square over all its workloads.
    """
    found = []
    for (first, second), rng in zip(pairs, rngs, strict=True):
        a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
        speedup = float(np.median(a) / np.median(b))
        found.append((speedup, _speedup_ci(a, b, rng)))
    spread = math.sqrt(sum(math.log(speedup) ** 2 for speedup, _ in found) / len(found))
    return [
        NoiseFloor(speedup=speedup, speedup_ci=(low, high),
                   floor=max(minimum, abs(1 - speedup) + (high - low) / 2,
                             RUN_SPREAD_FACTOR * spread))
        for speedup, (low, high) in found
    ]


def compare(
    baseline: Sequence[float], candidate: Sequence[float], *, rng: np.random.Generator,
    noise: float,
) -> Comparison:
    """Speedup = baseline median / candidate median; `significant` means the difference is
    real in either direction: p < 0.01, the CI excludes 1, and the effect exceeds the
    noise floor measured by the A/A run: faster than 1 + floor, or slower by the same
    factor (a speedup under 1 / (1 + floor)), so a large floor cannot hide a slowdown
    that |speedup - 1|, at most 1 for any slowdown, would never exceed."""
    base = np.asarray(baseline, dtype=float)
    cand = np.asarray(candidate, dtype=float)
    speedup = float(np.median(base) / np.median(cand))
    low, high = _speedup_ci(base, cand, rng)
    p_value = mann_whitney_p(base, cand)
    excludes_one = low > 1 or high < 1
    return Comparison(
        baseline_ms=float(np.median(base)),
        candidate_ms=float(np.median(cand)),
        speedup=speedup,
        speedup_ci=(low, high),
        p_value=p_value,
        significant=p_value < P_THRESHOLD and excludes_one and abs(math.log(speedup)) > math.log1p(noise),
        baseline_ci_ms=median_ci(base),
        candidate_ci_ms=median_ci(cand),
    )


@dataclass(frozen=True)
class CombinedDelta:
    """The candidate's relative change over several points, as one figure."""

    baseline_ms: float
    candidate_ms: float
    delta: float  # candidate / baseline - 1: negative is faster
    delta_ci: tuple[float, float]
    p_value: float


def geometric_mean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(np.asarray(values, dtype=float)))))


def combined_delta(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], *,
                   rng: np.random.Generator) -> CombinedDelta:
    """(baseline, candidate) samples of each point combined by geometric mean: of the
    medians for the times, of the median ratios for the delta. The CI resamples every
    point at once (bootstrap); the p-value combines each point's two-sided Mann–Whitney
    p, signed by the direction of its effect, with Stouffer's method, so points that
    move the same way strengthen each other and opposite ones cancel."""
    bases = [np.asarray(base, dtype=float) for base, _ in pairs]
    cands = [np.asarray(cand, dtype=float) for _, cand in pairs]
    baseline_ms = geometric_mean([float(np.median(base)) for base in bases])
    candidate_ms = geometric_mean([float(np.median(cand)) for cand in cands])
    log_ratios = np.mean([np.log(_bootstrap_medians(cand, rng) / _bootstrap_medians(base, rng))
                          for base, cand in zip(bases, cands, strict=True)], axis=0)
    low, high = (float(math.expm1(value)) for value in np.percentile(log_ratios, [2.5, 97.5]))
    normal = NormalDist()
    scores = []
    for base, cand in zip(bases, cands, strict=True):
        p = min(1.0, max(mann_whitney_p(base, cand), 1e-300))
        sign = math.copysign(1.0, float(np.median(cand) - np.median(base)))
        scores.append(sign * normal.inv_cdf(1 - p / 2))
    combined = sum(scores) / math.sqrt(len(scores))
    return CombinedDelta(baseline_ms=baseline_ms, candidate_ms=candidate_ms,
                         delta=candidate_ms / baseline_ms - 1, delta_ci=(low, high),
                         p_value=min(1.0, math.erfc(abs(combined) / math.sqrt(2))))
