"""The decode fast path equals the reference path under any sequence of batches: a Hypothesis state machine steps a
`BatchPlanner` (the system under test: a kept decode plan and its `DecodeKV`) and `PagedBatch.build` (the reference)
side by side, each on a cache of its own, over the same batches.

The batches are the ones serving produces: requests join (their prefill chunks come first in the batch, then the
decode steps), leave from the front, the back or the middle, decode across block boundaries, are suspended and
resumed, have their blocks moved, take over the very blocks another request left while the planner saw no batch,
are handed a new table object holding the same blocks, or come in another order; a step may also be empty.
After every step the two batches hold the same values, the logits are equal bit for bit, the two caches hold the
same keys and values, and every row a `DecodeKV` keeps equals a fresh gather of the cache over the request's
context. A difference shrinks to a short step list.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from executor import BatchPlanner, LlamaModel, PagedBatch, PagedKVCache, SeqChunk
from executor.batch import gather_blocks
from executor.decode_kv import DECODE_KV_BUDGET_BYTES
from kvstate.output import PlannedBatch
from kvstate.pool import ceil_div

BLOCK = 4
NUM_BLOCKS = 40
MAX_ACTIVE = 6  # requests holding blocks at once (prefilling and decoding)
MAX_CONTEXT = 20  # a request leaves (finishes) once its next position would be this: at most 5 blocks each
TIGHT_BUDGET = 48 << 10  # some layers' buffers fit, others do not: they are gathered every step
STEPS = settings(stateful_step_count=30, deadline=None)

TOKENS = st.integers(0, 511)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=9)


@dataclass
class _Request:
    """One request as the machine tracks it: every token whose key and value are or will be in its blocks (the
    prompt, then each token produced), how many are in the cache, and its block table (a new tuple when it
    changes, as the scheduler's pool hands them over)."""

    owner: int
    tokens: list[int]
    computed: int
    table: tuple[int, ...]
    host_copy: torch.Tensor | None = None  # its blocks' contents while it is suspended (the same in both caches)


class DecodePlanMachine(RuleBasedStateMachine):
    """`planner` (the system under test) beside `PagedBatch.build` (the reference) on the same batches of `model`."""

    def __init__(self, model: LlamaModel, planner: BatchPlanner) -> None:
        super().__init__()
        self.model, self.planner = model, planner
        self.planned, self.fresh = (
            PagedKVCache.for_model(model, NUM_BLOCKS, block_size=BLOCK, device="cpu") for _ in range(2)
        )
        self.free = list(range(NUM_BLOCKS))  # the lowest free blocks are taken first, as the pool does
        self.prefilling: list[_Request] = []  # admitted, prompt not all computed: its chunks lead the batch
        self.decoding: list[_Request] = []  # batch order
        self.suspended: list[_Request] = []  # its blocks' contents copied out, its blocks freed
        self.owners = 0
        self.plans = 0  # calls of planner.plan
        self.kept_plan = False  # the last batch was a kept decode plan's

    # ----------------------------------------------------------------------------------------------- blocks
    def _cover(self, request: _Request, positions: int) -> None:
        """Give `request` blocks for positions ``0 .. positions - 1`` (a new table object when it grows)."""
        needed = ceil_div(positions, BLOCK) - len(request.table)
        if needed > 0:
            assert len(self.free) >= needed, "the machine's bounds leave room for every active request"
            taken, self.free = self.free[:needed], self.free[needed:]
            request.table = (*request.table, *taken)

    def _release(self, request: _Request) -> None:
        self.free = sorted(self.free + list(request.table))
        request.table = ()

    def _write_outside_the_planner(self, request: _Request) -> None:
        """Compute `request`'s tokens into both caches with no batch the planner sees (a request that took the
        blocks another left)."""
        self._cover(request, request.computed)
        chunk = SeqChunk(tuple(request.tokens[: request.computed]), 0, request.table, False, request.owner)
        for cache in (self.planned, self.fresh):
            self.model.forward_paged(PagedBatch.build([chunk], BLOCK), cache)

    def _new_owner(self) -> int:
        self.owners += 1
        return self.owners

    @property
    def _active(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    # ------------------------------------------------------------------------------------------------ rules
    @initialize(prompts=st.lists(PROMPTS, min_size=2, max_size=MAX_ACTIVE - 1))
    def admit(self, prompts: list[list[int]]) -> None:
        """The first requests are admitted together."""
        for prompt in prompts:
            self.join(prompt)

    @precondition(lambda self: self._active < MAX_ACTIVE and len(self.prefilling) < 2)
    @rule(prompt=PROMPTS)
    def join(self, prompt: list[int]) -> None:
        """A request is admitted: its prompt is prefilled by the next steps, then it decodes after the others."""
        self.prefilling.append(_Request(self._new_owner(), list(prompt), 0, ()))

    @precondition(lambda self: self._active)
    @rule(steps=st.integers(1, 4), chunk=st.sampled_from([4, 8, 2, 1]), as_columns=st.booleans())
    def step(self, steps: int, chunk: int, as_columns: bool) -> None:
        """`steps` forward passes in a row (fewer when every request has left): each a prefill chunk of every
        prefilling request (at most `chunk` tokens), then one decode step of every decoding request, as the
        scheduler's columns or as chunk records, both naming their owners."""
        for _ in range(steps):
            if self._active:
                self._step(chunk, as_columns)

    def _step(self, chunk: int, as_columns: bool) -> None:
        for request in [r for r in self.decoding if r.computed >= MAX_CONTEXT]:
            self.decoding.remove(request)  # finished
            self._release(request)
        rows: list[tuple[_Request, SeqChunk]] = []
        for request in self.prefilling:
            start = request.computed
            end = min(start + chunk, len(request.tokens))
            self._cover(request, end)
            tokens = tuple(request.tokens[start:end])
            rows.append((request, SeqChunk(tokens, start, request.table, end == len(request.tokens), request.owner)))
        for request in self.decoding:
            self._cover(request, request.computed + 1)
            decode = SeqChunk((request.tokens[-1],), request.computed, request.table, True, request.owner)
            rows.append((request, decode))
        chunks = [c for _, c in rows]
        logits = self._compare(_as_columns(chunks) if as_columns else chunks, chunks)
        sampled = iter(logits.argmax(-1).tolist())
        prefilled = []
        for request, c in rows:
            request.computed += len(c.tokens)
            if c.produces_token:
                request.tokens.append(next(sampled))
                if request in self.prefilling:
                    prefilled.append(request)
        self.prefilling = [r for r in self.prefilling if r not in prefilled]
        self.decoding.extend(prefilled)  # after the others, as the scheduler appends

    @precondition(lambda self: self.kept_plan)
    @rule()
    def empty_step(self) -> None:
        """A step with nothing to compute after a step of a kept plan: the planner is handed an empty batch, and
        forgets its plan."""
        self._compare([], [])

    @precondition(lambda self: self.decoding)
    @rule(where=st.sampled_from(["front", "back", "middle"]), suspend=st.booleans())
    def leave(self, where: str, suspend: bool) -> None:
        """A decoding request leaves (finished, cancelled, recompute-paused or suspended) from the front, the back
        or the middle of the batch; its blocks are freed at once."""
        index = {"front": 0, "back": len(self.decoding) - 1, "middle": len(self.decoding) // 2}[where]
        request = self.decoding.pop(index)
        if suspend:  # its keys and values copied to the host tier, byte for byte
            request.host_copy = self.planned.device_cache[list(request.table)].clone()
            assert torch.equal(request.host_copy, self.fresh.device_cache[list(request.table)])
            self.suspended.append(request)
        self._release(request)

    @precondition(lambda self: self.suspended and self._active < MAX_ACTIVE)
    @rule()
    def resume(self) -> None:
        """The longest suspended request comes back into the lowest free blocks (often the ones it or another
        request just left), its keys and values copied there byte for byte with no batch planned, and decodes
        after the others."""
        request = self.suspended.pop(0)
        copy, request.host_copy = request.host_copy, None
        assert copy is not None
        self._cover(request, copy.shape[0] * BLOCK)
        for cache in (self.planned, self.fresh):
            cache.device_cache[list(request.table)] = copy
        self.decoding.append(request)

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def move_blocks(self, data: st.DataObject) -> None:
        """A request's keys and values move to other blocks (the highest free ones: a suspend and a resume while
        the planner sees no batch), byte for byte; it keeps its row, and its table is a new tuple."""
        request = data.draw(st.sampled_from(self.decoding), label="request")
        old = list(request.table)
        assert len(self.free) >= len(old), "the machine's bounds leave room for every active request"
        new, self.free = self.free[-len(old) :], self.free[: -len(old)]
        for cache in (self.planned, self.fresh):
            cache.device_cache[new] = cache.device_cache[old]
        request.table = tuple(new)
        self.free = sorted(self.free + old)

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def take_over(self, data: st.DataObject) -> None:
        """A decoding request leaves and, before the planner sees another batch, a new request takes its very
        blocks (a new table object) and its row, with keys and values of its own, due to decode at the position
        the one that left was."""
        index = data.draw(st.integers(0, len(self.decoding) - 1), label="row")
        gone = self.decoding[index]
        tokens = data.draw(st.lists(TOKENS, min_size=gone.computed + 1, max_size=gone.computed + 1), label="tokens")
        request = _Request(self._new_owner(), tokens, gone.computed, _new_tuple(gone.table))
        gone.table = ()
        self._write_outside_the_planner(request)
        self.decoding[index] = request

    @precondition(lambda self: self.decoding)
    @rule(data=st.data())
    def new_table_object(self, data: st.DataObject) -> None:
        """A request's table is handed over as a new tuple holding the same blocks."""
        request = data.draw(st.sampled_from(self.decoding), label="request")
        request.table = _new_tuple(request.table)

    @precondition(lambda self: len(self.decoding) >= 2)
    @rule(data=st.data())
    def reorder(self, data: st.DataObject) -> None:
        """Two decoding requests swap places in the batch."""
        i, j = data.draw(st.lists(st.integers(0, len(self.decoding) - 1), min_size=2, max_size=2, unique=True))
        self.decoding[i], self.decoding[j] = self.decoding[j], self.decoding[i]

    # ---------------------------------------------------------------------------------------------- checks
    def _compare(self, given: list[SeqChunk] | PlannedBatch, chunks: list[SeqChunk]) -> torch.Tensor:
        """Plan `given` and build `chunks` (the same batch), check that they hold the same values, run both and
        check that their logits are equal bit for bit; returns the logits."""
        planned = self.planner.plan(given)
        self.plans += 1
        self.kept_plan = planned.decode_kv is not None
        built = PagedBatch.build(chunks, BLOCK)
        _assert_same_batch(planned, built)
        if not chunks:
            return torch.empty(0, self.model.config.vocab_size)
        logits = self.model.forward_paged(planned, self.planned)
        reference = self.model.forward_paged(built, self.fresh)
        assert torch.equal(logits, reference), (logits - reference).abs().max()
        self._assert_kept_rows_equal_a_gather(planned)
        return reference

    def _assert_kept_rows_equal_a_gather(self, batch: PagedBatch) -> None:
        """Every kept row of the batch's `DecodeKV` holds what a fresh gather of the cache holds, at every position
        of the request's context; a kept layer has a row per decode request."""
        if batch.decode_kv is None:
            return
        assert batch.groups is not None
        group = batch.groups[0]  # the decode requests
        contexts = batch.positions[group.row_start : group.row_start + group.num_seqs] + 1
        for layer, kept in batch.decode_kv.kept.items():
            assert kept[0].shape[0] == group.num_seqs
            cache = (self.planned.layer_keys(layer), self.planned.layer_values(layer))
            gathered = gather_blocks(cache, group)
            for row, context in enumerate(contexts.tolist()):
                for mine, theirs in zip(kept, gathered, strict=True):
                    assert torch.equal(mine[row, :, :context], theirs[row, :, :context]), (layer, row)

    @invariant()
    def caches_hold_the_same_keys_and_values(self) -> None:
        assert torch.equal(self.planned.device_cache, self.fresh.device_cache)

    @invariant()
    def every_plan_is_built_or_reused(self) -> None:
        assert self.planner.builds + self.planner.reuses == self.plans


def _new_tuple(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The same blocks in a tuple of its own (``tuple(t)`` of a tuple is `t` itself)."""
    return tuple(block for block in blocks)


def _as_columns(chunks: list[SeqChunk]) -> PlannedBatch:
    """The same chunks as the scheduler hands them over: parallel columns, with the owners as its requests."""
    return PlannedBatch(
        [c.owner for c in chunks],  # the owners stand for the scheduler's requests
        [c.start for c in chunks],
        [c.tokens for c in chunks],
        [c.block_table for c in chunks],
        [c.produces_token for c in chunks],
    )


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _assert_same_batch(planned: PagedBatch, built: PagedBatch) -> None:
    """`planned` holds what `built` holds: the same tokens, positions, cache slots, sampling rows, per-request views
    and attention groups. A kept plan may gather more blocks per request than a fresh build (its width stays while
    its longest request leaves): each request's table is the same, and the blocks past it repeat its first."""
    for name in ("input_ids", "positions", "slot_blocks", "slot_offsets", "logits_indices"):
        assert torch.equal(getattr(planned, name), getattr(built, name)), name
    assert planned.seqs == built.seqs
    rows = planned.input_ids.shape[0]
    identity = torch.arange(rows)
    planned_order = identity if planned.out_order is None else planned.out_order
    built_order = identity if built.out_order is None else built.out_order
    assert torch.equal(planned_order, built_order)
    assert planned.groups is not None and built.groups is not None
    assert len(planned.groups) == len(built.groups)
    views = {view.begin: view for view in built.seqs}
    for mine, theirs in zip(planned.groups, built.groups, strict=True):
        for name in ("num_seqs", "num_queries", "num_keys", "row_start"):
            assert getattr(mine, name) == getattr(theirs, name), name
        for name in ("query_rows", "mask", "valid"):
            assert _same(getattr(mine, name), getattr(theirs, name)), name
        assert mine.num_blocks >= theirs.num_blocks
        for i, row in enumerate(mine.blocks.view(mine.num_seqs, mine.num_blocks).tolist()):
            first = i * mine.num_queries  # the request's first query row in the group
            begin = mine.row_start + first if mine.query_rows is None else int(mine.query_rows[first])
            table = list(views[begin].table)
            assert row[: len(table)] == table and set(row[len(table) :]) <= {table[0]}, (i, row, table)


@pytest.mark.parametrize(
    "budget",
    [DECODE_KV_BUDGET_BYTES, TIGHT_BUDGET, 0],
    ids=["every layer kept", "some layers kept", "nothing kept"],
)
def test_the_planner_equals_fresh_builds_over_any_steps(tiny_model, budget):
    """The machine takes the system under test as an argument (the pattern of zarr's stateful store tests): here a
    planner with this budget for what its decode plans keep, run beside the reference."""
    run_state_machine_as_test(
        lambda: DecodePlanMachine(tiny_model, BatchPlanner(BLOCK, decode_kv_budget=budget)), settings=STEPS
    )
