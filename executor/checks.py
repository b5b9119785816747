"""Workloads, the demos' engine settings, and the checks every run must pass: output equivalence against the
oracle, and no leaked block.

Used by `kvstate demo`, `kvstate soak`, `python -m executor.pipeline` and the tests. Every workload is seeded.

Output equivalence per dtype (`compare_outputs`, the one implementation of the rule): an output must equal its
unpressured reference token for token. In float64 and float32 that is exact, with no exception (a pressured run
changes which requests share a batch and how a prompt is chunked, which moves logits by float rounding only, far
below the smallest gap between the top two logits the tests have seen). In bfloat16 and float16 the same rounding is
large enough to flip a near-tie, so a divergence is accepted only where it is one: at the first position where a
greedy output leaves its reference, the reference's top-2 logit gap and the chosen token's distance below the
reference's best logit are both at most `GAP_TOLERANCE[dtype]` (logits of the dense forward of the reference's own
prefix). Everything after an accepted divergence is a different, equally valid continuation and is not compared.
Accepted divergences are reported, never hidden; a sampled request, or a divergence where the reference was not near
a tie, is a mismatch in every dtype.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from executor.engine import Engine
from executor.engine_config import EngineConfig, offload_spec
from executor.model import LlamaModel, ModelConfig
from executor.sampler import GREEDY, SamplingParams
from kvstate.config import SchedulerConfig

DEMO_PROMPT_LEN = (8, 96)  # the demo workload's prompt lengths (single process and pipeline)
DEMO_MAX_NEW_TOKENS = (8, 64)


def demo_model(hidden_size: int) -> ModelConfig:
    """The demos' seeded model at width `hidden_size` (a positive multiple of 8): the default architecture (2
    layers, 4 attention heads, 2 key/value heads) with heads of `hidden_size / 4` and an MLP twice as wide. At 64 it
    is `ModelConfig()`. Raises `ValueError` for any other width."""
    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size <= 0 or hidden_size % 8:
        raise ValueError(f"the demo model's hidden size must be a positive multiple of 8, got {hidden_size!r}")
    return ModelConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, head_dim=hidden_size // 4)


def demo_engine_config(  # noqa: PLR0913 - keyword-only: one per demo option
    *,
    gpu_blocks: int,
    host_blocks: int,
    block_size: int,
    chunk_size: int,
    hidden_size: int,
    seed: int,
    device: str,
    dtype: str,
    trace: str | Path | None,
    lifecycle: str = "machine",
    offload: str | None = None,
    **settings: Any,
) -> EngineConfig:
    """The engine configuration of a demo run (`kvstate demo`, with or without `--pp`, and `python -m
    executor.pipeline`): prefill chunks of `chunk_size`, at least 256 tokens a pass, `demo_model(hidden_size)` with
    weights, workload and sampling all seeded by `seed`, the spec with offload policy `offload` (None: the spec's
    own); `settings` are further `EngineConfig` fields."""
    scheduler = SchedulerConfig(
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        block_size=block_size,
        prefill_chunk_size=chunk_size,
        max_num_tokens=max(256, chunk_size),
        lifecycle=lifecycle,
    )
    return EngineConfig(
        scheduler=scheduler,
        model=demo_model(hidden_size),
        device=device,
        dtype=dtype,
        seed=seed,
        weights_seed=seed,
        trace_path=trace,
        spec=None if offload is None else offload_spec(offload),
        **settings,
    )


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB, one decimal above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def random_workload(
    count: int,
    seed: int,
    prompt_len: tuple[int, int],
    new_tokens: tuple[int, int],
    *,
    vocab: int = 512,
    max_tokens: int | None = None,
) -> list[tuple[list[int], int]]:
    """`count` (prompt, max_new_tokens) pairs with lengths drawn uniformly from the inclusive ranges; with
    `max_tokens`, each pair is clipped so prompt + max_new_tokens <= max_tokens (it fits the GPU tier alone)."""
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        prompt, new = rng.randint(*prompt_len), rng.randint(*new_tokens)
        if max_tokens is not None and prompt + new > max_tokens:
            prompt = max(1, min(prompt, max_tokens // 2))
            new = max(1, max_tokens - prompt)
        work.append(([rng.randrange(vocab) for _ in range(prompt)], new))
    return work


def submit_all(engine: Engine, work: list[tuple[list[int], int]], sampling: SamplingParams = GREEDY) -> list[Hashable]:
    """Submit every pair of `work` with `sampling`; returns the request ids in order."""
    return [engine.add_request(prompt, new, sampling=sampling) for prompt, new in work]


# The largest top-2 logit gap of the reference at which a lower-precision run may pick the other token (module
# docstring). Exact (0) in float64 and float32. A flip needs a gap no larger than the two tokens' drifts together
# (a logit's drift: how far the paged batched path moves it from the dense one), so each tolerance is about three
# times the largest two drifts seen on the CPU over mixed prefill chunks and decodes in that dtype.
GAP_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 0.0,
    torch.float32: 0.0,
    torch.bfloat16: 0.25,
    torch.float16: 0.03125,
}


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where an output first leaves its reference: the index in the generated tokens, both tokens, the
    reference's top-2 logit gap there and how far the output's token is below the reference's best logit."""

    request_id: Hashable
    position: int
    token: int
    reference_token: int
    gap: float
    below_best: float


