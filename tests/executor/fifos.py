"""Test helper: run a call that must not block on a FIFO, and unblock it when it does."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest


def refused_without_blocking(call, fifo, seconds: float = 20) -> BaseException:
    """The exception `call()` raised; fails the test (after unblocking the call) if it is still waiting on `fifo`
    after `seconds`, or if it returned."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as err:
            outcome.append(err)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        with contextlib.suppress(OSError):  # a writer lets the blocked open() return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"reading the FIFO {fifo} blocked")
    assert outcome[0] is not None, "a FIFO was accepted"
    return outcome[0]
