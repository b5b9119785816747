"""Where a sweep's configurations run: in this process, on a local Dask cluster, or on a Dask cluster at an address.

A `SweepRunner` applies one picklable task to each item of a list, with one shared value (the spec) every call
gets, and yields each item's index and result as it finishes: exactly one result per item. Three runners keep that
promise:

* `InProcessRunner` calls the task here, one item after the other. It needs nothing beyond the core install.
* `local_dask_runner(workers)` starts a Dask `LocalCluster` of `workers` processes (one thread each) and stops it
  on leaving, also on an error or Ctrl-C.
* `cluster_runner(address)` connects to a running Dask scheduler; on leaving it closes its connection and leaves
  the cluster running. An address that does not answer within the connect timeout, or a cluster without workers,
  is a `KVStateError` naming the address.

Dask is imported only by the last two; without it they raise a `KVStateError` that names the extra to install.
The shared value is sent once, as the result of a task of its own that the workers fetch from each other (and that
the scheduler computes again if every worker holding it died), not with every item. When a worker dies mid-sweep,
the Dask scheduler runs its items again on another worker, up to its `allowed-failures` setting (Dask's default:
3); an item that still has no result, or that the scheduler cancelled, is yielded as `Lost` with the reason, never
dropped. An exception the task itself raises is raised here, as the in-process runner would raise it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar

from kvstate.errors import KVStateError

__all__ = [
    "CLUSTER_EXTRA",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DaskRunner",
    "InProcessRunner",
    "Lost",
    "SweepRunner",
    "cluster_runner",
    "dask_available",
    "local_dask_runner",
]

Shared = TypeVar("Shared")
Item = TypeVar("Item")
Result = TypeVar("Result")

CLUSTER_EXTRA = "pip install 'kvstate[cluster]'"  # what installs Dask beside kvstate
DEFAULT_CONNECT_TIMEOUT_S = 10.0
ADDRESS = re.compile(r"tcp://[^\s/:]+:\d{1,5}")


@dataclass(frozen=True, slots=True)
class Lost:
    """An item no worker returned a result for: its workers died more often than the scheduler allows, or the
    scheduler cancelled it."""

    reason: str


class SweepRunner(Protocol):
    """Applies `task(shared, item)` to every item, yielding `(index, result or Lost)` once per item, in the order
    they finish."""

    @property
    def description(self) -> str: ...  # where the items run, for the report ("2 local Dask worker(s)")

    def run(
        self, task: Callable[[Shared, Item], Result], shared: Shared, items: Sequence[Item]
    ) -> Iterator[tuple[int, Result | Lost]]: ...


class InProcessRunner:
    """Runs every item in this process, in order."""

    description = "this process"

    def run(
        self, task: Callable[[Shared, Item], Result], shared: Shared, items: Sequence[Item]
    ) -> Iterator[tuple[int, Result | Lost]]:
        for index, item in enumerate(items):
            yield index, task(shared, item)


class DaskRunner:
    """Runs every item as one task on the workers of a connected Dask `Client`; the client's owner closes it.
    Leaving the iteration early (an error, Ctrl-C) cancels what is still queued."""

    def __init__(self, client: Any, description: str) -> None:
        self.client = client
        self.description = description

    def run(
        self, task: Callable[[Shared, Item], Result], shared: Shared, items: Sequence[Item]
    ) -> Iterator[tuple[int, Result | Lost]]:
        distributed = _import_distributed("a Dask sweep")
        shared_future = self.client.submit(_identity, shared, pure=False)  # computed again where every copy is lost
        futures = [self.client.submit(task, shared_future, item, pure=False) for item in items]
        index = {future.key: n for n, future in enumerate(futures)}
        try:
            for future in distributed.as_completed(futures, loop=self.client.loop):
                yield index[future.key], _result(future, distributed)
        finally:
            self.client.cancel([f for f in [*futures, shared_future] if not f.done()])


def _identity(value: Shared) -> Shared:
    return value


def _result(future: Any, distributed: ModuleType) -> Any:
    """The task's result; `Lost` when the scheduler gave up on it after its workers died, or cancelled it."""
    try:
        return future.result()
    except distributed.KilledWorker as err:
        return Lost(f"its worker died each time it ran ({_first_line(err)})")
    except CancelledError as err:
        return Lost(f"the scheduler cancelled it ({_first_line(err)})")


def dask_available() -> bool:
    """True when `dask.distributed` can be imported (the `cluster` extra is installed)."""
    try:
        _import_distributed("")
    except KVStateError:
        return False
    return True


@contextmanager
def local_dask_runner(workers: int) -> Iterator[DaskRunner]:
    """A `LocalCluster` of `workers` processes of one thread each on this host (its dashboard on a free port, its
    log silenced below CRITICAL), stopped on leaving."""
    distributed = _import_distributed(f"--workers {workers}")
    with (
        distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.CRITICAL,  # a lost item is reported with its reason; shutdown chatter is not
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        yield DaskRunner(client, f"{workers} local Dask worker(s)")


@contextmanager
def cluster_runner(address: str, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> Iterator[DaskRunner]:
    """A client of the Dask scheduler at `address` (tcp://HOST:PORT); the cluster is left running on leaving."""
    if not ADDRESS.fullmatch(address):
        raise KVStateError(f"--cluster {address!r}: expected a Dask scheduler address tcp://HOST:PORT")
    distributed = _import_distributed("--cluster")
    try:
        client = distributed.Client(address, timeout=connect_timeout, set_as_default=False)
    except (OSError, TimeoutError) as err:
        raise KVStateError(
            f"--cluster {address}: no Dask scheduler answered within {connect_timeout:g} s ({_first_line(err)})"
        ) from err
    with client:
        try:
            client.wait_for_workers(1, timeout=connect_timeout)
        except (OSError, TimeoutError) as err:
            raise KVStateError(f"--cluster {address}: the cluster has no workers after {connect_timeout:g} s") from err
        workers = len(client.scheduler_info().get("workers", {}))
        yield DaskRunner(client, f"the Dask cluster at {address} ({workers} worker(s) when it started)")


def _import_distributed(needed_by: str) -> ModuleType:
    try:
        import distributed
    except ImportError as err:
        raise KVStateError(f"{needed_by} needs Dask, which is not installed: {CLUSTER_EXTRA}") from err
    return distributed


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
