"""Side-by-side timing: every variant of a figure runs in the same loop, interleaved, and we keep medians.

The machines these benchmarks run on are shared and noisy, so a figure is never an absolute time compared with
a number measured elsewhere: it is a ratio of medians of variants that took turns in one loop. The order of the
variants is reshuffled every round (seeded), so a slow spell longer than a round hits all of them alike; one
shorter than a round does not, and `round_ratios` shows how far that reaches.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping


def interleaved(
    variants: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    seed: int = 0,
    setup: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each variant over `repeats` rounds (after `warmup` untimed rounds).

    Each round runs every variant once, in an order shuffled with `random.Random(seed)`. `setup[name]`, when
    given, runs untimed right before that variant's call (e.g. to restore the state it consumes).
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    rng = random.Random(seed)
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    setup = setup or {}
    for round_ in range(warmup + repeats):
        rng.shuffle(names)
        for name in names:
            if name in setup:
                setup[name]()
            start = time.perf_counter()
            variants[name]()
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                samples[name].append(elapsed)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def round_ratios(baseline: list[float], variant: list[float]) -> list[float]:
    """``baseline[i] / variant[i]`` for each round i of `interleaved` (seconds of the same round): how many times
    faster the variant ran in each round. Their spread shows how far the machine's noise reaches into a ratio of
    medians; a slow spell shorter than a round hits only the variants that ran during it."""
    if len(baseline) != len(variant):
        raise ValueError(f"one sample per round on both sides, got {len(baseline)} and {len(variant)}")
    return [b / v for b, v in zip(baseline, variant, strict=True)]


def medians(samples: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}
