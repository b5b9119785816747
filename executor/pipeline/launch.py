"""Entry points: `run_pipeline` spawns N ranks on this machine; `torchrun_main` runs one rank under torchrun.

`run_pipeline(config, requests, world_size)` starts `world_size` processes with `torch.multiprocessing` (spawn),
each joining a gloo (CPU) or NCCL (CUDA) process group, runs the pipeline and returns rank 0's outputs and every
rank's result. The ranks meet at a TCPStore that this process hosts on the loopback interface only (127.0.0.1,
on a socket bound before any rank starts, so no other process can take the port), and gloo and NCCL are told to
use the loopback interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): nothing a local run opens listens on
another interface.

Trusted cluster: the ranks exchange pickled Python objects (`broadcast_object_list` and `all_gather_object` in
`executor.pipeline.comm`), and unpickling runs code chosen by the sender. Run a pipeline only among processes and
machines you trust, on a private network, and never expose its store or its ports: anyone who can connect to
them can run code in every rank.

Invariants kept:
* the requests are validated in the caller's process before any rank starts (a bad request is a clear error,
  never a hung group);
* every wait on a peer is bounded by `config.timeout_s` (each collective, and joining the group), a rank that
  stays stopped (SIGSTOP) for `min(timeout_s, STOPPED_GRACE_S)` fails the run, and a livelock is stopped by
  `max_iterations`; so a run never hangs;
* a rank that dies (exits or is killed) or stops ends the run with `RankLost` (a `ConnectionError`), a rank's
  exception with `RankFailed` (a `ProcessRaisedException`); both carry a one-line message naming the rank, and
  every other rank is killed before they are raised;
* the launcher's temporary directory (``kvstate-pp-*``, where the ranks leave their results) is removed however
  the run ends, also when the launcher is sent SIGTERM (`run_pipeline` turns it into `SystemExit` while the ranks
  run, so that they are killed and the directory removed on the way out). A SIGKILL leaves it behind;
* so are the files torch's spawn gives each rank to report its exception in (``pytorch-errorfile-*.pickle`` in
  the temporary directory of this process, which torch leaves behind), once the run has read them.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from executor.pipeline.config import PipelineConfig, PipelineRequest, as_requests
from executor.pipeline.runtime import RankResult
from kvstate.errors import KVStateError

LOOPBACK = "127.0.0.1"
STOPPED_GRACE_S = 10.0  # a rank stopped this long (or timeout_s, if shorter) fails the run
KILL_GRACE_S = 2.0  # after a rank failed, the others get this long to exit before they are killed
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout")


class RankLost(KVStateError, ConnectionError):
    """A rank died (exited or was killed), stayed stopped, or a rank lost its peer; every rank was stopped.
    The message is one line naming the rank."""


class RankFailed(KVStateError, ProcessRaisedException):
    """A rank raised an exception; every rank was stopped. The message is one line (the rank and the last line
    of its traceback); `rank_traceback` holds the whole traceback."""

    def __init__(self, message: str, error_index: int, error_pid: int, rank_traceback: str) -> None:
        super().__init__(message, error_index, error_pid)
        self.rank_traceback = rank_traceback

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid, self.rank_traceback)


@dataclass(frozen=True)
class PipelineResult:
    """Rank 0's outputs ({id: generated tokens} of every finished request) and each rank's `RankResult`."""

    outputs: dict[Hashable, list[int]]
    ranks: tuple[RankResult, ...]

    @property
    def driver(self) -> RankResult:
        return self.ranks[0]


def validate_requests(config: PipelineConfig, requests: Sequence[PipelineRequest]) -> None:
    """What rank 0's scheduler would refuse, refused here (`RequestRejected`), before any process starts."""
    from executor.engine_errors import InvalidTokenId
    from kvstate.config import RequestRejected

    e = config.engine
    if e.trace_path is not None and not Path(e.trace_path).resolve().parent.is_dir():
        raise FileNotFoundError(
            f"the trace directory {Path(e.trace_path).resolve().parent} does not exist; "
            "create it or pick another trace_path"
        )
    check = e.scheduler  # rank 0's scheduler config, but for the host tier it agrees on (irrelevant here)
    vocab, limit = e.model.vocab_size, e.model.max_position_embeddings
    for r in requests:
        check.check_submission(list(r.prompt), r.max_new_tokens, r.stop_token_ids)
        bad = [t for t in (*r.prompt, *r.stop_token_ids) if t >= vocab]
        if bad:
            raise InvalidTokenId(
                f"request {r.request_id!r} has token id {bad[0]} but the model's vocabulary has "
                f"{vocab} ids; tokenize with the model's tokenizer"
            )
        if len(r.prompt) + r.max_new_tokens > limit:
            raise RequestRejected(
                f"request {r.request_id!r}: prompt + max_new_tokens exceeds the model's max_position_embeddings={limit}"
            )


