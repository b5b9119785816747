"""The base of every exception `kvstate` raises on purpose, and the errors several layers raise or catch.

An error that belongs to one concept lives in that concept's module (a bounds file's `BoundsError` in
`kvstate.checker.bounds`, a trace's `TraceError` in `kvstate.trace`), derived from `KVStateError`. Messages say
what was wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstate.spec import Transition


class KVStateError(Exception):
    """Base class of the errors raised by kvstate."""


class SpecError(KVStateError, ValueError):
    """The specification file is malformed or fails validation; the message names the offending entry."""


class IllegalTransition(KVStateError):
    """An event was fired that the specification does not allow from the request's current state."""

    def __init__(self, request_id: object, state: str, event: str, allowed: tuple[str, ...], reason: str = "") -> None:
        self.request_id = request_id
        self.state = state
        self.event = event
        self.allowed = allowed
        allowed_text = ", ".join(allowed) if allowed else "none (the state is terminal)"
        detail = f" {reason}" if reason else ""
        super().__init__(
            f"request {request_id!r} in state {state!r} cannot take event {event!r}.{detail} "
            f"Events the spec allows from {state!r}: {allowed_text}."
        )


class GuardRejected(IllegalTransition):
    """The spec has an edge for this (state, event) but no edge's guard holds in the current pool state."""


class InvariantViolation(KVStateError, AssertionError):
    """A specification invariant does not hold; `invariant_id` is its id in `spec/lifecycle.toml`."""

    def __init__(self, invariant_id: str, detail: str) -> None:
        self.invariant_id = invariant_id
        super().__init__(f"invariant {invariant_id} violated: {detail}")


class PoolError(KVStateError, ValueError):
    """A block-pool operation was asked for that the pool cannot carry out; nothing was changed."""


class TierFull(PoolError):
    """An allocation asked a tier for more blocks than it has free; nothing was changed. `tier` names the tier
    ("gpu" or "host"), `free` and `asked` the blocks it had and was asked for. `edge` is the transition whose effect
    asked, when one did, and `request_id` the request that took it: the scheduler sets both as the error leaves the
    effect (None otherwise)."""

    def __init__(self, message: str, *, tier: str, free: int, asked: int) -> None:
        super().__init__(message)
        self.tier, self.free, self.asked = tier, free, asked
        self.edge: Transition | None = None
        self.request_id: object = None


class UnknownRequestId(KVStateError, KeyError, ValueError):
    """A call or a serialized output named a request id that is not active (or not known) where it arrived."""

    def __str__(self) -> str:
        return str(self.args[0])


class SchedulerStalled(KVStateError, RuntimeError):
    """No request made progress for `no_progress_limit` iterations; the message names requests and pool state."""
