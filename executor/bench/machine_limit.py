"""The decode limit of the machine a benchmark runs on, measured in the same run: what a model's decode step
would cost if it were only its matrix products.

At batch size B a decode step multiplies B rows through every weight matrix once (each linear layer of every
layer, and the vocabulary projection: `lm_head`, or the embedding when they are tied). The limit times exactly
that: as many matrices of each shape as the model has, so as many bytes as its weights, each shape's matrices
multiplied in turn by `torch.nn.functional.linear` with the CPU caches evicted before each timed sample, since a
real step finds no weight of an earlier step in them when the weights outgrow the caches. Each shape is timed
with its weights row-major and column-major (as `executor.model` keeps them), and the faster counts: the limit is
the machine's, not one layout's. So

    limit tokens/s = B / (the seconds of one step's matrix products, from memory).

It runs on the caller's torch threads (the bench sets one) and, on the CPU, is timed in this thread's CPU time,
as the decode rows are. Attention over the KV cache, norms, rotary embeddings and sampling are left out, so the
limit is optimistic: a real step costs more. The rates it implies (weight bytes and operations per second) are
printed beside it.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PRODUCT_REPEATS = 3


@dataclass(frozen=True)
class MachineLimit:
    """The decode limit at one batch size: the measured seconds of one step's matrix products
    (`products_seconds`), with the weight bytes and operations they are made of."""

    batch: int
    weight_bytes: int
    flops_per_step: float
    products_seconds: float

    @property
    def step_seconds(self) -> float:
        """The least a step can take: its matrix products alone."""
        return self.products_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_seconds

    def share(self, tokens_per_s: float) -> float:
        """Which fraction of the limit `tokens_per_s` reaches."""
        return tokens_per_s / self.tokens_per_s

    def describe(self, tokens_per_s: float) -> str:
        return (
            f"limit {self.tokens_per_s:,.0f} tok/s (the step's matrix products alone: weights "
            f"{self.weight_bytes / 1e6:,.0f} MB from memory at {self.weight_bytes / self.step_seconds / 1e9:.1f} "
            f"GB/s, {self.flops_per_step / self.step_seconds / 1e9:.1f} GFLOP/s): {self.share(tokens_per_s):.0%} of it"
        )

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "weight_bytes": self.weight_bytes,
            "flops_per_step": self.flops_per_step,
            "products_seconds": self.products_seconds,
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


def measure_products(batch: int, shapes: Mapping[tuple[int, int], int], device, dtype, *, seed: int = 0) -> float:
    """Seconds of one step's matrix products at batch `batch`: for each of `shapes` (in_features, out_features),
    its `count` matrices (seeded random operands in `dtype` on `device`) multiplied in turn, timed with the caches
    evicted before each sample, with the weights row-major and column-major; each shape's faster median counts."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    seconds = 0.0
    for (fan_in, fan_out), count in shapes.items():
        rows = torch.randn(batch, fan_in, generator=generator).to(device=device, dtype=dtype)
        weight = torch.randn(fan_out, fan_in, generator=generator).to(device=device, dtype=dtype)
        layouts = []
        for layout in (lambda w: w.clone(), lambda w: w.t().contiguous().t()):
            weights = [layout(weight) for _ in range(count)]

            def run(rows=rows, weights=weights) -> None:
                for stored in weights:
                    torch.nn.functional.linear(rows, stored)

            layouts.append(statistics.median(_timed(run, device, repeats=PRODUCT_REPEATS)))
            del weights
        seconds += min(layouts)
    return seconds


def measure_limit(model, batch: int, *, seed: int = 0) -> MachineLimit:
    """`model`'s decode limit at `batch` on its own device and dtype."""
    weight = model.embed_tokens.weight
    shapes = weight_shapes(model)
    parameters = parameters_per_token(shapes)
    return MachineLimit(
        batch=batch,
        weight_bytes=parameters * weight.element_size(),
        flops_per_step=flops_per_step(batch, parameters),
        products_seconds=measure_products(batch, shapes, weight.device, weight.dtype, seed=seed),
    )


def _timed(call: Callable[[], object], device, *, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls after one warmup, the caches evicted before each (`evict_caches`): this
    thread's CPU time on the CPU, wall time with the device synchronized elsewhere."""
    import torch

    from executor.bench.stepping import evict_caches

    on_cpu = torch.device(device).type == "cpu"
    clock = time.thread_time if on_cpu else time.perf_counter
    sync = (lambda: None) if on_cpu else torch.cuda.synchronize
    call()
    sync()
    seconds = []
    for _ in range(repeats):
        evict_caches()
        start = clock()
        call()
        sync()
        seconds.append(clock() - start)
    return seconds


__all__ = [
    "MachineLimit",
    "flops_per_step",
    "measure_limit",
    "measure_products",
    "parameters_per_token",
    "weight_shapes",
]
