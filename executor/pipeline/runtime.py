"""The per-rank loop of the pipeline executor. Rank 0 owns the `Scheduler`; every rank owns a stage.

One iteration, in lockstep on every rank (one micro-batch in flight at a time: stage s+1 computes micro-batch i
after stage s, and no stage starts micro-batch i+1 before the last stage retired i):

1. rank 0 applies client actions (the `cancel_awaiting` test hook);
2. every rank reports the pauses it acknowledges and all-gathers the reports (`ConsensusBook`); rank 0 fires
   `consensus` (`Scheduler.reach_consensus`) once every pending pause is agreed by every rank — this happens
   also when no batch runs;
3. rank 0 schedules and broadcasts the message (`executor.pipeline.protocol`); every rank applies its
   transitions to its mirrors, writes them to its trace, rebuilds the output with `from_dict`, announces new
   pauses and checks PP-HOLD on the batch;
4. every stage issues the output's migration plans on its own blocks, runs its layers over the flattened batch
   (hidden states go stage to stage with send/recv), the last stage samples and sends the tokens to rank 0;
5. rank 0 completes the migrations and the step (`complete_step`), which may finish requests.

Invariants kept: no pause is released before every rank acknowledged it (PP-HOLD, checked on every rank);
all ranks run with the same host-tier capacity (PP-FALLBACK); every rank's trace lines are spec edges taken
in order from each request's current state (checked as they are applied).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from executor.engine import resolve_dtype
from executor.kv_cache import resolve_device
from executor.model import PagedBatch, SeqChunk
from executor.pipeline.comm import Comm
from executor.pipeline.config import PipelineConfig, PipelineRequest
from executor.pipeline.consensus import ConsensusBook
from executor.pipeline.hosttier import agree_host_tier
from executor.pipeline.protocol import MirrorBook, batch_chunks, held_blocks, new_request_data
from executor.pipeline.stage import StageCache, StageModel
from executor.sampler import sample_batch
from executor.trace import trace_record
from kvstate.config import SchedulerConfig
from kvstate.errors import KVStateError
from kvstate.pool import TO_GPU
from kvstate.scheduler import Scheduler
from kvstate.roles import PENDING_RESET
from kvstate.spec import load_spec


class PipelineFailed(KVStateError, RuntimeError):
    """Rank 0 stopped the run with an error (every rank raises it); the message says why."""


@dataclass(frozen=True)
class RankResult:
    """What one rank reports after a run. `outputs`, `done_reasons`, `totals` and `leaked_blocks` are rank 0's."""

    rank: int
    world_size: int
    layers: tuple[int, ...]
    host_tier: dict
    iterations: int
    trace: tuple[dict, ...]
    pauses: tuple[dict, ...]
    copy_calls: int
    outputs: dict = field(default_factory=dict)
    done_reasons: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    peak_states: dict = field(default_factory=dict)
    final_states: dict = field(default_factory=dict)
    leaked_blocks: int = 0
    wall_s: float = 0.0


