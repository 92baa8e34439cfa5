"""The dispatch range: the contiguous sizes where a candidate wins."""

from __future__ import annotations

from runners.harness.dispatch import SizedResult, dispatch_range, size_axis

K = 1024


def _results(*rows):
    return [SizedResult(size, speedup, significant) for size, speedup, significant in rows]


def test_a_kernel_that_wins_short_contexts_and_loses_long_ones_gets_the_short_range():
    found = dispatch_range("context_length", _results(
        (4 * K, 1.3, True), (32 * K, 1.2, True), (96 * K, 1.1, True), (128 * K, 0.9, True), (256 * K, 0.8, True),
    ))
    assert (found["min"], found["max"]) == (4 * K, 96 * K) and not found["covers_all"]
    assert found["summary"] == "candidate for context length 4K–96K, kept kernel beyond 96K"


def test_a_size_significantly_slower_at_any_batch_is_not_won():
    found = dispatch_range("context_length", _results(
        (4 * K, 1.3, True), (8 * K, 1.4, True), (8 * K, 0.95, True), (16 * K, 1.2, True), (32 * K, 1.2, True),
    ))
    assert found["sizes"] == [16 * K, 32 * K]
    assert found["summary"] == ("candidate for context length 16K–32K, kept kernel below 16K, "
                                "kept kernel beyond 32K, where nothing was measured")


def test_noise_wins_nowhere():
    assert dispatch_range("tokens", _results((64, 1.01, False), (4096, 0.99, False))) is None


def test_a_win_everywhere_covers_all():
    found = dispatch_range("tokens", _results((64, 1.2, True), (4096, 1.1, False), (4096, 1.3, True)))
    assert found["covers_all"] and found["summary"] == ("candidate at every measured tokens (64–4K), kept kernel beyond 4K, "
                                                        "where nothing was measured")


def test_the_size_axis_is_read_from_the_workload():
    assert size_axis({"context_length": 8192, "batch": 4}) == "context_length"
    assert size_axis({"tokens": 512, "dtype": "float32"}) == "tokens"
    assert size_axis({"m": 3}) is None
