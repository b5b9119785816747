"""Batch building: the flattened token batch that one forward pass reads (`PagedBatch`), and its index tensors.

A batch is built from the chunks the scheduler planned: `BatchChunk` records, or a batch that holds them as columns
(`BatchColumns`); `SeqChunk` is a chunk built by hand. `PagedBatch.build` is the reference path: every other way
of making a batch (`executor.decode_plan.BatchPlanner`) must hold the same values.

What a built batch keeps true:
* a token's cache slot is the entry of its request's block table for its position; a chunk whose table does not
  cover ``start + len(tokens)`` positions is refused (the scheduler allocates before computing);
* decode requests (one token each) form one attention group and multi-token chunks a second, in that order;
  `out_order` puts the groups' outputs back in batch order;
* a group's block list pads a request with its own first block, and its mask (None when no key is padding) hides
  every key past a request's context, so padding contributes exactly zero to attention;
* every index list of a batch is a view of one tensor uploaded once (pinned and non-blocking on CUDA); the batch
  keeps that tensor's host side alive;
* the plan is built once per forward pass and shared by every layer.
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch

from kvstate.pool import ceil_div

if TYPE_CHECKING:
    from executor.decode_kv import DecodeKV

KeysValues = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values


class BatchChunk(Protocol):
    """What batch planning (`PagedBatch.build`, `BatchPlanner.plan`) reads of one request's chunk: `tokens` at
    positions ``start ..``, KV in `block_table`, logits for its last token when `produces_token`. The scheduler's
    `kvstate.output.PlannedChunk` is one (the engine passes them as they are); `SeqChunk` is one without a request."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def start(self) -> int: ...

    @property
    def block_table(self) -> tuple[int, ...]: ...

    @property
    def produces_token(self) -> bool: ...


class BatchColumns(Protocol):
    """A batch of chunks that also holds them as parallel columns (entry i of each is chunk i's):
    `kvstate.output.PlannedBatch` is one. Batch planning reads the columns instead of a record per chunk."""

    @property
    def starts(self) -> Sequence[int]: ...

    @property
    def tokens(self) -> Sequence[tuple[int, ...]]: ...

    @property
    def block_tables(self) -> Sequence[tuple[int, ...]]: ...

    @property
    def produces_token(self) -> Sequence[bool]: ...


class ChunkColumns(NamedTuple):
    """The chunks of one batch as columns (see `BatchColumns`); `owners`: who each chunk belongs to, when the batch
    says (a `PlannedBatch`'s requests, `SeqChunk.owner`), else None."""

    starts: Sequence[int]
    tokens: Sequence[tuple[int, ...]]
    block_tables: Sequence[tuple[int, ...]]
    produces_token: Sequence[bool]
    owners: Sequence[Hashable] | None


def chunk_columns(chunks: Sequence[BatchChunk] | BatchColumns) -> ChunkColumns:
    """`chunks` as columns: a `BatchColumns` batch gives its own, any other sequence is read chunk by chunk.
    (A batch is taken for a `BatchColumns` when it has `block_tables`: isinstance on a runtime-checkable protocol
    costs more than planning a small batch.)"""
    if getattr(chunks, "block_tables", None) is not None:
        batch = cast("BatchColumns", chunks)
        owners = getattr(batch, "requests", None)
        if owners is not None and None in owners:
            owners = None  # not named for every chunk: rows are known by their first blocks
        return ChunkColumns(batch.starts, batch.tokens, batch.block_tables, batch.produces_token, owners)
    records = cast("Sequence[BatchChunk]", chunks)
    owners = [getattr(c, "owner", None) for c in records]
    return ChunkColumns(
        [c.start for c in records],
        [c.tokens for c in records],
        [c.block_table for c in records],
        [c.produces_token for c in records],
        None if None in owners else owners,
    )


class SeqChunk(NamedTuple):
    """A `BatchChunk` built by hand (tests, pipeline stages that hold no `Request`): `tokens` at positions
    ``start ..``, KV in `block_table`; logits for its last token when `produces_token`.

    An immutable record built for every scheduled request on every step (a named tuple: cheaper to build than a
    frozen dataclass, read the same way)."""

    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    produces_token: bool = True  # produce logits for its last token
    owner: Hashable | None = None  # whose chunk it is (a request id): a kept decode plan knows its rows by it


