"""A pure stepping driver: runs the real `Scheduler` without torch, on a token-level model of the KV cache.

Each block slot of each tier stores the token id whose KV it holds. A scheduled chunk writes its tokens into
the request's GPU block table, migrations copy slots between tiers, and the produced token is a deterministic
function of the tokens *read back* from the block table — so a lost, stale or misplaced block changes the
output, just as garbled KV would in a real engine. `reference_output` runs one request alone with unlimited
memory: OUT-EQUIV says every finished output equals it.

Each pipeline stage keeps its own KV slots (its layers' KV: `gpu_stages`, `host_stages`; `gpu` and `host` are the
first stage's). A stage writes a chunk's tokens into its slots and reads the context back from them; every stage
must read what the first one read, or the output is garbled (OUT-EQUIV). With `micro_batches` > 1 it models a
pipeline with that many micro-batches in flight, at most: the first stage runs a scheduled output's forward pass at
once, the later stages when it leaves the last stage, when `Scheduler.must_land` says so (or earlier, `land`), and
then its tokens land; the stages run micro-batches in order, so a later pass's KV writes follow at every stage. A
pending recompute-pause is agreed once the pass that announced it has landed (every stage retired it). Copies
complete at their own time and move the slots of every stage then (`SimExecutor`'s docstring), so a block released
while a micro-batch in flight still writes or reads it, and refilled by a copy, garbles an output.
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import cast

from kvstate.errors import InvariantViolation, KVStateError
from kvstate.output import SchedulerOutput, planned_chunks
from kvstate.pool import TO_HOST, MigrationPlan
from kvstate.scheduler import Scheduler, Step

DEFAULT_VOCAB = 1000


def next_token(context: Sequence[int], vocab: int = DEFAULT_VOCAB) -> int:
    """The token a deterministic 'model' produces after `context` (depends on every context token)."""
    return zlib.crc32(array("q", context).tobytes()) % vocab


def reference_output(
    prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = (), vocab: int = DEFAULT_VOCAB
) -> list[int]:
    """The output of one request run alone with unlimited memory. Each token is `next_token` of the context so far,
    computed from a running checksum of the context (CRC-32 extends over appended bytes), so the whole output takes
    time linear in its context, not quadratic."""
    running, out = zlib.crc32(array("q", prompt).tobytes()), list[int]()
    while len(out) < max_new_tokens:
        token = running % vocab
        out.append(token)
        running = zlib.crc32(array("q", (token,)).tobytes(), running)
        if token in stop_token_ids:
            break
    return out


class MicroBatchesExceeded(KVStateError, RuntimeError):
    """More scheduler outputs would be in flight than the executor's `micro_batches`; nothing was carried out."""


@dataclass(frozen=True, slots=True)
class StageWork:
    """What the stages after the first still do for one chunk of a micro-batch in flight: write `tokens` from
    position `start` through `block_table` (as planned), and, for a chunk that produces a token, read back the
    `context` the first stage read."""

    request_id: Hashable
    block_table: tuple[int, ...]
    start: int
    tokens: tuple[int, ...]
    context: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class InFlightCopy:
    """A migration plan the executor has issued and not yet reported complete or failed: the `Step` that carries it
    out, and the last iteration at whose end it completes at the latest (`SimExecutor.copy_delay`)."""

    step: Step[MigrationPlan]
    plan: MigrationPlan
    due: int


