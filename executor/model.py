"""A Llama-style decoder with paged attention: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.`` prefix (``embed_tokens``,
``layers.{i}.self_attn.o_proj``, ..., ``norm``, ``lm_head``), except that each layer stores its q/k/v projections
as one matrix (``self_attn.qkv_proj``) and its gate/up projections as one (``mlp.gate_up_proj``), so each is one
matmul; `LlamaModel.hf_state_dict` and `LlamaModel.load_hf_state_dict` map to and from Hugging Face's names
(`executor.hf` reads and writes checkpoints through them; only the fused matrices are stored).

Two forward paths share every kernel:
* `forward_paged(batch, cache)`: a flattened batch of prefill chunks and decode tokens from many requests. Each
  token's K and V are written into its request's block table slot, then each request attends over its whole
  context gathered from the cache: batched, one padded and masked `scaled_dot_product_attention` for all decode
  requests and one for all multi-token chunks, each reading its requests' blocks with one `index_select` and
  attending up to the group's longest context (no mask at all when every decode context has the same length); the
  plan (block ids, masks, row maps) is built once per forward by `PagedBatch.build` and shared by all layers, as
  are the rotary factors; every index list of a batch becomes one tensor with one upload (pinned and
  non-blocking on CUDA), and `BatchPlanner` keeps the decode plan from one step to the next while the batch is
  unchanged (only tokens, positions and the blocks of requests that crossed into a new block are new), reading
  the scheduler's batch column by column, and with it the keys and values the plan gathered (`DecodeKV`: a
  reused plan's step writes its new token's key and value instead of gathering every block again). Returns
  logits only for the rows that sample.
* `forward_dense(tokens)`: one sequence, no cache (the reference the paged path is tested against).

Invariants kept:
* a token's rotary angle depends only on its position, and attention of a request reads only its own blocks,
  so a request's logits do not depend on which other requests share the batch, nor on how its prompt was
  chunked (up to float rounding; the float64 default keeps that far below any argmax margin);
* a chunk's `block_table` must cover ``start + len(tokens)`` positions (the scheduler allocates before computing);
* RMSNorm normalizes in float32 at least (float16/bfloat16 activations are widened first, as Hugging Face does);
* batched attention reads only the blocks of each request's own table (padding repeats its first block) and
  masks every position past its context with -inf, so padding contributes exactly zero, provided the cache holds
  finite values (it starts zeroed and only ever receives K/V the model computed: the slots past a request's
  context in its last block may hold a previous owner's K/V, which a NaN/inf there would propagate).
"""

from __future__ import annotations

import array
import functools
import itertools
import math
import operator
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.pool import ceil_div


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of the decoder. The defaults are a tiny model that runs fast on two CPU cores."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


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


class _Columns(NamedTuple):
    """The chunks of one batch as columns (see `BatchColumns`); `owners`: who each chunk belongs to, when the batch
    says (a `PlannedBatch`'s requests, `SeqChunk.owner`), else None."""

    starts: Sequence[int]
    tokens: Sequence[tuple[int, ...]]
    block_tables: Sequence[tuple[int, ...]]
    produces_token: Sequence[bool]
    owners: Sequence[Hashable] | None


def _columns(chunks: Sequence[BatchChunk] | BatchColumns) -> _Columns:
    """`chunks` as columns: a `BatchColumns` batch gives its own, any other sequence is read chunk by chunk.
    (A batch is taken for a `BatchColumns` when it has `block_tables`: isinstance on a runtime-checkable protocol
    costs more than planning a small batch.)"""
    if getattr(chunks, "block_tables", None) is not None:
        batch = cast("BatchColumns", chunks)
        owners = getattr(batch, "requests", None)
        if owners is not None and None in owners:
            owners = None  # not named for every chunk: rows are known by their first blocks
        return _Columns(batch.starts, batch.tokens, batch.block_tables, batch.produces_token, owners)
    records = cast("Sequence[BatchChunk]", chunks)
    owners = [getattr(c, "owner", None) for c in records]
    return _Columns(
        [c.start for c in records],
        [c.tokens for c in records],
        [c.block_table for c in records],
        [c.produces_token for c in records],
        None if None in owners else owners,
    )


