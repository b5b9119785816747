"""The per-rank loop of the pipeline executor. Rank 0 owns the `Scheduler`; every rank owns a stage.

Several micro-batches are in flight (`PipelineConfig.micro_batches`, default one per stage): rank 0 schedules
micro-batch k+1 while later stages still compute k. Every message travels down the pipeline with the batch, and the
last stage sends the sampled tokens back to rank 0, so no rank waits for another except for the data it needs:

1. rank 0 lands the oldest micro-batch once `micro_batches` are in flight (or everything unfinished is in flight):
   it receives its tokens and the stages' acknowledgement reports from the last stage, completes the migrations
   and the step (`complete_step`, which may finish requests, also while they await consensus: a deferred finish);
2. rank 0 applies client actions (the `cancel_awaiting` test hook), agrees on the pauses every rank reported
   (`ConsensusBook`), fires `consensus` for those (`Scheduler.reach_consensus`), schedules (a request is in one
   micro-batch in flight at most: `Scheduler.track_in_flight`), computes stage 0 (step 4) and posts the message
   with the hidden states to rank 1; this happens also when no batch runs, so consensus progresses while nothing
   computes;
3. every rank r > 0 receives the message and the hidden states from rank r-1, takes the same agreement, applies
   the transitions to its mirrors, writes them to its trace, rebuilds the output with `from_dict`, announces new
   pauses, adds its own acknowledgements, computes its stage and posts the message with its hidden states on to
   rank r+1 (one message per hop and pass: `Comm.send_message`);
4. every stage issues the output's migration plans on its own blocks, orders the resumes (host to GPU) before its
   layers, runs them over the flattened batch, checks PP-HOLD on the batch and retires the micro-batch; the last
   stage samples and posts the tokens, with every stage's acknowledgements, to rank 0.

Rank 0 receives a micro-batch's tokens only when it must land it (`Scheduler.must_land`), after it posted the
next one, so stage 0 of micro-batch k+1 runs while the later stages run k.
With `micro_batches = 1` rank 0 lands each micro-batch before the next pass (lockstep).
Every rank posts the receive of the next message it is sure to get before it computes (`Comm.expect`: rank r > 0
after each message that does not stop the run, rank 0 while a micro-batch is in flight), so a peer's message is
handed over as soon as it is sent, not when this rank next waits for it.
Each rank plans its batches with one `BatchPlanner` per micro-batch slot (iteration modulo `micro_batches`): a
decode pass mostly holds the requests of the pass `micro_batches` before it, whose plan it then reuses.

Invariants kept: each stage runs micro-batches in the order rank 0 scheduled them and waits for a micro-batch's
copies before it starts the next, so a later pass's copies and writes come after an earlier pass's reads on every
stage: rank 0 reports a pass's copies complete as soon as it posted the pass (FENCE holds in stage order); no
pause is released before every rank acknowledged it, and a rank acknowledges a pause only once it retired the
micro-batch that announced it, so the request's step in flight (if any) has left every stage and its token has
landed before consensus (PP-HOLD, checked on every rank);
all ranks run with the same host-tier capacity (PP-FALLBACK); every rank's trace lines are spec edges taken in
order from each request's current state (checked as they are applied).
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import torch

from executor.batch import SeqChunk
from executor.decode_plan import BatchPlanner
from executor.engine_config import resolve_dtype
from executor.pipeline.comm import FRAME_BYTES, Comm
from executor.pipeline.config import PipelineConfig, PipelineRequest
from executor.pipeline.consensus import ConsensusBook
from executor.pipeline.devices import DeviceAssignment, assign_devices
from executor.pipeline.hosttier import agree_host_tier
from executor.pipeline.protocol import MirrorBook, batch_chunks, held_blocks, new_request_data
from executor.pipeline.stage import StageCache, StageModel
from executor.run_totals import resume_copies
from executor.sampler import sample_batch
from kvstate.errors import KVStateError
from kvstate.pool import TO_GPU, MigrationPlan
from kvstate.request import Request
from kvstate.roles import PENDING_RESET
from kvstate.scheduler import Scheduler, Step
from kvstate.spec import Transition, default_spec
from kvstate.trace import trace_record

# the `IterationStats` figures rank 0 sums over the run (its `totals`, beside `steps` and the resume counts)
STEP_TOTALS = (
    "generated_tokens",
    "recomputed_tokens",
    "scheduled_tokens",
    "blocks_migrated",
    "bytes_migrated",
    "blocks_offloaded",
    "blocks_onboarded",
)


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
    cpu_s: float = 0.0  # CPU time this rank's process (every thread of it) used during the loop
    receive_wait_s: float = 0.0  # wall time of the loop spent waiting for messages from the other ranks
    micro_batches: int = 1  # micro-batches in flight at once (1: lockstep)


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


def local_devices(config: PipelineConfig, local_world_size: int) -> DeviceAssignment:
    """The backend and the device of each rank on this machine (`assign_devices` with the GPUs visible here)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return assign_devices(config.engine.device, config.backend, local_world_size, count)


