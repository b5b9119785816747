"""Which calls an engine serves, and when (`CallGuard`): its threading model, and the refusals of a closed or
broken engine.

What it keeps true:
* one call at a time holds the engine: a call that drives or changes it holds the lock for its duration;
* a call that drives or changes the engine from inside the engine on the same thread (an `on_transition` hook,
  which runs inside `step` or `cancel`) raises `EngineBusy` and changes nothing; reading is allowed there;
* a closed engine refuses every call that drives it (`EngineClosed`), and a broken one raises the `EngineBroken`
  it broke with;
* while a `stream()` is live, the calls that step the engine raise `EngineBusy`: the stream drives it;
* the lock is released, and the owner forgotten, however the call ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from executor.engine_errors import EngineBroken, EngineBusy, EngineClosed


class CallGuard:
    """Serializes the calls of one engine (module docstring). `closed`: the engine was closed; `broken`: the error
    it broke with (None while it is not broken); `streaming`: a `stream()` of it is being consumed."""

    __slots__ = ("_lock", "_owner", "_owner_call", "broken", "closed", "streaming")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside a call that holds the lock, and the call's name
        self._owner_call = ""
        self.closed = False
        self.broken: EngineBroken | None = None
        self.streaming = False

    @contextmanager
    def exclusive(self, what: str, *, drives: bool = True, steps: bool = False) -> Iterator[None]:
        """Hold the lock for the call `what`. `drives`: refused on a closed or broken engine; `steps`: also refused
        while a `stream()` is live."""
        me = threading.get_ident()
        if self._owner == me:
            raise EngineBusy(
                f"{what}() was called from inside {self._owner_call}() on the same thread (from an "
                "on_transition hook); the engine cannot serve it there and nothing changed: note what "
                f"you need in the hook and call {what}() after {self._owner_call}() has returned"
            )
        with self._lock:
            self._owner, self._owner_call = me, what
            try:
                if drives:
                    self._check_usable(what)
                if steps and self.streaming:
                    raise EngineBusy(
                        f"{what}() was called while a stream() is being consumed; the stream drives the "
                        "engine (tokens of other steps would never reach it) and nothing changed: "
                        "consume the stream to its end or close it (generator.close()) first"
                    )
                yield
            finally:
                self._owner, self._owner_call = None, ""

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the lock while reading, unless this thread already holds it (a hook reading the engine)."""
        if self._owner == threading.get_ident():
            yield
            return
        with self._lock:
            yield

    def _check_usable(self, what: str) -> None:
        if self.broken is not None:
            raise EngineBroken(self.broken.args[0]) from self.broken.__cause__
        if self.closed:
            raise EngineClosed(
                f"{what}() was called after close(); the engine can still be inspected (outputs(), "
                "stats(), totals) but not driven: create a new Engine to serve more requests"
            )