class SeqView(NamedTuple):
    """One request's part of a flattened batch: its rows, its first token's position and the blocks covering its
    context (a named tuple: built once per request per forward pass)."""

    begin: int  # row range in the flattened batch
    end: int
    start: int  # position of its first token
    table: tuple[int, ...]  # the blocks covering positions 0 .. start + (end - begin) - 1


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Requests whose attention runs as one batched call: ``B`` requests, queries padded to ``Q`` rows each, the
    blocks of each gathered up to ``num_blocks``, and keys read up to ``K = num_keys``, the longest context in the
    group (``<= num_blocks * block_size``: slots past every request's context are not read). Built once per
    forward, shared by every layer.

    Padding never changes a request's result: a padded query row repeats one of the request's real rows (and is
    dropped afterwards); a padded key (a slot past the request's context, or a whole padding block, which is
    the request's own first block again) is masked to -inf before the softmax, so its probability is exactly 0.
    `mask` is None only when no key is padding: one query per request and every context exactly ``K`` long.
    """

    num_seqs: int  # B
    num_queries: int  # Q
    num_blocks: int  # blocks gathered per request
    num_keys: int  # K: key positions 0 .. K - 1 of each request are read
    query_rows: torch.Tensor | None  # [B * Q] rows of the flattened batch; None: rows row_start .. + B * Q
    row_start: int
    blocks: torch.Tensor  # [B * num_blocks] block ids (index_select over a layer's blocks)
    mask: torch.Tensor | None  # [B, 1, Q, K] bool, True = attend; None when every key is attended
    valid: torch.Tensor | None  # [rows] indices of the real query rows in ``B * Q``; None: all are real


def host_longs(values: Sequence[int], *, pinned: bool = False) -> torch.Tensor:
    """`values` as an int64 CPU tensor (pinned on request), through an `array.array` (``torch.tensor(list)``
    inspects every Python int on its own)."""
    if not values:
        return torch.empty(0, dtype=torch.long, pin_memory=pinned)
    tensor = torch.frombuffer(array.array("q", values), dtype=torch.long)  # shares the array's memory
    return tensor.pin_memory() if pinned else tensor


@functools.lru_cache(maxsize=64)
def key_positions(num_keys: int, device: torch.device) -> torch.Tensor:
    """``0 .. num_keys - 1`` on `device` (made once per length and device; never mutated)."""
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        return torch.arange(num_keys, device=device)


class IndexPacker:
    """The integer lists of one batch, gathered so that they become one tensor with one upload (pinned and
    non-blocking on CUDA: the host never waits for the copy, nor for work queued before it); each list comes
    back as a view of that tensor. The pinned host tensor is kept by the batch until the batch is dropped."""

    __slots__ = ("spans", "values")

    def __init__(self) -> None:
        self.values: list[int] = []
        self.spans: list[tuple[int, int]] = []

    def add(self, values: Sequence[int]) -> int:
        """Queue `values`; returns the handle `upload` indexes its view by."""
        self.spans.append((len(self.values), len(self.values) + len(values)))
        self.values.extend(values)
        return len(self.spans) - 1

    def upload(self, device: torch.device | str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the host tensor, one view on `device` per `add`, in order)."""
        device = torch.device(device)
        host = host_longs(self.values, pinned=device.type == "cuda")
        flat = host.to(device, non_blocking=True)
        return host, [flat[a:b] for a, b in self.spans]


class _TokenRows(NamedTuple):
    """The per-token and per-row index lists of one batch, before their upload."""

    ids: list[int]
    positions: list[int]
    slot_blocks: list[int]
    slot_offsets: list[int]
    sample_rows: list[int]
    out_order: list[int] | None  # None: the groups' outputs are already in batch order


def _group_lists(views: Sequence[SeqView]) -> tuple[dict, list[int]]:
    """The batched-attention plan of `views` as integer lists, and the flattened-batch rows of its outputs."""
    num_queries = max(v.end - v.begin for v in views)
    num_blocks = max(len(v.table) for v in views)
    num_keys = max(v.start + v.end - v.begin for v in views)  # the longest context
    blocks: list[int] = []
    for v in views:
        blocks.extend(v.table)
        blocks.extend(v.table[:1] * (num_blocks - len(v.table)))
    if num_queries == 1:  # decode requests: one query each, nothing to pad
        rows = [v.begin for v in views]
        query_pos = [v.start for v in views]
        valid = list(range(len(views)))
        full = all(v.start + 1 == num_keys for v in views)
    else:
        rows, query_pos, valid = [], [], []  # per (request, query slot); padding repeats the request's last row
        for i, v in enumerate(views):
            n, pad = v.end - v.begin, num_queries - (v.end - v.begin)
            rows.extend(range(v.begin, v.end))
            rows.extend(itertools.repeat(v.end - 1, pad))
            query_pos.extend(range(v.start, v.start + n))
            query_pos.extend(itertools.repeat(v.start + n - 1, pad))
            valid.extend(range(i * num_queries, i * num_queries + n))
        full = False  # causal within the chunk
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    plan = {
        "num_seqs": len(views),
        "num_queries": num_queries,
        "num_blocks": num_blocks,
        "num_keys": num_keys,
        "row_start": rows[0],
        "blocks": blocks,
        "query_pos": None if full else query_pos,
        "rows": None if contiguous else rows,
        "valid": None if len(valid) == len(rows) else valid,
    }
    return plan, [rows[k] for k in valid]


def attention_mask(query_pos: torch.Tensor, plan: dict) -> torch.Tensor:
    """``[B, 1, Q, K]``: key position <= query position (causal, and nothing past a request's context)."""
    key_pos = key_positions(plan["num_keys"], query_pos.device)
    return (key_pos <= query_pos[:, None]).view(plan["num_seqs"], 1, plan["num_queries"], -1)


def gather_blocks(cache: KeysValues, group: AttentionGroup, out: KeysValues | None = None) -> KeysValues:
    """The blocks of `group` from one layer's (keys, values), head-major: ``[B, kv_heads, num_blocks * block_size,
    head_dim]`` each, contiguous, request by request (the cache is token-major; attention reads a head's keys
    fastest when they are contiguous); written into `out` (tensors of that shape) when given."""
    keys, values = cache
    shape = (group.num_seqs, group.num_blocks * keys.shape[1], *keys.shape[2:])

    def head_major(t: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        token_major = t.index_select(0, group.blocks).view(shape).transpose(1, 2)
        return token_major.contiguous() if target is None else target.copy_(token_major)

    targets = (None, None) if out is None else out
    return head_major(keys, targets[0]), head_major(values, targets[1])


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """A flattened token batch: per-token ids, positions and cache slots; per-request views; sampling rows;
    and the batched-attention plan (`groups`, `out_order`) that every layer shares.

    Every index tensor is a view of one tensor uploaded once (`host_indices` keeps its host side alive; a batch
    joined from two, several). A batch whose decode rows a `BatchPlanner` planned with a kept plan carries its
    plan's `decode_kv`, which serves its first group (the decode requests)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    seqs: Sequence[SeqView]  # a tuple, or views built when read for a kept decode plan's batch (executor.decode_plan)
    logits_indices: torch.Tensor
    # decode requests (one token) form one group, multi-token chunks another; None: attend request by request
    groups: tuple[AttentionGroup, ...] | None = None
    out_order: torch.Tensor | None = None  # row t of the output is row out_order[t] of the groups' outputs
    host_indices: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    decode_kv: DecodeKV | None = None  # serves groups[0], the decode requests (`Attention._gathered`)

    @classmethod
    def build(
        cls, chunks: Sequence[BatchChunk] | BatchColumns, block_size: int, device: torch.device | str = "cpu"
    ) -> PagedBatch:
        """The batch of `chunks` built from scratch, every index list uploaded once (the reference every kept plan
        must equal). Refuses (`ValueError`) an empty chunk or one whose table does not cover its positions."""
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        seqs: list[SeqView] = []
        sample_rows: list[int] = []
        columns = chunk_columns(chunks)
        for start, tokens, table, produces in zip(*columns[:4], strict=True):
            n = len(tokens)
            end_pos = start + n
            needed = ceil_div(end_pos, block_size)
            if n == 0 or len(table) < needed:
                raise ValueError(
                    f"chunk of {n} tokens at {start} needs {needed} blocks, table has {len(table)}; "
                    "allocate before computing"
                )
            begin = len(ids)
            ids.extend(tokens)
            positions.extend(range(start, end_pos))
            pos = start
            while pos < end_pos:  # block by block: the slots of a chunk are runs within its blocks
                k, offset = divmod(pos, block_size)
                run = min(end_pos, (k + 1) * block_size) - pos
                blocks.extend(itertools.repeat(table[k], run))
                offsets.extend(range(offset, offset + run))
                pos += run
            seqs.append(SeqView(begin, begin + n, start, tuple(table[:needed])))
            if produces:
                sample_rows.append(begin + n - 1)

        plans: list[dict] = []
        order: list[int] = []  # flattened-batch row of each output row of the groups, concatenated
        for members in ([s for s in seqs if s.end - s.begin == 1], [s for s in seqs if s.end - s.begin > 1]):
            if members:
                plan, group_rows = _group_lists(members)
                plans.append(plan)
                order.extend(group_rows)
        inverse = None
        if order != list(range(len(order))):
            inverse = [0] * len(order)
            for k, row in enumerate(order):
                inverse[row] = k
        rows = _TokenRows(ids, positions, blocks, offsets, sample_rows, inverse)
        return cls._upload(rows, tuple(seqs), plans, device)

    @classmethod
    def _upload(
        cls, rows: _TokenRows, seqs: tuple[SeqView, ...], plans: list[dict], device: torch.device | str
    ) -> PagedBatch:
        """One upload of every index list, then the masks on the device, then the batch."""
        packer = IndexPacker()
        handles = [packer.add(values) for values in rows[:5]]
        keys = ("blocks", "query_pos", "rows", "valid")
        group_handles = [{k: packer.add(p[k]) for k in keys if p[k] is not None} for p in plans]
        order_handle = packer.add(rows.out_order) if rows.out_order is not None else None
        host, views = packer.upload(device)
        groups = []
        for plan, h in zip(plans, group_handles, strict=True):
            mask = attention_mask(views[h["query_pos"]], plan) if "query_pos" in h else None
            groups.append(
                AttentionGroup(
                    plan["num_seqs"],
                    plan["num_queries"],
                    plan["num_blocks"],
                    plan["num_keys"],
                    views[h["rows"]] if "rows" in h else None,
                    plan["row_start"],
                    views[h["blocks"]],
                    mask,
                    views[h["valid"]] if "valid" in h else None,
                )
            )
        ids, positions, blocks, offsets = (views[h] for h in handles[:4])
        return cls(
            ids,
            positions,
            blocks,
            offsets,
            seqs,
            views[handles[4]],
            tuple(groups),
            None if order_handle is None else views[order_handle],
            host,
        )
