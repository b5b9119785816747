"""The decode limit of the machine a benchmark runs on, measured in the same run: what a model's decode step
would cost if it were only its weights read from memory or only its matrix products.

At batch size B a decode step reads every weight matrix once (each linear layer of every layer, and the
vocabulary projection: `lm_head`, or the embedding when they are tied) and multiplies B rows through each of
them: 2 * B * (their parameter count) floating-point operations. The step cannot take less than the slower of
(a) its weight bytes at the memory bandwidth and (b) those operations at the matmul throughput, so

    limit tokens/s = B / max(weight_bytes / bandwidth, flops_per_step / matmul_flops_per_s).

Bandwidth is a large tensor copy (bytes read and written per second, median of repeats); matmul throughput is
`torch.nn.functional.linear` at the model's own shapes and batch size, each shape weighted by how often a step
uses it, with the weight stored whichever way (row-major, or column-major as `executor.model` keeps it) the
product runs faster at that shape: the limit is the machine's, not one layout's. Both run on the caller's
torch threads (the bench sets one) and, on the CPU, are timed in this thread's CPU time, as the decode rows are.
Attention over the KV cache, norms, rotary embeddings and sampling are left out, so the limit is optimistic: a
real step costs more.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

COPY_ELEMENTS = 1 << 25  # float32: 128 MiB per side, far beyond the caches
COPY_REPEATS = 5
MATMUL_REPEATS = 3
MATMUL_FLOPS_PER_SAMPLE = 2e8  # each timed sample runs a shape this many operations' worth of times (at least once)


@dataclass(frozen=True)
class MachineLimit:
    """The decode limit at one batch size, with the measured figures it is made of."""

    batch: int
    weight_bytes: int
    flops_per_step: float
    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float

    @property
    def step_seconds(self) -> float:
        """The least a step can take: the slower of reading the weights and multiplying through them."""
        return max(self.weight_bytes / self.bandwidth_bytes_per_s, self.flops_per_step / self.matmul_flops_per_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_seconds

    def share(self, tokens_per_s: float) -> float:
        """Which fraction of the limit `tokens_per_s` reaches."""
        return tokens_per_s / self.tokens_per_s

    def describe(self, tokens_per_s: float) -> str:
        return (
            f"limit {self.tokens_per_s:,.0f} tok/s (weights {self.weight_bytes / 1e6:,.0f} MB at "
            f"{self.bandwidth_bytes_per_s / 1e9:.1f} GB/s, matmul {self.matmul_flops_per_s / 1e9:.1f} GFLOP/s): "
            f"{self.share(tokens_per_s):.0%} of it"
        )

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "weight_bytes": self.weight_bytes,
            "flops_per_step": self.flops_per_step,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "tokens_per_s": self.tokens_per_s,
        }


def weight_shapes(model) -> Counter[tuple[int, int]]:
    """How many weight matrices of each (in_features, out_features) a decode step multiplies through: every
    `nn.Linear` of `model`, plus the embedding when `model.lm_head` is None (tied to the vocabulary projection)."""
    from torch import nn

    shapes: Counter[tuple[int, int]] = Counter(
        (m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)
    )
    if hasattr(model, "lm_head") and model.lm_head is None:
        vocab, hidden = model.embed_tokens.weight.shape
        shapes[(hidden, vocab)] += 1
    return shapes


def parameters_per_token(shapes: Mapping[tuple[int, int], int]) -> int:
    """Weight parameters a token is multiplied through: the sum of every matrix's in * out."""
    return sum(count * fan_in * fan_out for (fan_in, fan_out), count in shapes.items())


def flops_per_step(batch: int, parameters: int) -> float:
    """Multiply-adds of B rows through `parameters` weights, counted as two operations each."""
    return 2.0 * batch * parameters


def copy_bandwidth(nbytes: int, seconds: list[float]) -> float:
    """Bytes per second of copying `nbytes` (read once, written once), from the median of `seconds`."""
    return 2 * nbytes / statistics.median(seconds)


def weighted_flops_per_s(
    batch: int, shapes: Mapping[tuple[int, int], int], seconds_per_call: Mapping[tuple[int, int], float]
) -> float:
    """Operations per second of one step's matrix products: every shape's operations, `count` times, over the
    time those calls take at the measured seconds per call."""
    flops = sum(count * flops_per_step(batch, a * b) for (a, b), count in shapes.items())
    seconds = sum(count * seconds_per_call[shape] for shape, count in shapes.items())
    return flops / seconds


def measure_bandwidth(device, *, elements: int = COPY_ELEMENTS, repeats: int = COPY_REPEATS) -> float:
    """Bytes per second of `elements` float32 copied on `device` (median of `repeats`, after one warmup)."""
    import torch

    source = torch.ones(elements, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = _timed(lambda: target.copy_(source), device, repeats=repeats)
    return copy_bandwidth(source.numel() * source.element_size(), seconds)


def measure_matmul(batch: int, shapes: Mapping[tuple[int, int], int], device, dtype, *, seed: int = 0) -> float:
    """Operations per second of `torch.nn.functional.linear` at batch `batch` and each of `shapes` (seeded random
    operands in `dtype` on `device`), weighted by how often a step uses each shape; each shape is timed with its
    weight row-major and column-major, and the faster counts."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    seconds_per_call = {}
    for fan_in, fan_out in shapes:
        rows = torch.randn(batch, fan_in, generator=generator).to(device=device, dtype=dtype)
        weight = torch.randn(fan_out, fan_in, generator=generator).to(device=device, dtype=dtype)
        calls = max(1, round(MATMUL_FLOPS_PER_SAMPLE / flops_per_step(batch, fan_in * fan_out)))
        layouts = []
        for stored in (weight, weight.t().contiguous().t()):

            def run(rows=rows, weight=stored, calls=calls) -> None:
                for _ in range(calls):
                    torch.nn.functional.linear(rows, weight)

            layouts.append(statistics.median(_timed(run, device, repeats=MATMUL_REPEATS)) / calls)
        seconds_per_call[(fan_in, fan_out)] = min(layouts)
    return weighted_flops_per_s(batch, shapes, seconds_per_call)


def measure_limit(model, batch: int, *, bandwidth: float | None = None, seed: int = 0) -> MachineLimit:
    """`model`'s decode limit at `batch` on its own device and dtype; `bandwidth` reuses one already measured."""
    weight = model.embed_tokens.weight
    shapes = weight_shapes(model)
    parameters = parameters_per_token(shapes)
    return MachineLimit(
        batch=batch,
        weight_bytes=parameters * weight.element_size(),
        flops_per_step=flops_per_step(batch, parameters),
        bandwidth_bytes_per_s=bandwidth if bandwidth is not None else measure_bandwidth(weight.device),
        matmul_flops_per_s=measure_matmul(batch, shapes, weight.device, weight.dtype, seed=seed),
    )


def _timed(call: Callable[[], object], device, *, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls after one warmup: this thread's CPU time on the CPU, wall time with
    the device synchronized elsewhere."""
    import torch

    on_cpu = torch.device(device).type == "cpu"
    clock = time.thread_time if on_cpu else time.perf_counter
    sync = (lambda: None) if on_cpu else torch.cuda.synchronize
    call()
    sync()
    seconds = []
    for _ in range(repeats):
        start = clock()
        call()
        sync()
        seconds.append(clock() - start)
    return seconds


__all__ = [
    "MachineLimit",
    "copy_bandwidth",
    "flops_per_step",
    "measure_bandwidth",
    "measure_limit",
    "measure_matmul",
    "parameters_per_token",
    "weight_shapes",
    "weighted_flops_per_s",
]
