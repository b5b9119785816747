"""The adapter contract: how the conformance machine reaches a scheduler, and the checks that an adapter keeps it.

`SchedulerAdapter` is the protocol every adapter implements; `PassReporting` is what an adapter adds to have its
scheduling policy checked on every pass; `USAGE_KEYS` are the keys of every `block_usage()` mapping. `contract_gaps`
names what an adapter lacks of the protocol, `checked_usage` reads its block usage refusing a mapping without a key,
and `adapter_snapshot` is what it reports at one moment, to compare with another.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstate.declared import ObservedPass
from kvstate.testing.errors import AdapterContractError

__all__ = [
    "USAGE_KEYS",
    "AdapterSnapshot",
    "PassReporting",
    "SchedulerAdapter",
    "adapter_snapshot",
    "checked_usage",
    "contract_gaps",
]

# Keys every `block_usage()` mapping must have (`*_held`: blocks owned by requests, whether locked by a computing
# request or held by a suspended one).
USAGE_KEYS = (
    "gpu_capacity",
    "gpu_free",
    "gpu_held",
    "gpu_fenced",
    "host_capacity",
    "host_free",
    "host_held",
    "host_fenced",
)


@runtime_checkable
class SchedulerAdapter(Protocol):
    """How the conformance machine drives a scheduler. Implement it for your engine to fuzz it against the spec.

    Attributes:
        gpu_token_capacity: the most tokens (prompt + max_new_tokens) one request may need to fit the GPU tier
            alone; the machine submits requests up to exactly this size and expects larger ones refused.
        block_size: tokens per KV block (used for edge-size prompts and block bounds).
        vocab_size (optional): token ids the scheduler accepts are below it; the machine draws prompt and stop
            tokens from that range (default `kvstate.sim.DEFAULT_VOCAB`, or `MachineConfig(vocab_size=...)`).

    Every method is called between iterations, never during one. Request ids are any hashable values the
    adapter picks; they must stay unique for the adapter's lifetime.
    """

    gpu_token_capacity: int
    block_size: int

    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> Hashable:
        """Queue a request and return its id. Refuse an invalid one (empty prompt, too large to ever fit the
        GPU tier) by raising a `ValueError` subclass, changing nothing."""

    def step(self) -> None:
        """Run one whole iteration: schedule, carry out migrations and complete their fences, forward pass,
        sampling, pipeline consensus. Requests may take several spec events in one step."""

    def cancel(self, request_id: Hashable) -> None:
        """Cancel a request. From a terminal state: raise `LookupError` or `ValueError`, or do nothing."""

    def states(self) -> Mapping[Hashable, str]:
        """The spec state name of every request ever submitted (terminal ones included)."""

    def outputs(self) -> Mapping[Hashable, Sequence[int]]:
        """The tokens every request ever submitted has generated so far."""

    def block_usage(self) -> Mapping[str, int]:
        """Block counts per tier, with at least the keys of `USAGE_KEYS` (host_capacity 0 = no host tier).
        `*_held` counts blocks owned by requests (locked by computing ones, held by suspended ones), `*_fenced`
        those reserved by copies in flight. A request holds at most ceil((prompt + max_new_tokens) / block_size)
        blocks, and only in the tiers its state's residency allows (`kvstate.spec.RESIDENCY_TIERS`: a suspended
        request on the GPU, the host or both, no other on the host); held blocks beyond that bound are reported as
        leaked (RES-STATE), host blocks without a host tier as NO-HOST-NO-OFFLOAD."""

    def check_invariants(self) -> None:
        """Optional deep self-check (raise on a violation); may do nothing."""

    def set_host_capacity(self, blocks: int) -> bool:
        """Make the host tier disappear (0) or reappear (`blocks` > 0); return False if not supported.
        Suspended requests lose their host copies when it disappears (those held wholly on the GPU may stay)."""

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> list[int]:
        """The output of this request run alone with unlimited memory. Must be a pure function of its arguments
        (it is also called while generating test data, on a separate adapter instance)."""


class PassReporting(Protocol):
    """What an adapter adds to `SchedulerAdapter` to have its scheduling policy checked on every pass.

    Attributes:
        policy (optional): its engine's policy, a `kvstate.spec.Policy` or the name of a preset of
            `kvstate.declared.PRESETS`; without it (and without `MachineConfig(policy=...)`), the spec's own.
    """

    def take_passes(self) -> Sequence[ObservedPass]:
        """The scheduling passes the `step()` calls since the last call ran, oldest first, each as a
        `kvstate.declared.ObservedPass` (a snapshot of the active requests just before it, its victims and
        promotions in decision order, its output); forgets them."""


_ADAPTER_ATTRIBUTES = ("gpu_token_capacity", "block_size")
_ADAPTER_METHODS = (
    "submit",
    "step",
    "cancel",
    "states",
    "outputs",
    "block_usage",
    "check_invariants",
    "set_host_capacity",
    "reference",
)


def contract_gaps(adapter: object) -> list[str]:
    """What `adapter` lacks of `SchedulerAdapter`: each missing member, and each method that is not callable."""
    gaps = [f"{m} (missing)" for m in (*_ADAPTER_ATTRIBUTES, *_ADAPTER_METHODS) if not hasattr(adapter, m)]
    return gaps + [
        f"{m} (is {type(getattr(adapter, m)).__name__}, not a method)"
        for m in _ADAPTER_METHODS
        if hasattr(adapter, m) and not callable(getattr(adapter, m))
    ]


def checked_usage(adapter: SchedulerAdapter) -> Mapping[str, int]:
    """`adapter.block_usage()`, refused with an `AdapterContractError` naming each `USAGE_KEYS` key it lacks."""
    usage = adapter.block_usage()
    if not isinstance(usage, Mapping):
        raise AdapterContractError(
            f"{type(adapter).__name__}.block_usage() returned {type(usage).__name__}; it must return a mapping "
            f"with the keys {', '.join(USAGE_KEYS)}"
        )
    missing = [k for k in USAGE_KEYS if k not in usage]
    if missing:
        raise AdapterContractError(
            f"{type(adapter).__name__}.block_usage() lacks the key(s) {', '.join(map(repr, missing))}; it must "
            f"report every one of {', '.join(USAGE_KEYS)} (host_capacity 0: no host tier)"
        )
    return usage


@dataclass(frozen=True)
class AdapterSnapshot:
    """Every request's state and output and the block usage, as an adapter reported them at one moment (plain
    dicts and lists, so two snapshots compare equal exactly when the adapter reported the same)."""

    states: dict[Hashable, str]
    outputs: dict[Hashable, list[int]]
    usage: dict[str, int]


def adapter_snapshot(adapter: SchedulerAdapter) -> AdapterSnapshot:
    """What `adapter` reports now (`AdapterSnapshot`)."""
    return AdapterSnapshot(
        dict(adapter.states()),
        {k: list(v) for k, v in adapter.outputs().items()},
        dict(adapter.block_usage()),
    )
