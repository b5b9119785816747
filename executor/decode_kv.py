"""The kept keys and values of a decode plan (`DecodeKV`): what a decode step attends over, kept from one step
to the next so that a step of an unchanged batch gathers no blocks again.

`executor.batch.gather_blocks` is the reference it must equal: at every position a request attends (its context),
the kept rows hold exactly what a fresh gather of the cache would. Positions past a request's context may hold
other finite values; attention masks them to probability 0 either way.

What it keeps true:
* it belongs to one decode plan (`executor.decode_plan.BatchPlanner` makes a new one for every plan it builds),
  whose requests only append to their own blocks while it is reused;
* request i of the plan is row i of every kept layer;
* rows that stay are not copied when requests leave from the front or the back, nor when requests join into spare
  rows; only a join past the spare rows, or requests leaving from the middle, copy kept rows into new buffers;
* all kept layers together fit its byte budget; a layer that does not fit is gathered every step instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from executor.batch import AttentionGroup, KeysValues, gather_blocks, host_longs, key_positions

DECODE_KV_BUDGET_BYTES = 256 << 20  # what `DecodeKV` may keep, all layers together; past it, layers gather anew
SPARE_ROWS = 0.5  # rows a layer's buffers hold beyond the plan's requests, as a share of them (for joins)


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

    The first step of a plan gathers each layer's blocks from the cache head-major, ``[B, kv_heads, span,
    head_dim]`` (`gather_blocks`: each head's keys contiguous, the layout attention reads fastest), and keeps them.
    Each later step writes its new key and value into them (row i, at request i's position) after writing them into
    the cache, instead of gathering every block again.

    Each layer keeps its rows in buffers with spare rows (`_KeptLayer`, `SPARE_ROWS`). Requests that joined the
    plan since the last step (its last rows) have their blocks alone gathered into the spare rows after the kept
    ones. Requests that left from the front or the back (the oldest finish first) only move where the kept rows
    begin or end.

    Invariants:
    * at every position a request attends, its kept row (`kept[layer]`, views of the buffers, request i at row i)
      holds what a fresh gather of the cache would;
    * only a join past the spare rows (new buffers, with spare rows again) and requests leaving from the middle
      (the rows that stay, selected into new buffers) copy kept rows;
    * layers are kept while their buffers fit `budget`; the rest gather every step, so a large model on a small
      device keeps nothing extra."""

    __slots__ = ("_layers", "budget", "kept")

    def __init__(self, budget: int = DECODE_KV_BUDGET_BYTES) -> None:
        self.budget = budget
        self.kept: dict[int, KeysValues] = {}  # layer -> (keys, values) [B, Hkv, span, D]: `_layers[layer].live()`
        self._layers: dict[int, _KeptLayer] = {}

    def read(
        self, layer: int, cache: KeysValues, group: AttentionGroup, new: KeysValues, positions: torch.Tensor
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

    def _joined(self, layer: int, cache: KeysValues, group: AttentionGroup) -> KeysValues | None:
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

    def _allocated(self, layer: int, like: torch.Tensor, group: AttentionGroup) -> _KeptLayer | None:
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