class SimExecutor:
    """Carries out scheduler outputs on slot-level KV contents, one `kvstate.scheduler.Step` at a time.

    Executor timing (what the spec lets an executor do, SPEC.md sections 4.0 and 9): a copy moves its slots when it
    *completes*, reading its sources then, so a source block reused before its copy completed corrupts the copy
    (FENCE is checked by its effect on outputs); it completes at the end of its own step (after the forward pass), or
    up to `copy_delay` passes later, or earlier when told (`complete_copy`); it may instead fail, when issued
    (`step(fail=...)`) or later (`fail_copy`); with `micro_batches` > 1 up to that many outputs are in flight, landing
    when `Scheduler.must_land` says or earlier when told (`land`). The model checker's refinement explores every
    such choice; the defaults are the in-repo executors' timing (copies complete within their step).

    Invariant kept: after every step, the slots of each running request's block table hold exactly the tokens
    it has computed, in order (with micro-batches in flight: also those of its step still in flight), once its
    copies completed. A never-written slot raises OUT-EQUIV at once; a slot holding a wrong token changes the
    produced token, which the comparison with `reference_output` catches.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        vocab: int = DEFAULT_VOCAB,
        *,
        complete_fences: bool = True,
        check_invariants: bool = True,
        micro_batches: int = 1,
        copy_delay: int = 0,
    ) -> None:
        """`complete_fences=False`: copies never complete by themselves (only `complete_copy` ends them)."""
        if copy_delay < 0:
            raise ValueError(f"copy_delay must be >= 0 passes, got {copy_delay}")
        self.scheduler = scheduler
        self.micro_batches = micro_batches
        self.copy_delay = copy_delay
        self.pipeline: deque[tuple[Step, dict[Hashable, int]]] = deque()  # carried out, not landed
        self.copies: list[InFlightCopy] = []  # issued, neither complete nor failed, in issue order
        self.last_step: Step[MigrationPlan] | None = None  # the step `step` carried out last
        if micro_batches > 1:
            scheduler.track_in_flight(micro_batches)
        self.vocab = vocab
        self.complete_fences = complete_fences
        self.check_invariants = check_invariants
        self.stages = scheduler.pool.pipeline_stages
        self.later_stages: deque[tuple[StageWork, ...]] = deque()  # per output in `pipeline`: its later stages' work
        size = scheduler.config.block_size
        self.gpu_stages: list[list[list[int | None]]] = [
            [[None] * size for _ in range(scheduler.pool.gpu.capacity)] for _ in range(self.stages)
        ]
        self.host_stages: list[list[list[int | None]]] = []
        self.sync_host_tier()
        self.gpu: list[list[int | None]] = self.gpu_stages[0]

    def sync_host_tier(self) -> None:
        """Call after the scheduler's host tier changed size: host contents are gone."""
        size, capacity = self.scheduler.config.block_size, self.scheduler.pool.host.capacity
        empty: list[int | None] = [None] * size
        self.host_stages = [[list(empty) for _ in range(capacity)] for _ in range(self.stages)]
        self.host: list[list[int | None]] = self.host_stages[0]

    def step(self, fail: Collection[int] = ()) -> SchedulerOutput:
        """Land what must land first (`Scheduler.must_land`), then one `kvstate.scheduler.Step`: schedule, issue the
        copies (those at the positions `fail` names in the output's migrations fail at once), compute, complete the
        copies that are due (landed at once with one micro-batch). Returns the output carried out."""
        scheduler = self.scheduler
        while scheduler.must_land(len(self.pipeline)):
            self.land()
        if len(self.pipeline) >= self.micro_batches:
            raise MicroBatchesExceeded(
                f"{len(self.pipeline)} micro-batch(es) are in flight and the executor keeps {self.micro_batches} at "
                "most: the scheduler planned a pass before the oldest landed (Scheduler.must_land)"
            )
        if scheduler.pool.pipeline_stages > 1:
            scheduler.reach_consensus(self.agreed())
        step: Step[MigrationPlan] = Step.begin(scheduler)
        self.last_step = step
        if self.check_invariants:
            scheduler.check_invariants(step.output)
        due = scheduler.iteration + self.copy_delay
        for index, plan in enumerate(step.to_issue()):
            step.issued(plan, None if index in fail else plan)  # the plan is its own fence
            if index not in fail:
                self.copies.append(InFlightCopy(step, plan, due))
        if step.failures and self.check_invariants:
            scheduler.check_invariants(step.output)
        sampled, later = self._first_stage(step.output)
        if self.micro_batches > 1:
            self.later_stages.append(later)
        else:
            self._later_stages(later)
        if self.complete_fences:
            for copy in [c for c in self.copies if c.due <= scheduler.iteration]:
                self._end(copy, failed=False)
        self.pipeline.append((step, sampled))
        if self.micro_batches == 1:
            self.land()
        return step.output

    def copy_of(self, request_id: Hashable) -> InFlightCopy | None:
        """The copy of `request_id`'s KV in flight, if any (the guards allow one per request)."""
        return next((c for c in self.copies if c.plan.request_id == request_id), None)

    def complete_copy(self, request_id: Hashable) -> None:
        """The in-flight copy of `request_id` completes now (before it is due): its slots move, and the scheduler is
        told."""
        self._end(self._copy_of(request_id), failed=False)

    def fail_copy(self, request_id: Hashable) -> None:
        """The in-flight copy of `request_id` fails now: nothing moves (its destinations hold nothing usable), and
        the failure is reported (`Step.failed`: undone through `Scheduler.fail_migration` while its request still
        reads the destinations, else it ends its fences as a completion would)."""
        self._end(self._copy_of(request_id), failed=True)

    def _copy_of(self, request_id: Hashable) -> InFlightCopy:
        found = self.copy_of(request_id)
        if found is None:
            raise ValueError(f"request {request_id!r} has no copy in flight")
        return found

    def _end(self, copy: InFlightCopy, *, failed: bool) -> None:
        self.copies.remove(copy)
        if failed:
            size = self.scheduler.config.block_size
            for dest in self.host_stages if copy.plan.direction == TO_HOST else self.gpu_stages:
                for _, dst in copy.plan.pairs:
                    dest[dst] = [None] * size
            copy.step.failed(copy.plan)
        else:
            self.copy(copy.plan)
            copy.step.waited(copy.plan)
            copy.step.complete(copy.plan)
        if self.check_invariants:
            self.scheduler.check_invariants()

    def land(self) -> SchedulerOutput:
        """The oldest micro-batch in flight leaves the last stage: its tokens land."""
        step, sampled = self.pipeline.popleft()
        if self.micro_batches > 1:
            self._later_stages(self.later_stages.popleft())
        step.finish(sampled)
        if self.check_invariants:
            self.scheduler.check_invariants()
        return step.output

    def copy(self, plan: MigrationPlan) -> MigrationPlan:
        """Copy `plan`'s slots between tiers now, at every stage (its completion; the plan is its own fence)."""
        for gpu, host in zip(self.gpu_stages, self.host_stages, strict=True):
            source, dest = (gpu, host) if plan.direction == TO_HOST else (host, gpu)
            for src, dst in plan.pairs:
                dest[dst] = list(source[src])
        return plan

    def agreed(self) -> list[Hashable] | None:
        """Pending recompute-pauses every stage has retired (None: all of them, nothing is in flight)."""
        if not self.pipeline:
            return None
        announced = {r.request_id for step, _ in self.pipeline for r in step.output.recompute_paused}
        return [rid for rid in self.scheduler.requests if rid not in announced]

    def compute(self, out: SchedulerOutput) -> dict[Hashable, int]:
        """The forward pass of `out` at every stage, now: write each chunk's tokens into its KV slots, read the whole
        context back from the block table, and produce a token for every chunk that produces one."""
        sampled, later = self._first_stage(out)
        self._later_stages(later)
        return sampled

    def _first_stage(self, out: SchedulerOutput) -> tuple[dict[Hashable, int], tuple[StageWork, ...]]:
        """The first stage's forward pass of `out` (`compute`), and what the later stages still do."""
        size = self.scheduler.config.block_size
        sampled, later = {}, []
        gpu = self.gpu
        for chunk in planned_chunks(out, self.scheduler.pool):
            table = chunk.block_table
            for offset, token in enumerate(chunk.tokens, chunk.start):
                gpu[table[offset // size]][offset % size] = token
            context = None
            if chunk.produces_token:
                read = [gpu[table[pos // size]][pos % size] for pos in range(chunk.start + len(chunk.tokens))]
                if None in read:
                    raise InvariantViolation(
                        "OUT-EQUIV",
                        f"request {chunk.request.request_id!r} reads KV that was never "
                        f"written (position {read.index(None)}); a block was lost or misplaced",
                    )
                context = tuple(cast("list[int]", read))
                sampled[chunk.request.request_id] = next_token(context, self.vocab)
            if self.stages > 1:
                later.append(
                    StageWork(chunk.request.request_id, tuple(table), chunk.start, tuple(chunk.tokens), context)
                )
        return sampled, tuple(later)

    def _later_stages(self, later: tuple[StageWork, ...]) -> None:
        """The stages after the first run their share of a micro-batch, in stage order."""
        for stage in range(1, self.stages):
            for work in later:
                self._run_stage(stage, work)

    def _run_stage(self, stage: int, work: StageWork) -> None:
        """A later stage's share of one chunk: write its tokens, and read back what the first stage read (anything
        else is KV another request or a copy put in a block this chunk still uses: a garbled output)."""
        size, slots = self.scheduler.config.block_size, self.gpu_stages[stage]
        table = work.block_table
        for offset, token in enumerate(work.tokens, work.start):
            slots[table[offset // size]][offset % size] = token
        if work.context is None:
            return
        for pos, expected in enumerate(work.context):
            found = slots[table[pos // size]][pos % size]
            if found != expected:
                raise InvariantViolation(
                    "OUT-EQUIV",
                    f"request {work.request_id!r}: pipeline stage {stage} reads {found!r} at position {pos} where the "
                    f"first stage read {expected!r} (block {table[pos // size]} was released or refilled before every "
                    "stage retired the micro-batch that uses it)",
                )

    def run(self, max_iterations: int = 100_000) -> dict[Hashable, list[int]]:
        """Step until every request is done; returns {id: generated tokens} of all finished requests."""
        for _ in range(max_iterations):
            if not self.scheduler.has_unfinished:
                break
            self.step()
        while self.pipeline:
            self.land()
        while self.copies:
            self._end(self.copies[0], failed=False)
        return {rid: list(r.generated) for rid, r in self.scheduler.finished.items()}