class LayerCache(Protocol):
    """What the attention layers read of a paged KV cache: per layer, views of its keys and values shaped
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` that writes go through (`PagedKVCache` is one)."""

    def layer_keys(self, layer: int) -> torch.Tensor: ...

    def layer_values(self, layer: int) -> torch.Tensor: ...


class SeqChunk(NamedTuple):
    """A `BatchChunk` built by hand (tests, pipeline stages that hold no `Request`): `tokens` at positions
    ``start ..``, KV in `block_table`; logits for its last token when `produces_token`.

    An immutable record built for every scheduled request on every step (a named tuple: half the cost of a frozen
    dataclass to build, read the same way)."""

    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    produces_token: bool = True  # produce logits for its last token
    owner: Hashable | None = None  # whose chunk it is (a request id): a kept decode plan knows its rows by it


class _SeqView(NamedTuple):  # a tuple: built once per request per forward pass, cheaper than a dataclass
    begin: int  # row range in the flattened batch
    end: int
    start: int  # position of its first token
    table: tuple[int, ...]  # the blocks covering positions 0 .. start + (end - begin) - 1


@dataclass(frozen=True, slots=True)
class _AttnGroup:
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
    """`values` as an int64 CPU tensor (pinned on request), through an `array.array`: ~30x cheaper than
    ``torch.tensor(list)``, which inspects every Python int on its own."""
    if not values:
        return torch.empty(0, dtype=torch.long, pin_memory=pinned)
    tensor = torch.frombuffer(array.array("q", values), dtype=torch.long)  # shares the array's memory
    return tensor.pin_memory() if pinned else tensor


@functools.lru_cache(maxsize=64)
def key_positions(num_keys: int, device: torch.device) -> torch.Tensor:
    """``0 .. num_keys - 1`` on `device` (made once per length and device; never mutated)."""
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        return torch.arange(num_keys, device=device)


class _Indices:
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


def _group_lists(views: Sequence[_SeqView]) -> tuple[dict, list[int]]:
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


def _attention_mask(query_pos: torch.Tensor, plan: dict) -> torch.Tensor:
    """``[B, 1, Q, K]``: key position <= query position (causal, and nothing past a request's context)."""
    key_pos = key_positions(plan["num_keys"], query_pos.device)
    return (key_pos <= query_pos[:, None]).view(plan["num_seqs"], 1, plan["num_queries"], -1)


DECODE_KV_BUDGET_BYTES = 256 << 20  # what `DecodeKV` may keep, all layers together; past it, layers gather anew
SPARE_ROWS = 0.5  # rows a layer's buffers hold beyond the plan's requests, as a share of them (for joins)

KeysValues = tuple[torch.Tensor, torch.Tensor]


class _KeptLayer:
    """One layer's kept keys and values. Invariant: rows ``first .. first + count`` of the two buffers
    (``[capacity, kv_heads, span, head_dim]`` each) hold the plan's requests in batch order, every slot of them
    written; the other rows are spare (room for requests that join, or rows of requests that left the front) and
    are never read."""

    __slots__ = ("count", "first", "keys", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, count: int) -> None:
        self.keys, self.values, self.first, self.count = keys, values, 0, count

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def capacity(self) -> int:
        return self.keys.shape[0]

    def live(self) -> KeysValues:
        """The rows of the plan's requests: views of the buffers."""
        end = self.first + self.count
        return self.keys[self.first : end], self.values[self.first : end]

    def rows(self, begin: int, end: int) -> KeysValues:
        """Rows ``begin .. end`` of the plan (0: its first request), which may be spare ones after the live."""
        return self.keys[self.first + begin : self.first + end], self.values[self.first + begin : self.first + end]