class _TraceSink:
    """Trace lines of one rank: kept in memory and, with a path, written line-buffered (spec/TRACE.md)."""

    def __init__(self, path: Path | None) -> None:
        self.lines: list[dict] = []
        self._file: IO[str] | None = path.open("w", encoding="utf-8", buffering=1) if path is not None else None

    def write(self, record: dict) -> None:
        self.lines.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def stage_device(config: PipelineConfig, rank: int) -> torch.device:
    device = resolve_device(config.engine.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


class PipelineRank:
    """One rank: its stage model and cache, its consensus book, its mirrors or (rank 0) the scheduler."""

    def __init__(self, rank: int, world_size: int, config: PipelineConfig, comm: Comm) -> None:
        config.check_world(world_size)
        e = config.engine
        if e.checkpoint is not None:
            raise NotImplementedError("the pipeline builds seeded weights only; checkpoint loading per stage is "
                                      "not implemented (drop EngineConfig.checkpoint)")
        self.rank, self.world_size, self.config, self.comm = rank, world_size, config, comm
        self.device = comm.device
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        dtype = resolve_dtype(e.dtype, self.device)
        self.stage = StageModel.from_seed(e.model, e.weights_seed, rank, world_size, dtype=dtype, device=self.device)
        self.cache = self.stage.make_cache(e.gpu_blocks, e.block_size, self.device)
        self.stage_cache = StageCache(self.cache, self.stage.layer_range.start)
        self.host = agree_host_tier(self.cache, e.host_blocks, comm,
                                    simulate_failure=rank in config.fail_host_tier_on_ranks)
        self.spec = load_spec()
        self._pending_reset = self.spec.role(PENDING_RESET)
        self.book = ConsensusBook(rank, config.delay_of(rank))
        self.trace = _TraceSink(config.trace_path_for(rank))
        self.sampling: dict[Hashable, Any] = {}
        self.iteration = 0
        self.mirrors = MirrorBook(self.spec) if rank else None
        self.scheduler: Scheduler | None = None
        if rank == 0:
            self._init_driver(dtype)

    # --------------------------------------------------------------------------------------- rank 0 only
    def _init_driver(self, dtype: torch.dtype) -> None:
        e, mc = self.config.engine, self.config.engine.model
        block_bytes = 2 * e.block_size * mc.num_kv_heads * mc.head_dim * mc.num_layers * torch.empty(
            (), dtype=dtype).element_size()  # all stages together: a migration moves every layer's slice
        sc = SchedulerConfig(
            gpu_blocks=e.gpu_blocks, host_blocks=self.host.host_blocks, block_size=e.block_size,
            max_batch_size=e.max_batch_size, max_num_tokens=e.max_num_tokens, prefill_chunk_size=e.prefill_chunk_size,
            enable_recompute_pause=e.enable_recompute_pause, max_preemptions_per_request=e.max_preemptions_per_request,
            no_progress_limit=e.no_progress_limit, block_bytes=block_bytes, pipeline_stages=self.world_size,
            lifecycle=e.lifecycle,
        )
        self.scheduler = Scheduler(sc, spec=self.spec, on_transition=self._on_transition)
        self.scheduler.host_tier_fallback = self.host.fallback
        self.events: Counter = Counter()
        self.totals: Counter = Counter()
        self.peak = {s.name: 0 for s in self.spec.states}
        self._unsent_records: list[dict] = []
        self._unsent_new: list[dict] = []
        self._cancels_left = self.config.cancel_awaiting

    def submit(self, request: PipelineRequest) -> Hashable:
        """Rank 0: queue a request (raises `RequestRejected` with nothing queued when it is invalid)."""
        vocab = self.config.engine.model.vocab_size
        bad = [t for t in (*request.prompt, *request.stop_token_ids) if not 0 <= t < vocab]
        if bad:
            from executor.engine import InvalidTokenId

            raise InvalidTokenId(f"request {request.request_id!r} has token id {bad[0]} outside the model's "
                                 f"vocabulary 0..{vocab - 1}; tokenize with the model's tokenizer")
        r = self.scheduler.submit(request.prompt, request.max_new_tokens, stop_token_ids=request.stop_token_ids,
                                  request_id=request.request_id)
        self.sampling[r.request_id] = request.sampling
        self._unsent_new.append(new_request_data(r.request_id, request.prompt, request.max_new_tokens,
                                                 request.stop_token_ids, request.sampling))
        return r.request_id

    def _on_transition(self, request, transition) -> None:
        record = trace_record(self.scheduler, request, transition)
        self.events[transition.event] += 1
        self.trace.write(record)
        self._unsent_records.append(record)
        if transition.event == "consensus":
            self.book.release(request.request_id, self.iteration + 1, transition.dest)

    def _client_actions(self) -> None:
        if not self._cancels_left:
            return
        for request in list(self.scheduler.resident):
            if self._cancels_left and request.state == self._pending_reset and request.termination_reason is None:
                self.scheduler.cancel(request.request_id)
                self._cancels_left -= 1

    def _plan(self, agreed: set[Hashable]) -> tuple[dict, Any]:
        s = self.scheduler
        s.reach_consensus(agreed)  # only the pauses every rank acknowledged
        message: dict[str, Any] = {"iteration": s.iteration, "stop": False, "error": None}
        out = None
        if not s.has_unfinished:
            message["stop"] = True
        elif s.iteration >= self.config.max_iterations:
            message.update(stop=True, error=f"no completion after {s.iteration} iterations (max_iterations); "
                                            f"{len(s.requests)} requests unfinished")
        else:
            out = s.schedule()
            if self.config.engine.check_invariants:
                s.check_invariants(out)
            message.update(iteration=s.iteration, output=out.to_dict(), chunks=batch_chunks(out, s.pool),
                           held=held_blocks(out, s.pool, self.spec))
        message["new"], self._unsent_new = self._unsent_new, []
        message["transitions"], self._unsent_records = self._unsent_records, []
        return message, out

    def _complete(self, out, sampled: dict[Hashable, int]) -> None:
        s = self.scheduler
        s.complete_migrations(out)
        s.complete_step(out, sampled)
        if self.config.engine.check_invariants:
            s.check_invariants()
        stats = s.stats()
        for key in ("generated_tokens", "recomputed_tokens", "scheduled_tokens", "blocks_migrated", "bytes_migrated"):
            self.totals[key] += getattr(stats, key)
        self.totals["steps"] += 1
        for state, count in stats.requests_per_state.items():
            self.peak[state] = max(self.peak.get(state, 0), count)

    # ----------------------------------------------------------------------------------------- every rank
    def _apply(self, message: dict) -> tuple[Any, list]:
        """Mirror the message on this rank; returns (output, migration plans) for execution."""
        now = message["iteration"] if not message["stop"] else self.iteration + 1
        if self.rank:
            for data in message["new"]:
                self.mirrors.add(data)
                self.sampling[data["request_id"]] = data["sampling"]
            for record in message["transitions"]:
                self.mirrors.apply(record)
                self.trace.write(record)
                if record["event"] == "consensus":
                    self.book.release(record["request_id"], now, record["to"])
        if message["stop"]:
            return None, []
        out = self.mirrors.output(message["output"]) if self.rank else None
        plans = (out.migrations if out is not None else None)
        for rid, blocks in message["held"]:
            if self.rank and self.mirrors.requests[rid].state != self._pending_reset:
                raise KVStateError(f"rank {self.rank}: {rid!r} is announced as awaiting consensus but is "
                                   f"{self.mirrors.requests[rid].state} here")
            self.book.announce(rid, message["iteration"], blocks)
        return out, plans

    def _execute(self, message: dict, plans) -> dict[Hashable, int]:
        """Migrations and this stage's share of the forward pass; rank 0 gets the sampled tokens."""
        fences = [self.cache.execute(plan) for plan in plans]
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for fence in fences:
            fence.order_before(stream)
        writers = [(rid, table) for rid, _, _, table, _ in message["chunks"]]
        writers += [(p.request_id, [dst for _, dst in p.pairs]) for p in plans if p.direction == TO_GPU]
        self.book.check_untouched(writers, message["iteration"])
        sampled = self._forward(message["chunks"])
        for fence in fences:
            fence.wait()  # a fenced source is reused only by later micro-batches, after this wait on every stage
        return sampled

    def _forward(self, chunks: Sequence[list]) -> dict[Hashable, int]:
        if not chunks:
            return {}
        e, stage = self.config.engine, self.stage
        batch = PagedBatch.build([SeqChunk(tuple(tokens), start, tuple(table), samples)
                                  for _, start, tokens, table, samples in chunks], e.block_size, self.device)
        hidden = None
        if not stage.is_first:
            hidden = self.comm.recv((batch.input_ids.shape[0], stage.hidden_size), stage.dtype, self.rank - 1)
        result = stage.forward_stage(batch, self.stage_cache, hidden)
        if not stage.is_last:
            self.comm.send(result, self.rank + 1)
        samplers = [(rid, start + len(tokens)) for rid, start, tokens, _, samples in chunks if samples]
        if not samplers:
            return {}
        ids = [rid for rid, _ in samplers]
        if stage.is_last:
            tokens = sample_batch(result, [self.sampling[rid] for rid in ids], seed=e.seed, request_ids=ids,
                                  positions=[pos for _, pos in samplers])
            if self.rank != 0:
                self.comm.send(torch.tensor(tokens, dtype=torch.int64, device=self.device), 0)
        elif self.rank == 0:
            tokens = self.comm.recv((len(ids),), torch.int64, self.world_size - 1).tolist()
        else:
            return {}
        return dict(zip(ids, (int(t) for t in tokens)))

    def run(self) -> RankResult:
        """The loop; returns this rank's result once rank 0 says stop. Raises `PipelineFailed` on rank 0's error."""
        started = time.perf_counter()
        try:
            while True:
                now = self.iteration + 1
                if self.rank == 0:
                    self._client_actions()
                agreed = self.book.agree(self.comm.all_gather(self.book.acks(now)), now)
                message, out = self._plan(agreed) if self.rank == 0 else (None, None)
                message = self.comm.broadcast(message)
                mirrored, plans = self._apply(message)
                if message["stop"]:
                    if message["error"]:
                        raise PipelineFailed(f"rank 0 stopped the pipeline: {message['error']}")
                    break
                self.iteration = message["iteration"]
                sampled = self._execute(message, out.migrations if out is not None else plans)
                self.book.retire(self.iteration)
                if self.rank == 0:
                    self._complete(out, sampled)
        finally:
            self.trace.close()
        return self._result(time.perf_counter() - started)

    def _result(self, wall: float) -> RankResult:
        common = dict(rank=self.rank, world_size=self.world_size, layers=tuple(self.stage.layer_range),
                      host_tier=self.host.to_dict(), iterations=self.iteration, trace=tuple(self.trace.lines),
                      pauses=tuple(r.to_dict() for r in self.book.history), copy_calls=self.cache.num_copies,
                      wall_s=wall)
        if self.rank:
            return RankResult(**common)
        s = self.scheduler
        usage = s.pool.usage()
        leaked = (usage["gpu_capacity"] - usage["gpu_free"]) + (usage["host_capacity"] - usage["host_free"]) + \
            len(s.pool.in_flight)
        final = s.stats().requests_per_state
        totals = dict(self.totals)
        totals["events"] = dict(self.events)
        return RankResult(**common, outputs={rid: list(r.generated) for rid, r in s.finished.items()},
                          done_reasons={rid: r.done_reason for rid, r in s.finished.items()}, totals=totals,
                          peak_states=dict(self.peak), final_states=dict(final), leaked_blocks=leaked)


def run_rank(rank: int, world_size: int, config: PipelineConfig, requests: Sequence[PipelineRequest],
             comm: Comm | None = None) -> RankResult:
    """Run this rank of a pipeline (the process group must be initialised when `world_size` > 1).
    Only rank 0 reads `requests`."""
    comm = comm or Comm(rank, world_size, stage_device(config, rank))
    node = PipelineRank(rank, world_size, config, comm)
    if rank == 0:
        for request in requests:
            node.submit(request)
    return node.run()