def pipeline_comm(rank: int, world_size: int, config: PipelineConfig, device: torch.device) -> Comm:
    """The `Comm` of one rank, its frames down the pipeline sized for a full pass: `FRAME_BYTES` for the message and
    `max_num_tokens` rows of hidden states, so no pass overflows its frame (every rank computes the same size)."""
    e = config.engine
    row_bytes = e.model.hidden_size * torch.empty((), dtype=resolve_dtype(e.dtype, device)).element_size()
    return Comm(rank, world_size, device, down_frame_bytes=FRAME_BYTES + e.scheduler.max_num_tokens * row_bytes)


class PipelineRank:
    """One rank: its stage model and cache, its consensus book, its mirrors or (rank 0) the scheduler."""

    def __init__(self, rank: int, world_size: int, config: PipelineConfig, comm: Comm) -> None:
        config.check_world(world_size)
        e = config.engine
        if e.checkpoint is not None:
            raise NotImplementedError(
                "the pipeline builds seeded weights only; checkpoint loading per stage is "
                "not implemented (drop EngineConfig.checkpoint)"
            )
        self.rank, self.world_size, self.config, self.comm = rank, world_size, config, comm
        self.device = comm.device
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        dtype = resolve_dtype(e.dtype, self.device)
        self.stage = StageModel.from_seed(e.model, e.weights_seed, rank, world_size, dtype=dtype, device=self.device)
        self.cache = self.stage.make_cache(e.scheduler.gpu_blocks, e.scheduler.block_size, self.device)
        self.stage_cache = StageCache(self.cache, self.stage.layer_range.start)
        self.host = agree_host_tier(
            self.cache, e.scheduler.host_blocks, comm, simulate_failure=rank in config.fail_host_tier_on_ranks
        )
        self.spec = e.spec if e.spec is not None else default_spec()  # every rank runs the same lifecycle
        self._pending_reset = self.spec.role(PENDING_RESET)
        self.book = ConsensusBook(rank, config.delay_of(rank))
        self.trace = _TraceSink(config.trace_path_for(rank))
        self.sampling: dict[Hashable, Any] = {}
        self.iteration = 0
        self.receive_wait_s = 0.0  # wall time spent waiting for messages from the other ranks
        self.micro_batches = config.micro_batches_for(world_size)
        self.planners = [
            BatchPlanner(e.scheduler.block_size, self.device, decode_kv_budget=e.decode_kv_bytes)
            for _ in range(self.micro_batches)
        ]
        capacities = {"gpu": e.scheduler.gpu_blocks, "host": self.host.host_blocks}
        self.mirrors = MirrorBook(self.spec, capacities) if rank else None
        self.scheduler: Scheduler | None = None
        if rank == 0:
            self._init_driver(dtype)

    @property
    def driver(self) -> Scheduler:
        """Rank 0's scheduler; raises on any other rank (only rank 0 schedules)."""
        if self.scheduler is None:
            raise KVStateError(f"rank {self.rank} has no scheduler: only rank 0 schedules, submits and lands")
        return self.scheduler

    def _mirror_book(self) -> MirrorBook:
        """The mirrors of rank r > 0; raises on rank 0 (it holds the scheduler's requests instead)."""
        if self.mirrors is None:
            raise KVStateError(f"rank {self.rank} keeps no mirrors: only ranks after 0 mirror rank 0's requests")
        return self.mirrors

    # --------------------------------------------------------------------------------------- rank 0 only
    def _init_driver(self, dtype: torch.dtype) -> None:
        e, mc = self.config.engine, self.config.engine.model
        block_bytes = (
            2
            * e.scheduler.block_size
            * mc.num_kv_heads
            * mc.head_dim
            * mc.num_layers
            * torch.empty((), dtype=dtype).element_size()
        )  # all stages together: a migration moves every layer's slice
        sc = replace(
            e.scheduler, host_blocks=self.host.host_blocks, block_bytes=block_bytes, pipeline_stages=self.world_size
        )
        self.scheduler = Scheduler(sc, spec=self.spec, on_transition=self._on_transition)
        self.scheduler.host_tier_fallback = self.host.fallback
        if self.micro_batches > 1:
            self.scheduler.track_in_flight(self.micro_batches)
        self._now = 1  # the iteration rank 0 is planning
        self._remote_acks: list[list[Hashable]] = [[] for _ in range(1, self.world_size)]  # as last landed
        self.events: Counter = Counter()
        self.totals: Counter = Counter()
        self._unsent_records: list[dict] = []
        self._unsent_new: list[dict] = []
        self._cancels_left = self.config.cancel_awaiting

    def submit(self, request: PipelineRequest) -> Hashable:
        """Rank 0: queue a request (raises `RequestRejected` with nothing queued when it is invalid)."""
        vocab = self.config.engine.model.vocab_size
        bad = [t for t in (*request.prompt, *request.stop_token_ids) if not 0 <= t < vocab]
        if bad:
            from executor.engine_errors import InvalidTokenId

            raise InvalidTokenId(
                f"request {request.request_id!r} has token id {bad[0]} outside the model's "
                f"vocabulary 0..{vocab - 1}; tokenize with the model's tokenizer"
            )
        r = self.driver.submit(
            request.prompt, request.max_new_tokens, stop_token_ids=request.stop_token_ids, request_id=request.request_id
        )
        self.sampling[r.request_id] = request.sampling
        self._unsent_new.append(
            new_request_data(
                r.request_id, request.prompt, request.max_new_tokens, request.stop_token_ids, request.sampling
            )
        )
        return r.request_id

    def _on_transition(self, request: Request, transition: Transition) -> None:
        record = trace_record(self.driver, request, transition)
        self.events[transition.event] += 1
        self.trace.write(record)
        self._unsent_records.append(record)
        if transition.event == "consensus":
            self.book.release(request.request_id, self._now, transition.dest)

    def _client_actions(self) -> None:
        if not self._cancels_left:
            return
        for request in list(self.driver.resident):
            if self._cancels_left and request.state == self._pending_reset and request.termination_reason is None:
                self.driver.cancel(request.request_id)
                self._cancels_left -= 1

    def _plan(self, agreed: set[Hashable]) -> tuple[dict[str, Any], Step | None]:
        s = self.driver
        s.reach_consensus(agreed)  # only the pauses every rank acknowledged
        message: dict[str, Any] = {"iteration": s.iteration, "stop": False, "error": None}
        step: Step | None = None
        if not s.has_unfinished:
            message["stop"] = True
        elif s.iteration >= self.config.max_iterations:
            message.update(
                stop=True,
                error=(
                    f"no completion after {s.iteration} iterations (max_iterations); "
                    f"{len(s.requests)} requests unfinished"
                ),
            )
        else:
            step = Step.begin(s)
            out = step.output
            if self.config.engine.check_invariants:
                s.check_invariants(out)
            message.update(
                iteration=s.iteration,
                output=out.to_dict(),
                chunks=batch_chunks(out, s.pool),
                held=held_blocks(out, s.pool, self.spec),
            )
        message["new"], self._unsent_new = self._unsent_new, []
        message["transitions"], self._unsent_records = self._unsent_records, []
        return message, step

    def _complete(self, step: Step, sampled: dict[Hashable, int]) -> None:
        s = self.driver
        step.finish(sampled)
        if self.config.engine.check_invariants:
            s.check_invariants()
        stats = s.stats()
        for key in STEP_TOTALS:
            self.totals[key] += getattr(stats, key)
        self.totals["steps"] += 1

    # ----------------------------------------------------------------------------------------- every rank
    def _apply(self, message: dict[str, Any]) -> list[MigrationPlan]:
        """Mirror the message on this rank; returns the migration plans a rank r > 0 executes (none on rank 0,
        which executes its step's, and none when the message stops the run)."""
        now = message["now"]
        mirrors = self._mirror_book() if self.rank else None
        if mirrors is not None:
            for data in message["new"]:
                mirrors.add(data)
                self.sampling[data["request_id"]] = data["sampling"]
            for record in message["transitions"]:
                mirrors.apply(record)
                self.trace.write(record)
                if record["event"] == "consensus":
                    self.book.release(record["request_id"], now, record["to"])
        if message["stop"]:
            return []
        plans = mirrors.output(message["output"]).migrations if mirrors is not None else []
        for rid, blocks in message["held"]:
            if mirrors is not None and mirrors.requests[rid].state != self._pending_reset:
                raise KVStateError(
                    f"rank {self.rank}: {rid!r} is announced as awaiting consensus but is "
                    f"{mirrors.requests[rid].state} here"
                )
            self.book.announce(rid, message["iteration"], blocks)
        return plans

    def _execute(self, message: dict[str, Any], plans: Sequence[MigrationPlan], hidden: torch.Tensor | None) -> Any:
        """Migrations and this stage's share of the forward pass over `hidden` (the previous stage's output);
        returns this stage's hidden states, or on the last stage the sampled tokens."""
        fences = [self.cache.execute(plan) for plan in plans]
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for plan, fence in zip(plans, fences, strict=True):
            if plan.direction == TO_GPU:  # the forward reads resumed blocks; offloaded ones only free after the wait
                fence.order_before(stream)
        writers = [(rid, table) for rid, _, _, table, _ in message["chunks"]]
        writers += [(p.request_id, [dst for _, dst in p.pairs]) for p in plans if p.direction == TO_GPU]
        self.book.check_untouched(writers, message["iteration"])
        result = self._forward(message["iteration"], message["chunks"], hidden)
        for fence in fences:
            fence.wait()  # a fenced source is reused only by later micro-batches, after this wait on every stage
        return result

    def _forward(self, iteration: int, chunks: Sequence[list], hidden: torch.Tensor | None) -> Any:
        stage = self.stage
        if not chunks:
            return {} if stage.is_last else None
        e = self.config.engine
        batch = self.planners[iteration % self.micro_batches].plan(  # the slot's previous pass: module docstring
            [
                SeqChunk(tuple(tokens), start, tuple(table), samples, rid)
                for rid, start, tokens, table, samples in chunks
            ]
        )
        result = stage.forward_stage(batch, self.stage_cache, hidden)
        if not stage.is_last:
            return result
        samplers = [(rid, start + len(tokens)) for rid, start, tokens, _, samples in chunks if samples]
        if not samplers:
            return {}
        ids = [rid for rid, _ in samplers]
        tokens = sample_batch(
            result,
            [self.sampling[rid] for rid in ids],
            seed=e.seed,
            request_ids=ids,
            positions=[pos for _, pos in samplers],
        )
        return dict(zip(ids, (int(t) for t in tokens), strict=True))

    def run(self) -> RankResult:
        """The loop; returns this rank's result once rank 0 says stop. Raises `PipelineFailed` on rank 0's error."""
        started, cpu = time.perf_counter(), time.process_time()
        try:
            self._drive() if self.rank == 0 else self._follow()
            if self.world_size > 1:
                self.comm.flush()
        finally:
            self.trace.close()
        return self._result(time.perf_counter() - started, time.process_time() - cpu)

    def _drive(self) -> None:
        """Rank 0: land, agree, plan, post, compute stage 0; up to `micro_batches` micro-batches in flight."""
        s = self.driver
        in_flight: deque[tuple[int, Step]] = deque()  # (iteration, step) posted and not landed, oldest first
        while True:
            while s.must_land(len(in_flight)):
                self._land_oldest(in_flight)
            self._client_actions()
            self._now = now = s.iteration + 1
            reports = [self.book.acks(now), *self._remote_acks]
            message, step = self._plan(self.book.agree(reports, now))
            while message["stop"] and not message["error"] and in_flight:
                self._land_oldest(in_flight)  # consensus ended the last requests: the rest carries nothing
            message.update(now=now, reports=reports, acks=[])
            self._apply(message)
            self.iteration = message["iteration"]
            if message["stop"]:
                if self.world_size > 1:
                    self.comm.send_message(message, 1)
                self._stop(message)
                return
            assert step is not None  # a message that does not stop carries a step
            for plan in step.to_issue():  # every stage issues them before any later micro-batch, and waits for them
                step.issued(plan, plan)
            for plan, _ in step.to_wait():
                step.waited(plan)
            step.complete_migrations()
            without, relocked = resume_copies(step.output)  # now: a later pass may schedule the resumed requests
            self.totals["resumed_without_copy"] += without
            self.totals["blocks_relocked"] += relocked
            result = self._execute(message, step.output.migrations, None)
            self.book.retire(self.iteration)
            if self.world_size == 1:
                self._complete(step, result)
            else:
                self.comm.send_message(message, 1, result)  # the message travels with the hidden states
                in_flight.append((self.iteration, step))
                self.comm.expect(self.world_size - 1)  # its tokens will come back

    def _land_oldest(self, in_flight: deque[tuple[int, Step]]) -> None:
        """Rank 0: the oldest micro-batch in flight left the last stage; take its tokens and acknowledgements, and
        post the receive of the next one's while it is still in flight."""
        iteration, step = in_flight.popleft()
        landed, _ = self._receive(self.world_size - 1)
        if in_flight:
            self.comm.expect(self.world_size - 1)
        if landed["iteration"] != iteration:
            raise KVStateError(
                f"rank 0 expected the tokens of iteration {iteration} from the last stage but got "
                f"those of iteration {landed['iteration']}: micro-batches must leave in order"
            )
        self._remote_acks = landed["reports"]
        self._complete(step, landed["tokens"])

    def _follow(self) -> None:
        """Rank r > 0: receive each message from rank r-1, mirror it, pass it on, compute this stage."""
        last = self.rank == self.world_size - 1
        while True:
            message, hidden = self._receive(self.rank - 1)
            if not message["stop"]:
                self.comm.expect(self.rank - 1)  # rank r-1 sends at least its stop message after this one
            now = message["now"]
            self.book.agree(message["reports"], now)
            plans = self._apply(message)
            self.iteration = message["iteration"]
            if not last:
                message["acks"].append(self.book.acks(now))
            if message["stop"]:
                if not last:
                    self.comm.send_message(message, self.rank + 1)
                self._stop(message)
                return
            result = self._execute(message, plans, hidden)
            self.book.retire(self.iteration)
            if last:
                reports = [*message["acks"], self.book.acks(now)]
                self.comm.send_message({"iteration": self.iteration, "tokens": result, "reports": reports}, 0)
            else:
                self.comm.send_message(message, self.rank + 1, result)

    def _receive(self, src: int) -> tuple[Any, torch.Tensor | None]:
        """The next message from rank `src`, the wall time spent waiting for it added to `receive_wait_s`."""
        started = time.perf_counter()
        try:
            return self.comm.recv_message(src)
        finally:
            self.receive_wait_s += time.perf_counter() - started

    @staticmethod
    def _stop(message: dict[str, Any]) -> None:
        if message["error"]:
            raise PipelineFailed(f"rank 0 stopped the pipeline: {message['error']}")

    def _result(self, wall: float, cpu: float) -> RankResult:
        common = RankResult(
            rank=self.rank,
            world_size=self.world_size,
            layers=tuple(self.stage.layer_range),
            host_tier=self.host.to_dict(),
            iterations=self.iteration,
            trace=tuple(self.trace.lines),
            pauses=tuple(r.to_dict() for r in self.book.history),
            copy_calls=self.cache.num_copies,
            wall_s=wall,
            cpu_s=cpu,
            receive_wait_s=self.receive_wait_s,
            micro_batches=self.micro_batches,
        )
        if self.rank:
            return common
        s = self.driver
        usage = s.pool.usage()
        leaked = (
            (usage["gpu_capacity"] - usage["gpu_free"])
            + (usage["host_capacity"] - usage["host_free"])
            + len(s.pool.in_flight)
        )
        final = s.stats().requests_per_state
        totals = dict(self.totals)
        totals["events"] = dict(self.events)
        return replace(
            common,
            outputs={rid: list(r.generated) for rid, r in s.finished.items()},
            done_reasons={rid: r.done_reason for rid, r in s.finished.items()},
            totals=totals,
            peak_states={state.name: s.peak_per_state.get(state.name, 0) for state in self.spec.states},
            final_states=dict(final),
            leaked_blocks=leaked,
        )


def run_rank(
    rank: int, world_size: int, config: PipelineConfig, requests: Sequence[PipelineRequest], comm: Comm | None = None
) -> RankResult:
    """Run this rank of a pipeline (the process group must be initialised when `world_size` > 1).
    Only rank 0 reads `requests`."""
    comm = comm or pipeline_comm(
        rank, world_size, config, torch.device(local_devices(config, world_size).device_of(rank))
    )
    node = PipelineRank(rank, world_size, config, comm)
    if rank == 0:
        for request in requests:
            node.submit(request)
    return node.run()