class DecodeKV:
    """The keys and values a reused decode plan attends over, kept from one step to the next (`BatchPlanner`).

    A decode step of an unchanged batch reads the same blocks as the step before, plus one new key and value per
    request. So the first step of a plan gathers each layer's blocks from the cache as usual, head-major ``[B,
    kv_heads, span, head_dim]`` (`gather_blocks`: each head's keys contiguous, the layout attention reads
    fastest), and keeps them; each later step writes only its new key and value into them (row i, at request i's
    position) after writing them into the cache, instead of gathering every block again.

    The batch changes serving sees copy none of the rows that stay: each layer keeps its rows in buffers with
    spare rows (`_KeptLayer`, `SPARE_ROWS`). Requests that joined the plan since the last step (its last rows,
    `_DecodePlan`) have their blocks alone gathered into the spare rows after the kept ones; requests that left
    from the front or the back of the batch (the oldest finish first) only move where the kept rows begin or end.
    A join past the spare rows (new buffers, with spare rows again) and requests leaving from the middle (the
    rows that stay, selected into new buffers) are the only copies of kept rows.

    Invariants: it belongs to one plan (the planner makes a new one for every plan it builds), whose requests
    only append to their own blocks while it is reused, so at every position a request attends (its context) the
    kept rows (`kept[layer]`, views of the buffers, request i at row i) hold exactly what a fresh gather of the
    cache would; positions past a request's context may hold other finite values, which its attention masks to
    probability 0 either way. Layers are kept while their buffers fit `budget` (the rest gather every step), so a
    large model on a small device keeps nothing extra."""

    __slots__ = ("_layers", "budget", "kept")

    def __init__(self, budget: int = DECODE_KV_BUDGET_BYTES) -> None:
        self.budget = budget
        self.kept: dict[int, KeysValues] = {}  # layer -> (keys, values) [B, Hkv, span, D]: `_layers[layer].live()`
        self._layers: dict[int, _KeptLayer] = {}

    def read(
        self, layer: int, cache: KeysValues, group: _AttnGroup, new: KeysValues, positions: torch.Tensor
    ) -> KeysValues:
        """The keys and values of `group` (one decode step per request, in batch order) for `layer`: kept and
        updated with `new` ([B, kv_heads, head_dim] each) at `positions`, or gathered from `cache` (the layer's
        keys and values) and kept when they fit the budget."""
        kept = self.kept.get(layer)
        if kept is not None and kept[0].shape[0] < group.num_seqs:  # requests joined: gather theirs alone
            kept = self._joined(layer, cache, group)
        if kept is not None:
            rows = key_positions(group.num_seqs, positions.device)
            for tensor, values in zip(kept, new, strict=True):
                tensor.transpose(1, 2).index_put_((rows, positions), values)  # token-major view: [B, span, Hkv, D]
            return kept
        fresh = self._allocated(layer, cache[0], group)
        if fresh is None:
            return gather_blocks(cache, group)
        gather_blocks(cache, group, out=fresh.live())
        return self._keep(layer, fresh)

    def keep_rows(self, rows: slice | torch.Tensor) -> None:
        """Only the requests of these rows stay in the plan (`row_pick`: consecutive rows, or increasing ones on
        the device): keep theirs alone, in this order."""
        for layer, kept_layer in list(self._layers.items()):
            if isinstance(rows, slice):  # the others left from the front or the back: the rows that stay stay put
                kept_layer.first += rows.start
                kept_layer.count = rows.stop - rows.start
                self.kept[layer] = kept_layer.live()
            else:  # from the middle: the rows that stay, selected into new buffers without spare rows
                keys, values = kept_layer.live()
                self._keep(layer, _KeptLayer(picked(keys, rows), picked(values, rows), len(rows)))

    def _joined(self, layer: int, cache: KeysValues, group: _AttnGroup) -> KeysValues | None:
        """The kept rows with those of the requests that joined `group` since (its last rows) gathered after them;
        None (the layer is no longer kept) when they need more rows than the spare ones and the budget allows."""
        kept_layer, n = self._layers[layer], group.num_seqs
        have = kept_layer.count
        if kept_layer.first + n > kept_layer.capacity:  # past the spare rows: new buffers, the kept rows moved
            del self._layers[layer], self.kept[layer]
            grown = self._allocated(layer, cache[0], group)
            if grown is None:
                return None
            for source, target in zip(kept_layer.live(), grown.rows(0, have), strict=True):
                target.copy_(source)
            kept_layer = grown
        joined = replace(group, num_seqs=n - have, blocks=group.blocks[have * group.num_blocks :])
        gather_blocks(cache, joined, out=kept_layer.rows(have, n))
        kept_layer.count = n
        return self._keep(layer, kept_layer)

    def _allocated(self, layer: int, like: torch.Tensor, group: _AttnGroup) -> _KeptLayer | None:
        """Empty buffers for `layer` with a row per request of `group` (live) and `SPARE_ROWS` more as far as the
        budget allows beside the other layers' buffers; None when not even the live rows fit."""
        span, kv_heads, head_dim = group.num_blocks * like.shape[1], *like.shape[2:]
        row_bytes = 2 * span * kv_heads * head_dim * like.element_size()
        room = self.budget - sum(other.nbytes for key, other in self._layers.items() if key != layer)
        n = group.num_seqs
        capacity = min(n + math.ceil(n * SPARE_ROWS), room // row_bytes)
        if capacity < n:
            return None
        shape = (capacity, kv_heads, span, head_dim)
        return _KeptLayer(like.new_empty(shape), like.new_empty(shape), n)

    def _keep(self, layer: int, kept_layer: _KeptLayer) -> KeysValues:
        self._layers[layer] = kept_layer
        self.kept[layer] = kept = kept_layer.live()
        return kept


def row_pick(rows: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """Increasing `rows` as a slice when they are consecutive (what stays when requests leave from the front or
    the back of a batch: views, no copy), else as an index tensor on `device`."""
    first, count = rows[0], len(rows)
    return slice(first, first + count) if rows[-1] - first + 1 == count else host_longs(rows).to(device)


def picked(tensor: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """The rows of `tensor` (along its first dimension) that `row_pick` chose."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def gather_blocks(cache: KeysValues, group: _AttnGroup, out: KeysValues | None = None) -> KeysValues:
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
    seqs: Sequence[_SeqView]  # a tuple, or views built when read (`_LazySeqs`) for a kept decode plan's batch
    logits_indices: torch.Tensor
    # decode requests (one token) form one group, multi-token chunks another; None: attend request by request
    groups: tuple[_AttnGroup, ...] | None = None
    out_order: torch.Tensor | None = None  # row t of the output is row out_order[t] of the groups' outputs
    host_indices: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    decode_kv: DecodeKV | None = None  # serves groups[0], the decode requests (`Attention._gathered`)

    @classmethod
    def build(
        cls, chunks: Sequence[BatchChunk] | BatchColumns, block_size: int, device: torch.device | str = "cpu"
    ) -> PagedBatch:
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        seqs: list[_SeqView] = []
        sample_rows: list[int] = []
        columns = _columns(chunks)
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
            seqs.append(_SeqView(begin, begin + n, start, tuple(table[:needed])))
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
        cls, rows: _TokenRows, seqs: tuple[_SeqView, ...], plans: list[dict], device: torch.device | str
    ) -> PagedBatch:
        """One upload of every index list, then the masks on the device, then the batch."""
        packer = _Indices()
        handles = [packer.add(values) for values in rows[:5]]
        keys = ("blocks", "query_pos", "rows", "valid")
        group_handles = [{k: packer.add(p[k]) for k in keys if p[k] is not None} for p in plans]
        order_handle = packer.add(rows.out_order) if rows.out_order is not None else None
        host, views = packer.upload(device)
        groups = []
        for plan, h in zip(plans, group_handles, strict=True):
            mask = _attention_mask(views[h["query_pos"]], plan) if "query_pos" in h else None
            groups.append(
                _AttnGroup(
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


class BatchPlanner:
    """Builds each forward pass's `PagedBatch`, keeping the previous decode plan when the batch did not change.

    A decode-only batch of the same requests as the previous one (each one position further, the same block
    table up to its new block) is a persistent batch: its plan (`_DecodePlan`: the index tensors on the device,
    the padded block list, the group's shape and the `DecodeKV` of what it gathered) is updated in place, only
    where something changed: positions move on by one and offsets follow (two tensor operations), the requests
    that crossed into a new block get that block written into their slot and their row of the block list (one
    small upload), and the new tokens are uploaded. Requests that left are dropped from it in place, and requests
    that joined (after the plan's own, in batch order: the scheduler appends what it admits or resumes) are
    appended, their blocks alone gathered into its `DecodeKV`. A batch whose prefill chunks (several tokens each)
    come before its decode steps (the scheduler's order) keeps the plan for those decode steps and builds only the
    prefill chunks (`_with_prefill`): arrivals during decode and resumes cost one small build, not a rebuild of
    every decode row and a gather of all their blocks. Anything else (a reordered batch, a request whose context
    outgrew the plan's blocks, a changed table, a step that did not advance, a batch without decode steps) is
    built from scratch with `PagedBatch.build`. The chunks are read as columns (`BatchColumns`) and compared with
    the plan's by whole-list operations, so a steady step runs no Python loop body per request. Each decode plan
    gets its own `DecodeKV`, so its steps after the first gather only the blocks of the requests that joined.

    Invariants kept: `plan(chunks)` holds the same values as `PagedBatch.build(chunks, ...)`, and the same
    logits (`DecodeKV` keeps exactly what a gather would read); block tables are owned exclusively, so "the same
    table" identifies "the same request" within one step, and across steps a batch that names its owners (a
    `PlannedBatch`, `SeqChunk.owner`) is matched by owner, so blocks passed to another request (freed by one,
    taken by a resume) while the planner saw no batch are never read as the old request's; a table given as the
    very object of the previous step (the scheduler's pool keeps one immutable tuple per request until it
    changes) is that table, any other is compared block by block with the blocks the plan holds. A batch of a
    kept plan shares the plan's tensors: it is valid until the planner's next `plan()`, which updates them in
    place (on CUDA in stream order, after the forward that reads them).
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
        columns = _columns(chunks)
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

    def __init__(self, columns: _Columns, batch: PagedBatch, block_size: int, decode_kv: DecodeKV) -> None:
        (group,) = cast("tuple[_AttnGroup, ...]", batch.groups)
        self.batch, self.group, self.block_size, self.decode_kv = batch, group, block_size, decode_kv
        self.tables = [seq.table for seq in batch.seqs]
        self.keys = _keys(columns)
        self.given = list(columns.block_tables)
        self.starts = list(columns.starts)
        self.width = group.num_blocks

    def advance(self, columns: _Columns, device: torch.device) -> PagedBatch | None:
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
        columns: _Columns,
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
            packer = _Indices()
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
            else _attention_mask(positions, {"num_seqs": n, "num_queries": 1, "num_keys": num_keys})
        )
        self.group = group = _AttnGroup(n, 1, width, num_keys, None, 0, group_blocks, mask, None)
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


class _LazySeqs(Sequence[_SeqView]):
    """Per-request views of a batch built when read: nothing on the batched path reads them, and a decode step
    would otherwise build one per request. Compares equal to the tuple of `_SeqView`s it stands for."""

    __slots__ = ()

    def _view(self, i: int) -> _SeqView:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> _SeqView: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[_SeqView, ...]: ...

    def __getitem__(self, index: int | slice) -> _SeqView | tuple[_SeqView, ...]:
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

    def _view(self, i: int) -> _SeqView:
        return _SeqView(i, i + 1, self.starts[i], self.tables[i])

    def __iter__(self) -> Iterator[_SeqView]:
        n = len(self.starts)
        return map(_SeqView, range(n), range(1, n + 1), self.starts, self.tables)


class _PrefillFirstSeqs(_LazySeqs):
    """The views of a batch of prefill chunks (`prefill`, rows first) and decode steps (`decode`, each row moved
    past the prefill's `rows`), as `_with_prefill` joins them."""

    __slots__ = ("decode", "prefill", "rows")

    def __init__(self, prefill: Sequence[_SeqView], decode: Sequence[_SeqView], rows: int) -> None:
        self.prefill, self.decode, self.rows = prefill, decode, rows

    def __len__(self) -> int:
        return len(self.prefill) + len(self.decode)

    def _view(self, i: int) -> _SeqView:
        if i < len(self.prefill):
            return self.prefill[i]
        return self._moved(self.decode[i - len(self.prefill)])

    def _moved(self, view: _SeqView) -> _SeqView:
        return _SeqView(view.begin + self.rows, view.end + self.rows, view.start, view.table)

    def __iter__(self) -> Iterator[_SeqView]:
        return itertools.chain(self.prefill, map(self._moved, self.decode))


_ONE = itertools.repeat(1)  # `map(add, starts, _ONE)`: every position one further, without a Python loop body
_FIRST = operator.itemgetter(0)  # a table's first block: which request it is (tables are exclusive)


def _all_decode(columns: _Columns) -> bool:
    """Every chunk is one token that samples (a decode step)."""
    return all(columns.produces_token) and all(map((1).__eq__, map(len, columns.tokens)))


def _rows(columns: _Columns, rows: slice) -> _Columns:
    """These rows of a batch's columns."""
    owners = None if columns.owners is None else columns.owners[rows]
    return _Columns(
        columns.starts[rows], columns.tokens[rows], columns.block_tables[rows], columns.produces_token[rows], owners
    )


def _keys(columns: _Columns) -> list[Hashable]:
    """Who each row is: its owner where the batch says, else its table's first block (tables are exclusive at any
    one step, but blocks change owners between steps: a batch that names its owners is never mistaken)."""
    return list(columns.owners) if columns.owners is not None else list(map(_FIRST, columns.block_tables))


def _prefill_rows(columns: _Columns) -> int | None:
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
    (group,) = cast("tuple[_AttnGroup, ...]", decode.groups)
    n, device = group.num_seqs, decode.positions.device
    prefill_groups = cast("tuple[_AttnGroup, ...]", prefill.groups)
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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized in float32 at least (float64 stays float64), as Hugging Face does: squaring a float16 or
        bfloat16 activation of magnitude ~300 in its own dtype overflows or loses the mean."""
        if x.dtype in (torch.float16, torch.bfloat16):
            wide = x.float()
            return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        # Hugging Face's formula, op for op (so bit for bit its result): on the CPU this costs less than
        # F.rms_norm, whose composite runs the same steps with more dispatch around them. On the CPU torch's mean
        # is the sum divided by the count, written out here (the same float; a sum dispatches in less than half
        # the time of a mean)
        squares = x * x
        if x.device.type == "cpu":
            variance = torch.sum(squares, -1, keepdim=True).div_(x.shape[-1])
        else:
            variance = torch.mean(squares, -1, keepdim=True)
        variance += self.eps
        return self.weight * (x * variance.rsqrt_())


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` in float64 (computed once per shape and device; never mutated)."""
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, max_positions: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary factors of each position for `apply_rotary`, ``[T, 1, head_dim]`` each (broadcast over heads):
    cos, and sin with its first half negated (the sign of Hugging Face's ``rotate_half``). Angles are computed in
    float64, then cast. Computed once per forward pass and shared by every layer. With `max_positions` (every
    position is below it) the factors are read from a table of all of them (`_rotary_table`, made once): the
    same values, two lookups instead of computing them again."""
    if max_positions is not None:
        cos, sin = _rotary_table(head_dim, theta, dtype, positions.device, max_positions)
        return cos.index_select(0, positions), sin.index_select(0, positions)
    angles = positions.to(torch.float64)[:, None, None] * _inv_freq(head_dim, theta, positions.device)
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


@functools.lru_cache(maxsize=16)
def _rotary_table(
    head_dim: int, theta: float, dtype: torch.dtype, device: torch.device, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_cos_sin` of positions ``0 .. max_positions - 1`` (made once per shape, dtype and device; never
    mutated)."""
    with torch.inference_mode(False):  # normal tensors, usable outside inference mode too
        return rotary_cos_sin(torch.arange(max_positions, device=device), head_dim, theta, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by the factors of `rotary_cos_sin`: Hugging Face Llama's
    ``x * cos + rotate_half(x) * sin``, written as ``x * cos + roll(x, half) * signed sin`` (``roll`` swaps the
    halves; ``-x2 * s`` and ``x2 * -s`` are the same float, so the result is bit for bit the same)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Queries ``[n, Hq, D]`` at positions ``q_start ..`` over keys/values ``[S, Hkv, D]`` at positions ``0 .. S-1``.

    Query i sees keys ``0 .. q_start + i``. Query head h uses KV head ``h // (Hq // Hkv)`` (grouped-query).
    """
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * (1.0 / math.sqrt(head_dim))  # [H, n, S]
    if n > 1 or q_start + n < k.shape[0]:
        key_pos = torch.arange(k.shape[0], device=q.device)
        query_pos = torch.arange(q_start, q_start + n, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v.transpose(0, 1))  # [H, n, D]
    return out.transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # q, k and v projections as one matrix (rows: q, then k, then v): one matmul per layer
        self.qkv_proj = nn.Linear(
            config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=False
        )
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None, cache: LayerCache | None
    ) -> torch.Tensor:
        t, heads = h.shape[0], self.num_heads + self.num_kv_heads
        qkv = F.linear(h, self.qkv_proj.weight).view(
            t, heads + self.num_kv_heads, self.head_dim
        )  # q heads, k heads, v heads
        q, k = apply_rotary(qkv[:, :heads], cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, heads:]
        if batch is None:  # dense: one sequence starting at position 0
            out = causal_attention(q, k, v, 0)
        else:
            if cache is None:
                raise ValueError("a paged batch indexes cache blocks: pass the cache its block tables refer to")
            keys, values = cache.layer_keys(self.layer), cache.layer_values(self.layer)
            slots = (batch.slot_blocks, batch.slot_offsets)
            keys.index_put_(slots, k)
            values.index_put_(slots, v)
            if batch.groups is None:
                out = self._attend_per_sequence(q, keys, values, batch)
            else:
                cached, new = (keys, values), (k, v)
                parts = [
                    self._attend_group(q, self._gathered(cached, group, batch, new), group) for group in batch.groups
                ]
                out = torch.cat(parts) if len(parts) > 1 else parts[0]
                if batch.out_order is not None:
                    out = out.index_select(0, batch.out_order)
        return F.linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj.weight)

    def _gathered(
        self,
        cached: tuple[torch.Tensor, torch.Tensor],
        group: _AttnGroup,
        batch: PagedBatch,
        new: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks `group` attends over, from this layer's `cached` keys and values: kept by the plan's
        `DecodeKV` (updated with this step's `new` keys and values of the group's rows) when the batch has one and
        this is its decode group (the first: rows ``row_start ..``, after a batch's prefill chunks), else gathered."""
        if batch.decode_kv is None or batch.groups is None or group is not batch.groups[0]:
            return gather_blocks(cached, group)
        start = group.row_start
        positions = batch.positions
        if start:  # a batch with prefill chunks first: the decode rows' keys, values and positions
            end = start + group.num_seqs
            new = (new[0][start:end], new[1][start:end])
            positions = positions[start:end]
        return batch.decode_kv.read(self.layer, cached, group, new, positions)

    def _attend_group(
        self, q: torch.Tensor, gathered: tuple[torch.Tensor, torch.Tensor], group: _AttnGroup
    ) -> torch.Tensor:
        """One batched attention over the requests of `group`, whose blocks `gathered` holds (`gather_blocks`); returns
        ``[rows, num_heads, head_dim]``."""
        b, nq, dim = group.num_seqs, group.num_queries, self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if group.query_rows is None:
            gq = q if q.shape[0] == b * nq else q[group.row_start : group.row_start + b * nq]
        else:
            gq = q.index_select(0, group.query_rows)
        gk, gv = gathered  # head-major: [B, Hkv, span, D]
        span, read = gk.shape[2], group.num_keys
        if read < span:  # nobody's context reaches the last slots
            gk, gv = gk[:, :, :read], gv[:, :, :read]
        if nq == 1:  # decode: the query heads sharing a KV head are that head's query rows, [B, Hkv, H / Hkv, D]
            out = F.scaled_dot_product_attention(
                gq.reshape(b, kv_heads, heads // kv_heads, dim), gk, gv, attn_mask=group.mask
            )
            return out.reshape(b, heads, dim)
        gq = gq.view(b, nq, heads, dim).transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            gq, gk, gv, attn_mask=group.mask, enable_gqa=heads != kv_heads
        )  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(b * nq, heads, dim)
        return out if group.valid is None else out.index_select(0, group.valid)

    @staticmethod
    def _attend_per_sequence(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: PagedBatch
    ) -> torch.Tensor:
        """The unbatched path (a `PagedBatch` built without `groups`): one `causal_attention` per request."""
        parts = []
        for seq in batch.seqs:
            context = seq.start + seq.end - seq.begin
            table = torch.tensor(seq.table, dtype=torch.long, device=q.device)
            seq_k = keys[table].flatten(0, 1)[:context]
            seq_v = values[table].flatten(0, 1)[:context]
            parts.append(causal_attention(q[seq.begin : seq.end], seq_k, seq_v, seq.start))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # gate and up projections as one matrix (rows: gate, then up): one matmul
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


class DecoderLayer(nn.Module):
    """One decoder layer. Its forward, and the model's, call their parts' `forward` directly (and the linear
    layers' weights through `F.linear`): `nn.Module.__call__` costs about 9 µs a call on the CPU (hooks, tracing
    state), some 20 calls a step, a fixed cost of every step whatever its batch (no hooks are registered on these
    modules; the project registers none)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, batch, cache):
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, batch, cache)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


def _split_layer_name(name: str) -> tuple[str, str]:
    """``"layers.3.mlp.down_proj.weight"`` -> ``("layers.3", "mlp.down_proj.weight")``; others -> ``("", name)``."""
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3:
        return f"layers.{parts[1]}", parts[2]
    return "", name


class LlamaModel(nn.Module):
    """The decoder. Build with `LlamaModel.from_seed(config, seed)` or `executor.load_hf_llama(path)`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.requires_grad_(False)

    @classmethod
    def from_seed(
        cls,
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
    ) -> LlamaModel:
        """Seeded weights (a `torch.Generator` with `seed`; drawn in float64 on the CPU, so every device and
        dtype gets the same values up to rounding). Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
        norm weights ~ 1 + N(0, 0.1^2)."""
        config = config or ModelConfig()
        model = cls(config).to(torch.float64)
        generator = torch.Generator().manual_seed(seed)
        state = {}
        for name, param in model.hf_state_dict().items():  # drawn in Hugging Face's parameter order
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
            elif name == "embed_tokens.weight":
                value = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            else:
                value = torch.randn(param.shape, generator=generator, dtype=torch.float64) / math.sqrt(param.shape[1])
            state[name] = value
        model.load_hf_state_dict(state)
        return model.to(device=device, dtype=dtype).eval()

    def _fused_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Per fused parameter suffix: its Hugging Face parts (suffix, rows), in the order its rows stack."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        return {
            "self_attn.qkv_proj.weight": (
                ("self_attn.q_proj.weight", q),
                ("self_attn.k_proj.weight", kv),
                ("self_attn.v_proj.weight", kv),
            ),
            "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)),
        }

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters under Hugging Face's names (without ``model.``), in its order; the parts of a fused
        matrix are views of it."""
        fused_parts = self._fused_parts()
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            layer, suffix = _split_layer_name(name)
            parts = fused_parts.get(suffix)
            if parts is None:
                out[name] = tensor
                continue
            for (part, _), view in zip(parts, tensor.split([rows for _, rows in parts]), strict=True):
                out[f"{layer}.{part}"] = view
        return out

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load parameters given under Hugging Face's names (exactly those of `hf_state_dict`), concatenating
        the parts of each fused matrix; each value is cast into the model's dtype."""
        fused_state = dict(state)
        for layer in range(self.config.num_layers):
            for fused, parts in self._fused_parts().items():
                names = [f"layers.{layer}.{part}" for part, _ in parts]
                if all(name in fused_state for name in names):
                    fused_state[f"layers.{layer}.{fused}"] = torch.cat([fused_state.pop(name) for name in names])
        self.load_state_dict(fused_state)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | None, cache: LayerCache | None
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_tokens.weight)
        c = self.config
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype, c.max_position_embeddings)
        for layer in self.layers:
            h = layer.forward(h, cos, sin, batch, cache)  # DecoderLayer: parts called directly
        return self.norm.forward(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, cache: LayerCache) -> torch.Tensor:
        """Write every token's K/V into the cache and return logits ``[len(batch.logits_indices), vocab]``."""
        hidden = self._decode(batch.input_ids, batch.positions, batch, cache)
        if batch.logits_indices.shape[0] == hidden.shape[0]:  # every row samples (a decode step): rows in order
            return self.logits(hidden)
        return self.logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward of one sequence from position 0; logits ``[len(tokens), vocab]``."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        return self.logits(self._decode(ids, positions, None, None))
