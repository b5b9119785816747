"""Scheduler configuration and submission checks.

Invariants kept:
* a `SchedulerConfig` that exists is valid: every size is in range, and under `max_utilization` an engine
  that cannot recompute-pause has a host tier to suspend into (otherwise a victim could be neither suspended
  nor paused and the scheduler would stall: LIVE-DONE);
* `check_submission` refuses, with `RequestRejected` naming the problem and the limit, every request that is
  malformed or can never fit the GPU tier alone (LIVE-REFUSE); it never changes anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeGuard

from kvstate.errors import KVStateError

CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")
LIFECYCLES = ("machine", "compiled")  # kvstate.lifecycle.make_lifecycle


class ConfigError(KVStateError, ValueError):
    """A configuration value is out of range; the message names it and the accepted range."""


class RequestRejected(KVStateError, ValueError):
    """A submitted request is invalid or can never be served; nothing was changed."""


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def normalize_stop_token_ids(stop_token_ids: object) -> tuple[int, ...]:
    """`stop_token_ids` as a tuple; raises `RequestRejected` unless it is an iterable of integer token ids >= 0."""
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
        raise RequestRejected(
            f"stop_token_ids must be an iterable of integer token ids (e.g. [2] or ()), got {_describe(stop_token_ids)}"
        )
    stop = tuple(stop_token_ids)
    for index, token in enumerate(stop):
        if not _is_int(token) or token < 0:
            raise RequestRejected(
                f"stop_token_ids[{index}] is {_describe(token)}; stop tokens must be integer token ids >= 0"
            )
    return stop


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Pool sizes and budgets of one scheduler. `host_blocks=0` means no host tier. `lifecycle` picks the
    implementation that fires transitions: "machine" (the `transitions` machine, default) or "compiled".
    `max_util_for_resume`: a resume is refused while the GPU blocks neither free nor held exceed this share of
    the GPU tier (the utilization gate; 1 never refuses)."""

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
    lifecycle: str = "machine"
    max_util_for_resume: float = 1.0

    def __post_init__(self) -> None:
        positive = (
            "gpu_blocks",
            "block_size",
            "max_batch_size",
            "max_num_tokens",
            "prefill_chunk_size",
            "pipeline_stages",
            "no_progress_limit",
        )
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
            if value is not None and (not _is_int(value) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer or None (no limit), got {value!r}")
        if not isinstance(self.enable_recompute_pause, bool):
            raise ConfigError(f"enable_recompute_pause must be True or False, got {self.enable_recompute_pause!r}")
        if self.lifecycle not in LIFECYCLES:
            raise ConfigError(
                f"lifecycle must be one of {LIFECYCLES} (the transitions machine, or the table compiled "
                f"from the same spec), got {self.lifecycle!r}"
            )
        util = self.max_util_for_resume
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(
                f"max_util_for_resume must be a fraction in (0, 1] of the GPU tier (1: the gate never refuses), "
                f"got {util!r}"
            )
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ConfigError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_policy!r}")
        if not self.enable_recompute_pause and self.host_blocks == 0 and self.capacity_policy == "max_utilization":
            raise ConfigError(
                "enable_recompute_pause=False with host_blocks=0 under capacity_policy='max_utilization' leaves no "
                "way to evict a victim (it can be neither suspended nor recompute-paused), so the scheduler would "
                "stall (LIVE-DONE); enable recompute-pause, give it a host tier (host_blocks > 0), or use "
                "capacity_policy='guaranteed_no_evict'"
            )

    @property
    def gpu_token_capacity(self) -> int:
        return self.gpu_blocks * self.block_size

    def check_submission(self, prompt: object, max_new_tokens: object, stop_token_ids: object) -> None:
        """Raise `RequestRejected` unless the request is well formed and fits the GPU tier alone (LIVE-REFUSE)."""
        if not isinstance(prompt, (list, tuple)):
            hint = "; tokenize the text first" if isinstance(prompt, (str, bytes)) else ""
            raise RequestRejected(f"prompt must be a list or tuple of integer token ids, got {_describe(prompt)}{hint}")
        if not prompt:
            raise RequestRejected("prompt is empty; a request needs at least one prompt token")
        for index, token in enumerate(prompt):
            if not _is_int(token):
                raise RequestRejected(
                    f"prompt[{index}] is {_describe(token)}; token ids must be Python ints (not bool, float or str)"
                )
            if token < 0:
                raise RequestRejected(f"prompt[{index}] is negative ({token}); token ids are >= 0")
        if not _is_int(max_new_tokens) or max_new_tokens <= 0:
            raise RequestRejected(
                f"max_new_tokens must be a positive integer (at least 1), got {_describe(max_new_tokens)}"
            )
        normalize_stop_token_ids(stop_token_ids)
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
