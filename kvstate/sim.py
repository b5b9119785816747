"""A pure stepping driver: runs the real `Scheduler` without torch, on a token-level model of the KV cache.

Each block slot of each tier stores the token id whose KV it holds. A scheduled chunk writes its tokens into
the request's GPU block table, migrations copy slots between tiers, and the produced token is a deterministic
function of the tokens *read back* from the block table — so a lost, stale or misplaced block changes the
output, just as garbled KV would in a real engine. `reference_output` runs one request alone with unlimited
memory: OUT-EQUIV says every finished output equals it.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Hashable, Sequence

from kvstate.errors import InvariantViolation
from kvstate.output import SchedulerOutput, planned_chunks
from kvstate.pool import TO_HOST
from kvstate.scheduler import Scheduler

DEFAULT_VOCAB = 1000


def next_token(context: Sequence[int], vocab: int = DEFAULT_VOCAB) -> int:
    """The token a deterministic 'model' produces after `context` (depends on every context token)."""
    return zlib.crc32(array("q", context).tobytes()) % vocab


def reference_output(prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                     vocab: int = DEFAULT_VOCAB) -> list[int]:
    """The output of one request run alone with unlimited memory."""
    context, out = list(prompt), []
    while len(out) < max_new_tokens:
        token = next_token(context, vocab)
        out.append(token)
        context.append(token)
        if token in stop_token_ids:
            break
    return out


class SimExecutor:
    """Carries out scheduler outputs on slot-level KV contents.

    Invariant kept: after every step, the slots of each running request's block table hold exactly the tokens
    it has computed, in order. A never-written slot raises OUT-EQUIV at once; a slot holding a wrong token
    changes the produced token, which the comparison with `reference_output` catches.
    """

    def __init__(self, scheduler: Scheduler, vocab: int = DEFAULT_VOCAB, *, complete_fences: bool = True,
                 check_invariants: bool = True) -> None:
        self.scheduler = scheduler
        self.vocab = vocab
        self.complete_fences = complete_fences
        self.check_invariants = check_invariants
        size = scheduler.config.block_size
        self.gpu: list[list[int | None]] = [[None] * size for _ in range(scheduler.pool.gpu.capacity)]
        self.host: list[list[int | None]] = [[None] * size for _ in range(scheduler.pool.host.capacity)]

    def sync_host_tier(self) -> None:
        """Call after the scheduler's host tier changed size: host contents are gone."""
        size = self.scheduler.config.block_size
        self.host = [[None] * size for _ in range(self.scheduler.pool.host.capacity)]

    def step(self) -> SchedulerOutput:
        """Schedule, migrate, compute and complete one iteration."""
        scheduler = self.scheduler
        if scheduler.pool.pipeline_stages > 1:
            scheduler.reach_consensus()
        out = scheduler.schedule()
        if self.check_invariants:
            scheduler.check_invariants(out)
        for plan in out.migrations:
            source, dest = (self.gpu, self.host) if plan.direction == TO_HOST else (self.host, self.gpu)
            for src, dst in plan.pairs:
                dest[dst] = list(source[src])
        if self.complete_fences:
            scheduler.complete_migrations(out)
        scheduler.complete_step(out, self.compute(out))
        if self.check_invariants:
            scheduler.check_invariants()
        return out

    def compute(self, out: SchedulerOutput) -> dict[Hashable, int]:
        """The forward pass of `out`: write each chunk's tokens into its KV slots, read the whole context back
        from the block table, and produce a token for every chunk that produces one."""
        size = self.scheduler.config.block_size
        sampled = {}
        for chunk in planned_chunks(out, self.scheduler.pool):
            table = chunk.block_table
            for offset, token in enumerate(chunk.tokens, chunk.start):
                self.gpu[table[offset // size]][offset % size] = token
            if not chunk.produces_token:
                continue
            context = [self.gpu[table[pos // size]][pos % size] for pos in range(chunk.start + len(chunk.tokens))]
            if None in context:
                raise InvariantViolation("OUT-EQUIV", f"request {chunk.request.request_id!r} reads KV that was never "
                                         f"written (position {context.index(None)}); a block was lost or misplaced")
            sampled[chunk.request.request_id] = next_token(context, self.vocab)
        return sampled

    def run(self, max_iterations: int = 100_000) -> dict[Hashable, list[int]]:
        """Step until every request is done; returns {id: generated tokens} of all finished requests."""
        for _ in range(max_iterations):
            if not self.scheduler.has_unfinished:
                break
            self.step()
        return {rid: list(r.generated) for rid, r in self.scheduler.finished.items()}