@dataclass(frozen=True)
class Comparison:
    """The verdict of `compare_outputs`: `mismatches` {id: (output, reference)} break the rule, `accepted`
    divergences are within the dtype's tolerance (reported), `compared` outputs were looked at."""

    dtype: torch.dtype
    tolerance: float
    compared: int
    mismatches: dict[Hashable, tuple[list[int], list[int]]] = field(default_factory=dict)
    accepted: tuple[Divergence, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        """One line: how many outputs were compared, differ, and diverged within the tolerance."""
        name = str(self.dtype).removeprefix("torch.")
        text = f"{self.compared} outputs compared ({name}), {len(self.mismatches)} differ"
        if self.accepted:
            text += (
                f", {len(self.accepted)} diverge at a near-tie of the reference (top-2 logit gap <= "
                f"{self.tolerance}, largest {max(d.gap for d in self.accepted):.3g}): accepted in {name}"
            )
        return text


@dataclass(frozen=True, slots=True)
class Compared:
    """One output to check: its reference, the prompt both continue, whether it may be a prefix of the
    reference (a cancelled request) and whether it decodes greedily (only greedy divergences can be accepted)."""

    request_id: Hashable
    output: list[int]
    reference: list[int]
    prompt: Sequence[int]
    partial: bool = False
    greedy: bool = True


def compare_outputs(model: LlamaModel, items: Iterable[Compared], *, tolerance: float | None = None) -> Comparison:
    """Apply the per-dtype rule (module docstring) to every item; `tolerance` overrides `GAP_TOLERANCE`."""
    tol = GAP_TOLERANCE[model.dtype] if tolerance is None else tolerance
    mismatched, accepted, compared = {}, [], 0
    for item in items:
        compared += 1
        out, ref = list(item.output), list(item.reference)
        common = min(len(out), len(ref))
        k = next((i for i in range(common) if out[i] != ref[i]), None)
        if k is None:
            if len(out) != len(ref) and not (item.partial and len(out) < len(ref)):
                mismatched[item.request_id] = (out, ref)
            continue
        divergence = _divergence(model, item, k) if tol > 0 and item.greedy else None
        if divergence is not None and divergence.gap <= tol and divergence.below_best <= tol:
            accepted.append(divergence)
        else:
            mismatched[item.request_id] = (out, ref)
    return Comparison(model.dtype, tol, compared, mismatched, tuple(accepted))


def _divergence(model: LlamaModel, item: Compared, k: int) -> Divergence:
    logits = model.forward_dense(list(item.prompt) + item.reference[:k])[-1].double()
    top = torch.topk(logits, 2).values
    best = float(top[0])
    return Divergence(
        item.request_id,
        k,
        item.output[k],
        item.reference[k],
        best - float(top[1]),
        best - float(logits[item.output[k]]),
    )


def compare(engine: Engine, outputs: dict[Hashable, list[int]] | None = None) -> Comparison:
    """`compare_outputs` of every request of `engine` that finished by budget or stop token against
    `Engine.reference` (cancelled and aborted requests are skipped: their output is partial)."""
    outputs = engine.outputs() if outputs is None else outputs
    finished = [rid for rid, r in engine.scheduler.finished.items() if r.done_reason == "finished"]
    references = engine.reference_outputs(finished)
    submissions = dict(engine._submitted(finished))
    items = (
        Compared(rid, outputs.get(rid, []), ref, submissions[rid].prompt, greedy=submissions[rid].sampling.greedy)
        for rid, ref in references.items()
    )
    return compare_outputs(engine.model, items)


def mismatches(
    engine: Engine, outputs: dict[Hashable, list[int]] | None = None
) -> dict[Hashable, tuple[list[int], list[int]]]:
    """{id: (output, reference)} for every finished request whose output breaks the per-dtype rule against
    `Engine.reference` (`compare`; exact equality in float64 and float32)."""
    return compare(engine, outputs).mismatches


def leaked_blocks(engine: Engine) -> int:
    """Blocks of either tier not free once no request is active (0 after a clean run), plus in-flight copies."""
    usage = engine.scheduler.pool.usage()
    return (
        (usage["gpu_capacity"] - usage["gpu_free"])
        + (usage["host_capacity"] - usage["host_free"])
        + len(engine.scheduler.pool.in_flight)
    )