@contextmanager
def loopback_store(world_size: int, timeout_s: float) -> Iterator[int]:
    """Host a TCPStore listening on 127.0.0.1 only for the duration; yields its port. The socket is bound and
    listening before the store starts, so the port cannot be taken in between."""
    import torch.distributed as dist

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(max(world_size, 1) * 4)
        port = listener.getsockname()[1]
        try:
            store = dist.TCPStore(
                LOOPBACK,
                port,
                world_size,
                is_master=True,
                master_listen_fd=listener.fileno(),
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )
        finally:
            listener.detach()  # the store owns the descriptor and closes it, also when it fails to start
    try:
        yield port
    finally:
        del store


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux)."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in names if name == "lo" or name.startswith("lo")), "lo")


def _spawned(rank: int, world_size: int, config: PipelineConfig, requests: tuple, port: int, out_dir: str) -> None:
    """Body of one spawned rank: one torch thread on its own cores (`rank_cores`), join the group over loopback,
    freeze what is allocated so far out of the garbage collector's reach (a full collection pauses the whole
    pipeline), run, pickle the result."""
    import torch
    import torch.distributed as dist

    from executor.pipeline.comm import init_process_group
    from executor.pipeline.devices import rank_cores
    from executor.pipeline.runtime import local_devices, run_rank

    torch.set_num_threads(1)
    cores = rank_cores(rank, world_size, os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else None
    if cores:
        os.sched_setaffinity(0, cores)  # the stages run side by side, never queued on one core behind each other
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback_interface()
    devices = local_devices(config, world_size)
    device = torch.device(devices.device_of(rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timedelta(seconds=config.timeout_s))
    init_process_group(devices.backend, rank, world_size, config.timeout_s, store=store)
    gc.freeze()  # the imported modules are never garbage: a full collection in the loop would walk them (~0.1 s)
    try:
        result = run_rank(rank, world_size, config, requests)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def process_state(pid: int) -> str | None:
    """The state letter /proc gives process `pid` (R running, S sleeping, T stopped, Z zombie, ...); None where
    /proc cannot be read (no such process, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def _stopped(pid: int) -> bool:
    """The process is stopped by a signal (state T in /proc; False where /proc cannot be read)."""
    return process_state(pid) == "T"


@contextmanager
def _quiet_spawn_log() -> Iterator[None]:
    """torch logs a warning per rank it terminates after a failure; the error raised here says it in one line."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _wait(context, world_size: int, timeout_s: float) -> None:
    """Join the ranks; raise `RankLost` or `RankFailed` (one line each) when one dies, stops or fails."""
    grace = min(timeout_s, STOPPED_GRACE_S)
    stopped_since: dict[int, float] = {}
    try:
        with _quiet_spawn_log():
            while not context.join(timeout=1.0, grace_period=KILL_GRACE_S):
                now = time.monotonic()
                for rank, process in enumerate(context.processes):
                    if process.is_alive() and _stopped(process.pid):
                        since = stopped_since.setdefault(rank, now)
                        if now - since >= grace:
                            raise RankLost(
                                f"pipeline rank {rank} (pid {process.pid}) has been stopped (SIGSTOP) for "
                                f"{now - since:.0f} s, so every other rank waits on it; every rank was "
                                "killed. Continue a stopped rank sooner (SIGCONT)"
                            )
                    else:
                        stopped_since.pop(rank, None)
    except ProcessExitedException as err:
        how = f"was killed by signal {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}"
        raise RankLost(
            f"pipeline rank {err.error_index} (pid {err.error_pid}) {how} before the run finished; every "
            f"other of the {world_size} ranks was stopped"
        ) from None
    except ProcessRaisedException as err:
        trace = err.args[0].split("terminated with the following error:\n", 1)[-1]
        last = next((line.strip() for line in reversed(trace.splitlines()) if line.strip()), "unknown error")
        if stopped_since:
            raise RankLost(
                f"pipeline rank {min(stopped_since)} was stopped (SIGSTOP), and rank {err.error_index} "
                f"gave up waiting for it: {last}; every rank was killed"
            ) from None
        if any(marker in last.lower() for marker in PEER_LOST):
            raise RankLost(
                f"pipeline rank {err.error_index} lost a peer rank ({last}); a rank died, stopped or "
                "was too slow for PipelineConfig.timeout_s; every rank was stopped"
            ) from None
        raise RankFailed(
            f"pipeline rank {err.error_index} failed: {last} (every rank was stopped; the rank's "
            "traceback is in this error's rank_traceback)",
            err.error_index,
            err.error_pid,
            trace,
        ) from None


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While in the block, SIGTERM raises `SystemExit(143)` in this process (main thread only: elsewhere signals
    cannot be handled), so `finally` blocks run: the ranks are killed and the temporary directory removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def run_pipeline(
    config: PipelineConfig, requests: Sequence[PipelineRequest | tuple], world_size: int
) -> PipelineResult:
    """Run `requests` on a `world_size`-stage pipeline of spawned local processes; returns their results.

    `requests` are `PipelineRequest`s or `(prompt, max_new_tokens)` pairs (ids = positions). Raises `RankLost`
    when a rank dies, stays stopped or loses its peer, and `RankFailed` when a rank raised (module docstring)."""
    import torch.multiprocessing as mp

    from executor.pipeline.runtime import local_devices

    normalised = as_requests(requests)
    config.check_world(world_size)
    validate_requests(config, normalised)
    local_devices(config, world_size)  # refuses, before any rank starts, ranks that cannot share the devices
    with (
        _sigterm_exits(),
        tempfile.TemporaryDirectory(prefix="kvstate-pp-") as out_dir,
        loopback_store(world_size, config.timeout_s) as port,
    ):
        context = mp.start_processes(
            _spawned,
            args=(world_size, config, normalised, port, out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            _wait(context, world_size, config.timeout_s)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
            _remove_error_files(context.error_files)
        ranks = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                ranks.append(pickle.load(f))
    return PipelineResult(outputs=ranks[0].outputs, ranks=tuple(ranks))


def _remove_error_files(paths: Sequence[str | None]) -> None:
    """Remove the files torch's spawn named for the ranks to write their exceptions to (where a rank wrote one)."""
    for path in paths:
        if path is not None:
            with suppress(OSError):
                os.unlink(path)


def torchrun_main(config: PipelineConfig, requests: Sequence[PipelineRequest | tuple]) -> RankResult:
    """Run this process's rank under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the env)."""
    import torch
    import torch.distributed as dist

    from executor.pipeline.comm import init_process_group
    from executor.pipeline.runtime import local_devices, pipeline_comm, run_rank

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    normalised = as_requests(requests)
    config.check_world(world_size)
    validate_requests(config, normalised)
    devices = local_devices(config, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    device = torch.device(devices.device_of(int(os.environ.get("LOCAL_RANK", rank))))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(devices.backend, rank, world_size, config.timeout_s)
    gc.freeze()  # as in a spawned rank: no full collection walks the imported modules during the loop
    try:
        return run_rank(rank, world_size, config, normalised, pipeline_comm(rank, world_size, config, device))
    finally:
        dist.destroy_process_group()
