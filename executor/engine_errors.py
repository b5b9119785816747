"""The errors and warnings of the engine's API: what a caller did wrong, or what the engine could not do.

What they keep true:
* a refused call raises a `ValueError` subclass (`EngineMisuse`, `InvalidTokenId`) and changes nothing;
* `EngineBroken` is the one error after which the engine serves no more driving calls;
* `HostTierFallbackWarning` is a warning, not an error: the engine goes on GPU-only.
"""

from __future__ import annotations

from kvstate.config import RequestRejected
from kvstate.errors import KVStateError
from kvstate.scheduler import UnknownRequestId


class InvalidTokenId(RequestRejected):
    """A prompt or stop token id is outside the model's vocabulary; nothing was submitted."""


class HostTierFallbackWarning(RuntimeWarning):
    """The host tier could not be allocated, or was lost mid-run; the engine runs GPU-only (every eviction is a
    recompute-pause)."""


class EngineMisuse(KVStateError, ValueError):
    """The engine's API was called in a way it cannot serve (closed engine, unknown id); nothing changed."""


class EngineClosed(EngineMisuse):
    """`step`, `run`, `stream`, `add_request` or `cancel` was called after `close()`."""


class RequestNotActive(EngineMisuse, UnknownRequestId):
    """`cancel` named a request id that is unknown or already done (also an `UnknownRequestId`)."""


class HostTierLossRefused(EngineMisuse):
    """The host tier was lost while recompute-pause is disabled: no victim could be evicted any more."""


class EngineBusy(EngineMisuse):
    """A call the engine cannot serve now; nothing changed: a call that drives or changes the engine made from
    inside the engine on the same thread (an `on_transition` listener installed on its scheduler), or
    `step`/`run`/`stream` while a `stream()` is being consumed (the stream drives the engine)."""


class EngineBroken(KVStateError, RuntimeError):
    """A step failed and its effects could not be undone; the message names the step, the phase and the cause
    (also its `__cause__`). Every later call that drives the engine raises it; finished outputs can still be
    read (`outputs()`, `take_finished()`) and `close()` still works. Create a new `Engine` to continue."""
