"""Configuration values of the pipeline-parallel runtime: what to run, on how many stages, and test hooks.

Invariants kept:
* every value is frozen: a `PipelineConfig` is pickled to every spawned rank and must mean the same there;
* `stage_layers(num_layers, stages)` splits the decoder into contiguous, non-empty, balanced slices that cover
  every layer exactly once, in order (stage 0 holds the first layers and the embedding, the last stage the final
  norm, the LM head and the sampler).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from executor.engine_config import EngineConfig
from executor.sampler import GREEDY, SamplingParams

MIN_TIMEOUT_S = 1.0  # the least `PipelineConfig.timeout_s`: the ranks and their store need this long to meet
MAX_TIMEOUT_S = 86_400.0  # the most: one day


class PipelineConfigError(ValueError):
    """A pipeline setting is out of range; the message names it and what to change."""


@dataclass(frozen=True)
class PipelineRequest:
    """One request of a pipeline run. `request_id` None takes its index in the submitted list."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = GREEDY
    request_id: Hashable | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def as_requests(requests: Sequence[PipelineRequest | tuple]) -> tuple[PipelineRequest, ...]:
    """Normalise `(prompt, max_new_tokens)` pairs or `PipelineRequest`s, filling ids by position; ids are unique."""
    normalised: list[PipelineRequest] = []
    for index, item in enumerate(requests):
        request = item if isinstance(item, PipelineRequest) else PipelineRequest(tuple(item[0]), int(item[1]))
        if request.request_id is None:
            request = PipelineRequest(
                request.prompt, request.max_new_tokens, request.stop_token_ids, request.sampling, index
            )
        normalised.append(request)
    ids = [r.request_id for r in normalised]
    if len(set(ids)) != len(ids):
        raise PipelineConfigError(f"request ids must be unique, got {ids}; pass distinct request_id values")
    return tuple(normalised)


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline run: the engine settings every stage shares, plus pipeline-only settings and test hooks.

    * `engine`: model, weights seed, dtype, device, pool sizes, budgets and sampling seed (as for `Engine`);
      its `trace_path`, if set, is rank 0's trace; rank r > 0 writes `trace_path_for(r)`.
    * `backend`: "auto" (NCCL on CUDA, gloo on the CPU), "gloo" or "nccl" (`executor.pipeline.devices`).
    * `micro_batches`: how many scheduler outputs may be in flight in the pipeline at once (rank 0 schedules the
      next while later stages compute earlier ones); None = one per stage, as pipeline engines run; 1 = lockstep
      (every stage waits for the last before the next pass).
    * `timeout_s`: bound of every wait on a peer (each collective, joining the group; `run_pipeline` also
      fails a rank stopped that long), so a dead or stopped rank fails the run instead of hanging it; from
      `MIN_TIMEOUT_S` (below it, the ranks cannot even meet) to `MAX_TIMEOUT_S` (a day: torch's timers overflow
      far above it, and a run should never wait that long on a peer).
    * `fail_host_tier_on_ranks`: ranks whose host-tier allocation is forced to fail (tests; PP-FALLBACK).
    * `ack_delay`: ((rank, iterations), ...): that rank acknowledges a pause this many iterations late (a slow
      stage; tests that nothing resets before every stage acknowledged).
    * `cancel_awaiting`: rank 0 cancels the first this-many requests that enter `awaiting_consensus`, while they
      still await it (tests PP-TERMINATE: consensus must then terminate them, not replay them).
    * `max_iterations`: rank 0 stops every rank with an error after this many iterations (no silent livelock).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: str = "auto"
    micro_batches: int | None = None
    timeout_s: float = 120.0
    fail_host_tier_on_ranks: frozenset[int] = frozenset()
    ack_delay: tuple[tuple[int, int], ...] = ()
    cancel_awaiting: int = 0
    max_iterations: int = 100_000

    def __post_init__(self) -> None:
        object.__setattr__(self, "fail_host_tier_on_ranks", frozenset(self.fail_host_tier_on_ranks))
        object.__setattr__(self, "ack_delay", tuple((int(r), int(d)) for r, d in self.ack_delay))
        if self.backend not in ("auto", "gloo", "nccl"):
            raise PipelineConfigError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise PipelineConfigError(
                f"timeout_s must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} seconds, got {self.timeout_s!r}"
            )
        if any(d < 0 for _, d in self.ack_delay):
            raise PipelineConfigError(f"ack_delay iterations must be >= 0, got {self.ack_delay}")
        if self.micro_batches is not None and (not isinstance(self.micro_batches, int) or self.micro_batches < 1):
            raise PipelineConfigError(
                f"micro_batches must be a positive integer (1 = lockstep) or None (one per "
                f"stage), got {self.micro_batches!r}"
            )
        if self.cancel_awaiting < 0 or self.max_iterations <= 0:
            raise PipelineConfigError(
                "cancel_awaiting must be >= 0 and max_iterations > 0, got "
                f"{self.cancel_awaiting} and {self.max_iterations}"
            )

    def micro_batches_for(self, world_size: int) -> int:
        """Micro-batches in flight on `world_size` stages (one stage has nothing to overlap: always 1)."""
        return 1 if world_size == 1 else (self.micro_batches or world_size)

    def delay_of(self, rank: int) -> int:
        return dict(self.ack_delay).get(rank, 0)

    def trace_path_for(self, rank: int) -> Path | None:
        """Rank 0 writes `engine.trace_path`; rank r > 0 writes `<stem>.rank<r><suffix>` beside it."""
        if self.engine.trace_path is None:
            return None
        path = Path(self.engine.trace_path)
        return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")

    def check_world(self, world_size: int) -> None:
        """Refuse a world size the model cannot be split into, with the fix."""
        layers = self.engine.model.num_layers
        if not isinstance(world_size, int) or world_size < 1:
            raise PipelineConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if world_size > layers:
            raise PipelineConfigError(
                f"{world_size} pipeline stages but the model has {layers} layers; every stage "
                "needs at least one: lower world_size or raise ModelConfig.num_layers"
            )
        bad = sorted(
            r for r in self.fail_host_tier_on_ranks | {r for r, _ in self.ack_delay} if not 0 <= r < world_size
        )
        if bad:
            raise PipelineConfigError(
                f"ranks {bad} named in fail_host_tier_on_ranks/ack_delay are outside 0..{world_size - 1}"
            )


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The contiguous layer slice of `stage` (balanced: sizes differ by at most one, earlier stages larger)."""
    if not 0 <= stage < stages <= num_layers:
        raise PipelineConfigError(f"stage {stage} of {stages} cannot hold a slice of {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    begin = stage * base + min(stage, extra)
    return range(begin, begin + base + (1 if stage < extra else 0))
