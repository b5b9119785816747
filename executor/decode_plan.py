"""The decode fast path: `BatchPlanner` keeps a decode batch's plan from one step to the next and updates it in
place, instead of building every batch anew.

`executor.batch.PagedBatch.build` is the reference path it must equal: every batch the planner returns holds the
same values as `PagedBatch.build` of the same chunks, and the model gives the same logits on it. The keys and values
the plan attends over are kept by `executor.decode_kv.DecodeKV`.

What it keeps true:
* a plan is reused only when the plan's requests that stay come first, in the plan's order, each exactly one
  position further on the blocks the plan holds; requests that left are dropped, requests after them joined and
  are appended; any other batch is built from scratch;
* a request is known by its owner where the batch names owners, else by its table's first block;
* a batch with prefill chunks first keeps the plan for its decode steps, with the decode group first, as
  `PagedBatch.build` groups it;
* the per-request views of a kept plan's batch (`_Seqs`, `_PrefillFirstSeqs`) are built when read, and equal the
  tuple `PagedBatch.build` would hold.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import replace
from typing import cast, overload

import torch

from executor.batch import (
    AttentionGroup,
    BatchChunk,
    ChunkColumns,
    IndexPacker,
    PagedBatch,
    SeqView,
    attention_mask,
    chunk_columns,
    host_longs,
    key_positions,
)
from executor.decode_kv import DECODE_KV_BUDGET_BYTES, DecodeKV, picked, row_pick


class BatchPlanner:
    """Builds each forward pass's `PagedBatch`, keeping the previous decode plan while the batch goes on unchanged.

    A decode-only batch of the same requests as the previous one, each one position further on the blocks the
    plan holds, is a persistent batch: its plan (`_DecodePlan`: the index tensors on the device, the padded block
    list, the group's shape and its `DecodeKV`) is updated in place where something changed. Positions move on by
    one and offsets follow; requests that crossed into a new block get that block written into their slot and
    their row of the block list; the new tokens are uploaded. Requests that left are dropped from the plan in
    place. Requests that joined after the plan's own (the scheduler appends what it admits or resumes) are
    appended, their blocks alone gathered into its `DecodeKV`. A batch whose prefill chunks come before its decode
    steps (the scheduler's order) keeps the plan for the decode steps and builds only the prefill chunks
    (`_with_prefill`). Anything else (a reordered batch, a request whose context outgrew the plan's blocks, a
    changed table, a step that did not advance, a batch without decode steps) is built from scratch with
    `PagedBatch.build`. Chunks are read as columns (`BatchColumns`) and compared with the plan's by whole-list
    operations, so a steady step runs no Python loop body per request.

    Invariants:
    * `plan(chunks)` holds the same values as `PagedBatch.build(chunks, ...)`, and gives the same logits;
    * each decode plan has its own `DecodeKV`, which keeps exactly what a gather would read;
    * block tables are owned exclusively, so within one step the same table is the same request;
    * across steps a batch that names its owners (a `PlannedBatch`, `SeqChunk.owner`) is matched by owner, so
      blocks passed to another request while the planner saw no batch are never read as the old request's;
    * a table given as the very object of the previous step is that table (the scheduler's pool keeps one
      immutable tuple per request until it changes); any other is compared block by block with the plan's;
    * a batch of a kept plan shares the plan's tensors: it is valid until the planner's next `plan()`, which
      updates them in place (on CUDA in stream order, after the forward that reads them).
    """

    __slots__ = ("_decode", "block_size", "builds", "decode_kv_budget", "device", "reuses")

    def __init__(
        self, block_size: int, device: torch.device | str = "cpu", decode_kv_budget: int = DECODE_KV_BUDGET_BYTES
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.decode_kv_budget = decode_kv_budget  # bytes the kept keys and values of a decode plan may take
        self._decode: _DecodePlan | None = None  # the plan of the last batch, when it was a steady decode step
        self.builds = 0  # batches built from scratch
        self.reuses = 0  # decode plans reused

    @property
    def _decode_kv(self) -> DecodeKV | None:
        """The keys and values the current decode plan keeps (None: the last batch was not decode-only)."""
        return None if self._decode is None else self._decode.decode_kv

    def plan(self, chunks: Sequence[BatchChunk]) -> PagedBatch:
        columns = chunk_columns(chunks)
        split = _prefill_rows(columns)  # prefill chunks first, then decode steps; None: any other batch
        if split is None or split == len(columns.starts):
            self._decode = None
            self.builds += 1
            return PagedBatch.build(chunks, self.block_size, self.device)
        decode = columns if not split else _rows(columns, slice(split, None))
        batch = self._decode.advance(decode, self.device) if self._decode is not None else None
        if batch is None:
            batch = PagedBatch.build(decode, self.block_size, self.device)
            if batch.groups is None or len(batch.groups) != 1:
                raise AssertionError("a decode-only batch is planned as one attention group")
            self._decode = _DecodePlan(decode, batch, self.block_size, DecodeKV(self.decode_kv_budget))
            batch = replace(batch, decode_kv=self._decode.decode_kv)
            self.builds += 1
        else:
            self.reuses += 1
        if not split:
            return batch
        prefill = PagedBatch.build(_rows(columns, slice(split)), self.block_size, self.device)
        return _with_prefill(prefill, batch)


class _DecodePlan:
    """The decode group of the last batch (a steady decode step: every request one token and sampling), kept so
    that the next step updates it in place (`BatchPlanner`). Its tensors are the last batch's own.

    Requests that left the batch since (finished, preempted, cancelled) are dropped from it first (`_drop_left`:
    their rows taken out of every tensor and of the `DecodeKV`); requests that join it after its own are appended
    (`_moved_on`; their keys and values are gathered by the `DecodeKV` when a layer reads them).

    Invariants: `tables[i]` are request i's blocks covering its context at the last step, `keys[i]` who request
    i is (`_keys`: its owner where the batch names owners, else its first block) and `given[i]` the table object
    it was handed; `starts` its last positions; `blocks` holds `width` blocks per request (its table, then its
    first block repeated), and the device tensors hold what `PagedBatch.build` of the last step would."""

    __slots__ = ("batch", "block_size", "decode_kv", "given", "group", "keys", "starts", "tables", "width")

    def __init__(self, columns: ChunkColumns, batch: PagedBatch, block_size: int, decode_kv: DecodeKV) -> None:
        (group,) = cast("tuple[AttentionGroup, ...]", batch.groups)
        self.batch, self.group, self.block_size, self.decode_kv = batch, group, block_size, decode_kv
        self.tables = [seq.table for seq in batch.seqs]
        self.keys = _keys(columns)
        self.given = list(columns.block_tables)
        self.starts = list(columns.starts)
        self.width = group.num_blocks

    def advance(self, columns: ChunkColumns, device: torch.device) -> PagedBatch | None:
        """The plan moved one position on, updated in place, as this step's batch; None (nothing changed here,
        the planner builds anew) when the batch is not the same requests one step further within the plan."""
        if not columns.starts or not _all_decode(columns):
            return None
        given, size, keys = columns.block_tables, self.block_size, _keys(columns)
        mine = len(given)  # the batch's first `mine` requests are the plan's (in its order), the rest joined
        if mine != len(self.tables) or keys != self.keys or not all(map(operator.is_, given, self.given)):
            found = self._drop_left(keys)
            if found is None:
                return None
            mine = found
        starts, tables = list(columns.starts), self.tables
        if not self._moved_by_one(starts[:mine], given):
            return None
        at_boundary = map(operator.not_, map(operator.mod, starts[:mine], itertools.repeat(size)))
        rows, blocks = [], []  # the requests whose step enters a new block, and that block
        for i in itertools.compress(itertools.count(), at_boundary):
            k = starts[i] // size
            if k >= self.width or len(given[i]) <= k:
                return None  # its context outgrew the plan's blocks (or its table lacks the block): rebuild
            tables[i] = given[i][: k + 1]  # k == its blocks so far: its context filled them at the last step
            rows.append(i)
            blocks.append(given[i][k])
        joined = self._joining(starts[mine:], given[mine:])
        if joined is None:
            return None
        self.given, self.starts, self.keys = list(given), starts, keys
        return self._moved_on(columns, rows, blocks, joined, device)

    def _moved_by_one(self, starts: list[int], given: Sequence[tuple[int, ...]]) -> bool:
        """The plan's requests (the first of `given`, at `starts`) are each one position further, on the blocks
        the plan holds (a new table object: the same blocks, or one more)."""
        if starts != list(map(operator.add, self.starts, _ONE)):
            return False
        tables = self.tables
        if not all(map(operator.is_, given, self.given)):
            for i in itertools.compress(range(len(starts)), map(operator.is_not, given, self.given)):
                if given[i][: len(tables[i])] != tables[i]:
                    return False  # some request's blocks are not the ones the plan holds: another request
        return True

    def _joining(
        self, starts: Sequence[int], tables: Sequence[tuple[int, ...]]
    ) -> list[tuple[int, tuple[int, ...]]] | None:
        """(position, the blocks covering its context) of each request that joins the plan, in batch order; None
        when one needs more blocks than the plan's rows hold (the planner rebuilds)."""
        joined = []
        for start, table in zip(starts, tables, strict=True):
            k = start // self.block_size
            if k >= self.width or len(table) <= k:
                return None
            joined.append((start, tuple(table[: k + 1])))
        return joined

    def _drop_left(self, keys: list[Hashable]) -> int | None:
        """Take out of the plan the requests of the last step that are not among `keys` (this batch's rows,
        `_keys`), and return how many of this batch's requests are the plan's: its first ones, in the plan's order
        (the others join it); None (the plan is not changed) when some request of the plan comes after one that is
        not, or out of order."""
        have = len(self.keys)
        if keys[:have] == self.keys:
            return have  # nobody left: requests only joined (a batch's keys are distinct)
        row_of = dict(zip(self.keys, itertools.count()))
        rows = list(map(row_of.get, keys))
        mine = rows.index(None) if None in rows else len(rows)
        if not mine or any(row is not None for row in rows[mine:]):
            return None
        kept = cast("list[int]", rows[:mine])
        if not all(map(operator.lt, kept, itertools.islice(kept, 1, None))):
            return None
        batch, group, width = self.batch, self.group, self.width
        device = batch.positions.device
        keep = row_pick(kept, device)
        self.tables = [self.tables[r] for r in kept]
        self.keys = [self.keys[r] for r in kept]
        self.given = [self.given[r] for r in kept]
        self.starts = [self.starts[r] for r in kept]
        self.decode_kv.keep_rows(keep)
        blocks = picked(group.blocks.view(len(row_of), width), keep).reshape(-1)
        self.group = replace(group, num_seqs=len(kept), blocks=blocks)
        self.batch = replace(
            batch,
            positions=picked(batch.positions, keep),
            slot_blocks=picked(batch.slot_blocks, keep),
            slot_offsets=picked(batch.slot_offsets, keep),
            logits_indices=key_positions(len(kept), device),
        )
        return mine

    def _moved_on(
        self,
        columns: ChunkColumns,
        rows: list[int],
        blocks: list[int],
        joined: list[tuple[int, tuple[int, ...]]],
        device: torch.device,
    ) -> PagedBatch:
        """Update the device tensors in place (one upload: the new tokens, the new blocks with where they go, and
        the rows of the requests that `joined`, appended) and return the step's batch (built field by field:
        `dataclasses.replace` costs more than the update)."""
        batch, group, starts, width, size = self.batch, self.group, self.starts, self.width, self.block_size
        tokens = list(itertools.chain.from_iterable(columns.tokens))
        positions, slot_blocks, slot_offsets, group_blocks = (
            batch.positions,
            batch.slot_blocks,
            batch.slot_offsets,
            group.blocks,
        )
        views: list[torch.Tensor] = []
        if rows or joined:
            packer = IndexPacker()
            for values in (tokens, rows, blocks, [i * width + starts[i] // size for i in rows]):
                packer.add(values)
            if joined:
                padded: list[int] = []
                for _, table in joined:
                    padded.extend(table)
                    padded.extend(table[:1] * (width - len(table)))
                for values in ([p for p, _ in joined], [t[p // size] for p, t in joined], padded):
                    packer.add(values)
            host, views = packer.upload(device)
            input_ids, at, new_blocks, slots = views[:4]
            slot_blocks.index_copy_(0, at, new_blocks)
            group_blocks.index_copy_(0, slots, new_blocks)
        else:
            host = host_longs(tokens, pinned=device.type == "cuda")
            input_ids = host.to(device, non_blocking=True)
        positions.add_(1)
        if joined:  # their rows appended: new tensors (the plan's own from now on)
            positions = torch.cat((positions, views[4]))
            slot_blocks = torch.cat((slot_blocks, views[5]))
            group_blocks = torch.cat((group_blocks, views[6]))
            slot_offsets = torch.empty_like(positions)
            self.tables.extend(table for _, table in joined)
        torch.remainder(positions, size, out=slot_offsets)
        n, num_keys = len(starts), max(starts) + 1
        mask = (
            None
            if min(starts) + 1 == num_keys
            else attention_mask(positions, {"num_seqs": n, "num_queries": 1, "num_keys": num_keys})
        )
        self.group = group = AttentionGroup(n, 1, width, num_keys, None, 0, group_blocks, mask, None)
        self.batch = batch = PagedBatch(
            input_ids,
            positions,
            slot_blocks,
            slot_offsets,
            _Seqs(starts, self.tables),
            key_positions(n, positions.device) if joined else batch.logits_indices,
            (group,),
            None,
            host,
            self.decode_kv,
        )
        return batch


class _LazySeqs(Sequence[SeqView]):
    """Per-request views of a batch built when read: nothing on the batched path reads them, and a decode step
    would otherwise build one per request. Compares equal to the tuple of `SeqView`s it stands for."""

    __slots__ = ()

    def _view(self, i: int) -> SeqView:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> SeqView: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[SeqView, ...]: ...

    def __getitem__(self, index: int | slice) -> SeqView | tuple[SeqView, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        return self._view(range(len(self))[index])

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    __hash__ = None  # type: ignore[assignment]  # compared by content, like the tuple it stands for


class _Seqs(_LazySeqs):
    """The views of a kept decode plan's batch: request i at row i, at `starts[i]`, with `tables[i]`."""

    __slots__ = ("starts", "tables")

    def __init__(self, starts: list[int], tables: list[tuple[int, ...]]) -> None:
        self.starts, self.tables = starts, list(tables)

    def __len__(self) -> int:
        return len(self.starts)

    def _view(self, i: int) -> SeqView:
        return SeqView(i, i + 1, self.starts[i], self.tables[i])

    def __iter__(self) -> Iterator[SeqView]:
        n = len(self.starts)
        return map(SeqView, range(n), range(1, n + 1), self.starts, self.tables)


class _PrefillFirstSeqs(_LazySeqs):
    """The views of a batch of prefill chunks (`prefill`, rows first) and decode steps (`decode`, each row moved
    past the prefill's `rows`), as `_with_prefill` joins them."""

    __slots__ = ("decode", "prefill", "rows")

    def __init__(self, prefill: Sequence[SeqView], decode: Sequence[SeqView], rows: int) -> None:
        self.prefill, self.decode, self.rows = prefill, decode, rows

    def __len__(self) -> int:
        return len(self.prefill) + len(self.decode)

    def _view(self, i: int) -> SeqView:
        if i < len(self.prefill):
            return self.prefill[i]
        return self._moved(self.decode[i - len(self.prefill)])

    def _moved(self, view: SeqView) -> SeqView:
        return SeqView(view.begin + self.rows, view.end + self.rows, view.start, view.table)

    def __iter__(self) -> Iterator[SeqView]:
        return itertools.chain(self.prefill, map(self._moved, self.decode))


_ONE = itertools.repeat(1)  # `map(add, starts, _ONE)`: every position one further, without a Python loop body
_FIRST = operator.itemgetter(0)  # a table's first block: which request it is (tables are exclusive)


def _all_decode(columns: ChunkColumns) -> bool:
    """Every chunk is one token that samples (a decode step)."""
    return all(columns.produces_token) and all(map((1).__eq__, map(len, columns.tokens)))


def _rows(columns: ChunkColumns, rows: slice) -> ChunkColumns:
    """These rows of a batch's columns."""
    owners = None if columns.owners is None else columns.owners[rows]
    return ChunkColumns(
        columns.starts[rows], columns.tokens[rows], columns.block_tables[rows], columns.produces_token[rows], owners
    )


def _keys(columns: ChunkColumns) -> list[Hashable]:
    """Who each row is: its owner where the batch says, else its table's first block (tables are exclusive at any
    one step, but blocks change owners between steps: a batch that names its owners is never mistaken)."""
    return list(columns.owners) if columns.owners is not None else list(map(_FIRST, columns.block_tables))


def _prefill_rows(columns: ChunkColumns) -> int | None:
    """How many chunks of several tokens come first (prefill chunks) when the rest are decode steps (one token
    that samples) and there is at least one chunk; None for any other batch (empty, a one-token prefill chunk, a
    decode step before a prefill chunk). `PagedBatch.build` groups such a batch as the planner does: the decode
    steps first (rows ``split ..``), then the prefill chunks."""
    if not columns.starts:
        return None
    lengths = list(map(len, columns.tokens))
    split = next((i for i, n in enumerate(lengths) if n == 1), len(lengths))
    if not all(map((1).__eq__, lengths[split:])) or not all(itertools.islice(columns.produces_token, split, None)):
        return None
    return split


def _with_prefill(prefill: PagedBatch, decode: PagedBatch) -> PagedBatch:
    """One batch of `prefill` (prefill chunks only, rows first) and `decode` (a decode plan's batch, rows after),
    holding what `PagedBatch.build` of their chunks would: the decode group first (its rows moved past the
    prefill's tokens), then the prefill's groups, and `out_order` putting their outputs back in batch order."""
    t = prefill.input_ids.shape[0]
    (group,) = cast("tuple[AttentionGroup, ...]", decode.groups)
    n, device = group.num_seqs, decode.positions.device
    prefill_groups = cast("tuple[AttentionGroup, ...]", prefill.groups)
    # the groups' outputs are [decode rows, prefill's groups' outputs]: batch row r < t is the prefill's
    # out_order[r] (or r) after the n decode rows, row t + i is decode row i
    inner = prefill.out_order if prefill.out_order is not None else key_positions(t, device)
    offsets = key_positions(n, device)
    return PagedBatch(
        torch.cat((prefill.input_ids, decode.input_ids)),
        torch.cat((prefill.positions, decode.positions)),
        torch.cat((prefill.slot_blocks, decode.slot_blocks)),
        torch.cat((prefill.slot_offsets, decode.slot_offsets)),
        _PrefillFirstSeqs(prefill.seqs, decode.seqs, t),
        torch.cat((prefill.logits_indices, offsets + t)),
        (replace(group, row_start=t), *prefill_groups),
        torch.cat((inner + n, offsets)),
        (cast("torch.Tensor", prefill.host_indices), cast("torch.Tensor", decode.host_indices)),
        decode.decode_kv,
    )
