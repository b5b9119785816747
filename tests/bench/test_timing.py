"""`executor.bench.timing`: per-round ratios of interleaved samples."""

from __future__ import annotations

import pytest

from executor.bench.timing import round_ratios


def test_round_ratios_pair_the_samples_of_each_round() -> None:
    baseline, variant = [2.0, 3.0, 1.0], [1.0, 3.0, 4.0]
    assert round_ratios(baseline, variant) == [2.0, 1.0, 0.25]
    with pytest.raises(ValueError, match="one sample per round"):
        round_ratios(baseline, variant[:2])
