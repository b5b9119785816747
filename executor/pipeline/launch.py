"""Entry points: `run_pipeline` spawns N ranks on this machine; `torchrun_main` runs one rank under torchrun.

`run_pipeline(config, requests, world_size)` starts `world_size` processes with `torch.multiprocessing` (spawn),
each joining a gloo (CPU) or NCCL (CUDA) process group at MASTER_ADDR=127.0.0.1 on a free port, runs the
pipeline and returns rank 0's outputs and every rank's result.

Invariants kept: the requests are validated in the caller's process before any rank starts (a bad request is a
clear error, never a hung group); the wait is bounded by `config.timeout_s` (plus start-up), after which every
rank is killed and `TimeoutError` is raised; a rank's exception is re-raised here with its traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from executor.pipeline.config import PipelineConfig, PipelineRequest, as_requests
from executor.pipeline.runtime import RankResult

STARTUP_GRACE_S = 60.0  # importing torch in each spawned process on a busy two-core machine


@dataclass(frozen=True)
class PipelineResult:
    """Rank 0's outputs ({id: generated tokens} of every finished request) and each rank's `RankResult`."""

    outputs: dict[Hashable, list[int]]
    ranks: tuple[RankResult, ...]

    @property
    def driver(self) -> RankResult:
        return self.ranks[0]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def validate_requests(config: PipelineConfig, requests: Sequence[PipelineRequest]) -> None:
    """What rank 0's scheduler would refuse, refused here (`RequestRejected`), before any process starts."""
    from executor.engine import InvalidTokenId
    from kvstate.config import RequestRejected, SchedulerConfig

    e = config.engine
    if e.trace_path is not None and not Path(e.trace_path).resolve().parent.is_dir():
        raise FileNotFoundError(f"the trace directory {Path(e.trace_path).resolve().parent} does not exist; "
                                "create it or pick another trace_path")
    check = SchedulerConfig(gpu_blocks=e.gpu_blocks, block_size=e.block_size)
    vocab, limit = e.model.vocab_size, e.model.max_position_embeddings
    for r in requests:
        check.check_submission(list(r.prompt), r.max_new_tokens, r.stop_token_ids)
        bad = [t for t in (*r.prompt, *r.stop_token_ids) if t >= vocab]
        if bad:
            raise InvalidTokenId(f"request {r.request_id!r} has token id {bad[0]} but the model's vocabulary has "
                                 f"{vocab} ids; tokenize with the model's tokenizer")
        if len(r.prompt) + r.max_new_tokens > limit:
            raise RequestRejected(f"request {r.request_id!r}: prompt + max_new_tokens exceeds the model's "
                                  f"max_position_embeddings={limit}")


def _spawned(rank: int, world_size: int, config: PipelineConfig, requests: tuple, port: int, out_dir: str) -> None:
    """Body of one spawned rank: one torch thread, join the group, run, pickle the result for the parent."""
    import torch

    from executor.pipeline.comm import init_process_group, pick_backend
    from executor.pipeline.runtime import run_rank, stage_device

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = stage_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(pick_backend(config.backend, device), rank, world_size, config.timeout_s)
    import torch.distributed as dist

    try:
        result = run_rank(rank, world_size, config, requests)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_pipeline(config: PipelineConfig, requests: Sequence[PipelineRequest | tuple],
                 world_size: int) -> PipelineResult:
    """Run `requests` on a `world_size`-stage pipeline of spawned local processes; returns their results.

    `requests` are `PipelineRequest`s or `(prompt, max_new_tokens)` pairs (ids = positions). Raises
    `TimeoutError` if the ranks do not finish within `config.timeout_s` after start-up, and
    `torch.multiprocessing.ProcessRaisedException` (with the rank's traceback) if a rank failed."""
    import torch.multiprocessing as mp

    normalised = as_requests(requests)
    config.check_world(world_size)
    validate_requests(config, normalised)
    with tempfile.TemporaryDirectory(prefix="kvstate-pp-") as out_dir:
        context = mp.start_processes(_spawned, args=(world_size, config, normalised, free_port(), out_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + config.timeout_s + STARTUP_GRACE_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size}-rank pipeline did not finish within {config.timeout_s} s "
                                       f"(+{STARTUP_GRACE_S} s start-up); every rank was killed. A rank is stuck in a "
                                       "collective: see its stderr")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        ranks = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                ranks.append(pickle.load(f))
    return PipelineResult(outputs=ranks[0].outputs, ranks=tuple(ranks))


def torchrun_main(config: PipelineConfig, requests: Sequence[PipelineRequest | tuple]) -> RankResult:
    """Run this process's rank under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the env)."""
    import torch
    import torch.distributed as dist

    from executor.pipeline.comm import Comm, init_process_group, pick_backend
    from executor.pipeline.runtime import run_rank, stage_device

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    normalised = as_requests(requests)
    config.check_world(world_size)
    validate_requests(config, normalised)
    device = stage_device(config, int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(pick_backend(config.backend, device), rank, world_size, config.timeout_s)
    try:
        return run_rank(rank, world_size, config, normalised, Comm(rank, world_size, device))
    finally:
        dist.destroy_process_group()
