"""Scheduler configuration and submission checks."""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.errors import KVStateError

CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")


class ConfigError(KVStateError, ValueError):
    """A configuration value is out of range; the message names it and the accepted range."""


class RequestRejected(KVStateError, ValueError):
    """A submitted request is invalid or can never be served; nothing was changed."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Pool sizes and budgets of one scheduler. `host_blocks=0` means no host tier."""

    gpu_blocks: int
    host_blocks: int = 0
    block_size: int = 16
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    prefill_chunk_size: int = 512
    enable_recompute_pause: bool = True
    max_preemptions_per_request: int | None = None
    max_input_len: int | None = None
    capacity_policy: str = "max_utilization"
    pipeline_stages: int = 1
    no_progress_limit: int = 64
    block_bytes: int = 0

    def __post_init__(self) -> None:
        positive = ("gpu_blocks", "block_size", "max_batch_size", "max_num_tokens", "prefill_chunk_size",
                    "pipeline_stages", "no_progress_limit")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("host_blocks", "block_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (0 = none), got {value!r}")
        for name in ("max_preemptions_per_request", "max_input_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer or None (no limit), got {value!r}")
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ConfigError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_policy!r}")

    @property
    def gpu_token_capacity(self) -> int:
        return self.gpu_blocks * self.block_size

    def check_submission(self, prompt: object, max_new_tokens: object, stop_token_ids: object) -> None:
        """Raise `RequestRejected` unless the request is well formed and fits the GPU tier alone (LIVE-REFUSE)."""
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestRejected(f"prompt must be a list of integer token ids, got {type(prompt).__name__}")
        if not prompt:
            raise RequestRejected("prompt is empty; a request needs at least one prompt token")
        if any(t < 0 for t in prompt):
            raise RequestRejected(f"prompt has negative token id {min(prompt)}; token ids are >= 0")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise RequestRejected(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be integer token ids, got {stop_token_ids!r}")
        if self.max_input_len is not None and len(prompt) > self.max_input_len:
            raise RequestRejected(
                f"prompt has {len(prompt)} tokens, more than max_input_len={self.max_input_len}; shorten it"
            )
        worst = len(prompt) + max_new_tokens
        if worst > self.gpu_token_capacity:
            raise RequestRejected(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {worst} tokens can never fit the GPU "
                f"tier of {self.gpu_blocks} blocks x {self.block_size} tokens = {self.gpu_token_capacity}; "
                "lower max_new_tokens, shorten the prompt or enlarge the GPU tier"
            )
