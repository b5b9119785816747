"""The tiered block pool: block accounting for a GPU tier and an optional host tier, and migration plans.

Invariants kept (checked by `TieredBlockPool.check_invariants`, ids from the spec):
* CONS-GPU / CONS-HOST: in each tier, free + owned + fenced = capacity;
* OWN-EXCL: a block is free, owned by exactly one request, or fenced by exactly one in-flight copy;
* FENCE: the source blocks of a migration, and its destination blocks once their owner is released, stay
  fenced (unallocatable) until `complete(plan)` is called;
* held blocks: an owner that `hold` made evictable keeps its GPU blocks until `offload` moves them, first in table
  order, to the host tier; owners are offloaded least recently held first (`held_owners`); `onboard` locks an
  owner's GPU blocks again and copies only its host blocks up, placing them before its GPU blocks, so its table
  keeps its order; offload and onboard are all-or-nothing: a refused one changes nothing.
Allocation prefers the lowest free ids, so a request's blocks tend to form runs the executor copies at once.
A request's block table is an immutable tuple, replaced when it grows or shrinks, so reading it (every decode
step, `planned_chunks`) copies nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstate.errors import InvariantViolation, PoolError, TierFull

TO_HOST = "to_host"
TO_GPU = "to_gpu"
_NOBODY = object()  # the owner of a block nobody holds (never equal to an owner)


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator (denominator > 0): e.g. blocks that hold a token count."""
    return -(-numerator // denominator)


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """Copies that move one request's KV between tiers: `pairs` are (source block, destination block)."""

    plan_id: int
    request_id: Hashable
    direction: str
    pairs: tuple[tuple[int, int], ...]

    @property
    def num_blocks(self) -> int:
        return len(self.pairs)

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """Merged copies (source start, destination start, length) over runs of consecutive ids on both sides."""
        merged: list[list[int]] = []
        for src, dst in self.pairs:
            if merged and src == merged[-1][0] + merged[-1][2] and dst == merged[-1][1] + merged[-1][2]:
                merged[-1][2] += 1
            else:
                merged.append([src, dst, 1])
        return tuple((s, d, n) for s, d, n in merged)

    def to_dict(self) -> dict:
        return {
            "plan_id": self.plan_id,
            "request_id": self.request_id,
            "direction": self.direction,
            "pairs": [list(p) for p in self.pairs],
        }

    @classmethod
    def from_dict(cls, d: dict) -> MigrationPlan:
        return cls(d["plan_id"], d["request_id"], d["direction"], tuple((int(s), int(t)) for s, t in d["pairs"]))


@dataclass
class Tier:
    """One tier of `capacity` blocks: each block is free, held by one owner, or fenced by one plan."""

    name: str
    capacity: int
    _free: list[int] = field(init=False, repr=False)
    owner_of: dict[int, Hashable] = field(init=False, default_factory=dict)
    blocks_of: dict[Hashable, tuple[int, ...]] = field(init=False, default_factory=dict)
    fenced: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise PoolError(f"{self.name} tier capacity must be >= 0, got {self.capacity}")
        self._free = list(range(self.capacity))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_blocks(self) -> tuple[int, ...]:
        """The free block ids, in increasing order (the order allocation takes them in)."""
        return tuple(sorted(self._free))

    def held(self, owner: Hashable) -> tuple[int, ...]:
        return self.blocks_of.get(owner, ())

    def take_front(self, owner: Hashable, count: int) -> list[int]:
        """`count` free blocks placed before `owner`'s blocks in its table (what `take` appends)."""
        blocks = self.take(owner, count)
        table = self.blocks_of[owner]
        self.blocks_of[owner] = table[-count:] + table[:-count] if count else table
        return blocks

    def take(self, owner: Hashable, count: int) -> list[int]:
        if count > len(self._free):
            raise TierFull(
                f"{self.name} tier has {len(self._free)} free blocks, {owner!r} asked for {count}; "
                "check can_allocate() first",
                tier=self.name,
                free=len(self._free),
                asked=count,
            )
        blocks = [heapq.heappop(self._free) for _ in range(count)]
        for block in blocks:
            self.owner_of[block] = owner
        self.blocks_of[owner] = self.blocks_of.get(owner, ()) + tuple(blocks)  # `held(owner)` + the new blocks
        return blocks

    def take_one_each(self, owners: list[Hashable]) -> None:
        """One more block for each of `owners`, in order: the same blocks as `take(owner, 1)` for each in turn, in
        one call. Raises `PoolError` (nothing changed) when fewer than `len(owners)` are free."""
        if len(owners) > len(self._free):
            raise TierFull(
                f"{self.name} tier has {len(self._free)} free blocks, {len(owners)} owners asked for one each; "
                "check can_allocate() first",
                tier=self.name,
                free=len(self._free),
                asked=len(owners),
            )
        free, owner_of, blocks_of = self._free, self.owner_of, self.blocks_of
        for owner in owners:
            block = heapq.heappop(free)
            owner_of[block] = owner
            blocks_of[owner] = (*blocks_of.get(owner, ()), block)

    def give_back(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)

    def release(self, owner: Hashable) -> tuple[int, ...]:
        blocks = self.blocks_of.pop(owner, ())
        if not blocks:
            return blocks  # it holds nothing here (the host tier of a GPU-only victim, a second release)
        for block in blocks:
            del self.owner_of[block]
        self.give_back(blocks)
        return blocks

    def fence(self, owner: Hashable, plan_id: int, count: int | None = None) -> tuple[int, ...]:
        """Move the first `count` blocks of `owner`'s table (default: all) from owned to fenced by `plan_id`."""
        table = self.blocks_of.pop(owner, ())
        blocks, kept = (table, ()) if count is None else (table[:count], table[count:])
        if kept:
            self.blocks_of[owner] = kept
        for block in blocks:
            del self.owner_of[block]
            self.fenced[block] = plan_id
        return blocks

    def fence_blocks(self, owner: Hashable, blocks: list[int], plan_id: int) -> None:
        """Move the given blocks of `owner` from held to fenced by `plan_id` (a copy still writes them). Raises
        `PoolError` (nothing changed) when `owner` does not hold one of them."""
        wanted = set(blocks)
        foreign = sorted(b for b in wanted if self.owner_of.get(b, _NOBODY) != owner)
        if foreign:
            raise PoolError(f"{self.name} blocks {foreign} are not held by {owner!r}; only held blocks can be fenced")
        self.blocks_of[owner] = tuple(b for b in self.held(owner) if b not in wanted)
        for block in blocks:
            del self.owner_of[block]
            self.fenced[block] = plan_id

    def fenced_by(self, plan_id: int) -> list[int]:
        return [block for block, plan in self.fenced.items() if plan == plan_id]

    def unfence(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for block in blocks:
            del self.fenced[block]
        self.give_back(blocks)

    def check(self) -> None:
        free = set(self._free)
        held = set(self.owner_of)
        fenced = set(self.fenced)
        tag = "CONS-GPU" if self.name == "gpu" else "CONS-HOST"
        if len(free) != len(self._free):
            raise InvariantViolation(tag, f"{self.name} tier: a block is on the free list twice")
        if len(free) + len(held) + len(fenced) != self.capacity:
            raise InvariantViolation(
                tag,
                f"{self.name} tier: free {len(free)} + held {len(held)} + fenced "
                f"{len(fenced)} != capacity {self.capacity}",
            )
        if free & held or free & fenced or held & fenced:
            twice = sorted((free & held) | (free & fenced) | (held & fenced))
            raise InvariantViolation("OWN-EXCL", f"{self.name} tier: blocks {twice} have two roles")
        listed = [(b, owner) for owner, blocks in self.blocks_of.items() for b in blocks]
        if len(listed) != len(held) or any(
            self.owner_of.get(b, owner) != owner or b not in held for b, owner in listed
        ):
            raise InvariantViolation("OWN-EXCL", f"{self.name} tier: owner tables disagree with block ownership")
        if any(b < 0 or b >= self.capacity for b in free | held | fenced):
            raise InvariantViolation(tag, f"{self.name} tier: a block id is outside 0..{self.capacity - 1}")


class TieredBlockPool:
    """Block accounting for a GPU tier and an optional host tier (capacity 0 = no host tier).

    Verb pairs: `can_allocate`/`allocate`, `can_offload`/`offload`, `can_onboard`/`onboard`; `hold` makes an
    owner's GPU blocks evictable, `release` frees a request's blocks in both tiers, `complete` ends a migration's
    fence. Satisfies the pool figures of `kvstate.PoolView`.
    """

    def __init__(self, gpu_blocks: int, host_blocks: int = 0, block_size: int = 16, pipeline_stages: int = 1) -> None:
        if gpu_blocks <= 0:
            raise PoolError(f"the GPU tier needs at least one block, got gpu_blocks={gpu_blocks}")
        if block_size <= 0:
            raise PoolError(f"block_size must be a positive number of tokens, got {block_size}")
        if pipeline_stages <= 0:
            raise PoolError(f"pipeline_stages must be >= 1, got {pipeline_stages}")
        self.block_size = block_size
        self.gpu = Tier("gpu", gpu_blocks)
        self.host = Tier("host", host_blocks)
        self._pipeline_stages = pipeline_stages
        self.in_flight: dict[int, MigrationPlan] = {}
        self._next_plan_id = 0
        self._held: dict[Hashable, None] = {}  # owners whose GPU blocks are held, least recently held first

    # ---- PoolView
    @property
    def gpu_free_blocks(self) -> int:
        return len(self.gpu._free)  # `gpu.num_free`, read on every decision of a pass

    @property
    def host_free_blocks(self) -> int:
        return len(self.host._free)

    def view_figures(self, max_util_for_resume: float) -> tuple[int, int, bool, int, bool]:
        """(`gpu_free_blocks`, `host_free_blocks`, `has_host_tier`, `pipeline_stages`,
        `resume_gate_open(max_util_for_resume)`) in one call: what a scheduling pass's `PassView` takes of the pool
        for each decision."""
        host = self.host
        return (
            len(self.gpu._free),
            len(host._free),
            host.capacity > 0,
            self._pipeline_stages,
            max_util_for_resume >= 1 or self.resume_gate_open(max_util_for_resume),  # 1: open, with no call
        )

    @property
    def has_host_tier(self) -> bool:
        return self.host.capacity > 0

    @property
    def pipeline_stages(self) -> int:
        return self._pipeline_stages

    # ---- sizes
    def blocks_for_tokens(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def gpu_blocks(self, owner: Hashable) -> tuple[int, ...]:
        """`owner`'s GPU block table (the tuple itself: it is replaced, never changed, when the table changes)."""
        return self.gpu.blocks_of.get(owner, ())

    def host_blocks(self, owner: Hashable) -> tuple[int, ...]:
        return self.host.blocks_of.get(owner, ())

    def gpu_block_tables(self) -> Mapping[Hashable, tuple[int, ...]]:
        """Every owner's GPU block table, as a read-only view that follows the pool (owners without blocks are
        absent); one lookup per owner, for callers that read many tables at once."""
        return MappingProxyType(self.gpu.blocks_of)

    def gpu_block_table_of(self) -> Callable[[Hashable], tuple[int, ...] | None]:
        """A lookup of owners' GPU block tables (None for an owner without blocks) that follows the pool: the table
        dict's own `get`, which reads only, for a caller that looks up every running request's table on every step
        (a read-only view's `get` looks the method up again on each call, at twice the cost)."""
        return self.gpu.blocks_of.get

    # ---- GPU allocation
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.gpu._free)

    def allocate(self, owner: Hashable, num_blocks: int) -> list[int]:
        """Append `num_blocks` fresh GPU blocks to `owner`'s block table."""
        return self.gpu.take(owner, num_blocks)

    def allocate_one_each(self, owners: list[Hashable]) -> None:
        """Append one fresh GPU block to each of `owners`' block tables, in order (`allocate(owner, 1)` for each in
        turn, in one call: the decode steps of a pass that open a new block). Raises `PoolError` (nothing changed)
        unless `can_allocate(len(owners))`."""
        self.gpu.take_one_each(owners)

    def release(self, owner: Hashable) -> int:
        """Free every block `owner` holds in both tiers; returns how many. Blocks an in-flight copy of `owner`
        still writes stay fenced by that copy until `complete` (FENCE), and are freed then. Releasing an owner
        again (it holds nothing now; its copies' destinations are fenced already) changes nothing: every sequence
        of releases during a copy is well defined."""
        if self.in_flight:
            for plan in [p for p in self.in_flight.values() if p.request_id == owner]:
                dest = self.host if plan.direction == TO_HOST else self.gpu
                held = set(dest.held(owner))
                dest.fence_blocks(owner, [dst for _, dst in plan.pairs if dst in held], plan.plan_id)
        self._held.pop(owner, None)
        return len(self.gpu.release(owner)) + len(self.host.release(owner))

    # ---- held blocks and migration
    def hold(self, owner: Hashable) -> None:
        """`owner`'s GPU blocks become held: evictable, offloaded after every owner held before it."""
        if self.gpu.held(owner):
            self._held[owner] = None

    def held_owners(self) -> list[Hashable]:
        """The owners whose GPU blocks are held, least recently held first (the order `offload` takes them in)."""
        return list(self._held)

    def is_held(self, owner: Hashable) -> bool:
        return owner in self._held

    @property
    def gpu_held_blocks(self) -> int:
        """GPU blocks held by owners (evictable where a host tier exists)."""
        return sum(len(self.gpu.held(owner)) for owner in self._held)

    def resume_gate_open(self, max_util: float) -> bool:
        """The utilization gate of a resume: the GPU blocks neither free nor held (locked by computing owners,
        fenced) are at most `max_util` of the GPU tier (1 never refuses)."""
        if max_util >= 1:
            return True  # at most the whole tier is unavailable
        return self.gpu.capacity - self.gpu_free_blocks - self.gpu_held_blocks <= max_util * self.gpu.capacity

    def can_offload(self, owner: Hashable, count: int) -> bool:
        """`owner` is held, holds at least `count` GPU blocks, has no copy in flight, and the host tier has room."""
        return (
            owner in self._held
            and 0 < count <= len(self.gpu.held(owner))
            and count <= self.host.num_free
            and not any(p.request_id == owner for p in self.in_flight.values())
        )

    def offload(self, owner: Hashable, count: int) -> MigrationPlan:
        """Plan GPU -> host copies of the first `count` of `owner`'s held GPU blocks; the GPU sources are fenced until
        `complete`, the host destinations are `owner`'s at once (after its earlier host blocks: its table keeps its
        order). An owner left with no GPU block is no longer held."""
        if not self.can_offload(owner, count):
            message = (
                f"cannot offload {count} blocks of {owner!r}: it holds {len(self.gpu.held(owner))} GPU blocks"
                f"{'' if owner in self._held else ' and is not held'}, the host tier has {self.host.num_free} free of "
                f"{self.host.capacity}; offload only held blocks the host tier can take, one copy at a time"
            )
            if count > self.host.num_free:
                raise TierFull(message, tier=self.host.name, free=self.host.num_free, asked=count)
            raise PoolError(message)
        plan = self._migrate(owner, self.gpu, self.host, TO_HOST, count)
        if not self.gpu.held(owner):
            del self._held[owner]
        return plan

    def can_onboard(self, owner: Hashable) -> bool:
        """`owner`'s host blocks fit the GPU tier's free blocks and no copy of it is in flight."""
        return len(self.host.held(owner)) <= self.gpu.num_free and not any(
            p.request_id == owner for p in self.in_flight.values()
        )

    def onboard(self, owner: Hashable) -> MigrationPlan | None:
        """Lock `owner`'s held GPU blocks again (no copy) and plan host -> GPU copies of its host blocks into fresh GPU
        blocks placed before them; the host sources are fenced until `complete`. None when nothing is copied."""
        if not self.can_onboard(owner):
            need = len(self.host.held(owner))
            message = (
                f"cannot onboard {owner!r}: it holds {need} host blocks, the GPU tier has {self.gpu.num_free} free; "
                "wait for GPU room"
            )
            if need > self.gpu.num_free:
                raise TierFull(message, tier=self.gpu.name, free=self.gpu.num_free, asked=need)
            raise PoolError(f"cannot onboard {owner!r}: a copy of it is in flight; complete it first")
        self._held.pop(owner, None)
        if not self.host.held(owner):
            return None
        return self._migrate(owner, self.host, self.gpu, TO_GPU)

    def _migrate(
        self, owner: Hashable, source: Tier, dest: Tier, direction: str, count: int | None = None
    ) -> MigrationPlan:
        plan_id = self._next_plan_id
        self._next_plan_id += 1
        src_blocks = source.fence(owner, plan_id, count)
        if direction == TO_GPU:
            dst_blocks = dest.take_front(owner, len(src_blocks))
        else:
            dst_blocks = dest.take(owner, len(src_blocks))
        plan = MigrationPlan(plan_id, owner, direction, tuple(zip(src_blocks, dst_blocks, strict=True)))
        self.in_flight[plan_id] = plan
        return plan

    def complete(self, plan: MigrationPlan) -> None:
        """The executor reports `plan`'s copies done: its source blocks become free."""
        if self.in_flight.pop(plan.plan_id, None) is None:
            raise PoolError(f"migration plan {plan.plan_id} is not in flight; complete each plan exactly once")
        for tier in (self.gpu, self.host):
            tier.unfence(tier.fenced_by(plan.plan_id))

    # ---- host tier presence
    def set_host_capacity(self, host_blocks: int) -> None:
        """Attach, resize or (with 0) detach the host tier; only allowed while it holds and fences nothing."""
        if self.host.owner_of or self.host.fenced:
            raise PoolError(
                f"cannot change the host tier while it holds {len(self.host.owner_of)} blocks and fences "
                f"{len(self.host.fenced)}; release suspended requests and complete copies first"
            )
        self.host = Tier("host", host_blocks)

    # ---- invariants
    def check_invariants(self) -> None:
        """Raise `InvariantViolation` (naming the spec invariant) unless every pool invariant holds."""
        self.gpu.check()
        self.host.check()
        for tier in (self.gpu, self.host):
            stale = {b: p for b, p in tier.fenced.items() if p not in self.in_flight}
            if stale:
                raise InvariantViolation("FENCE", f"{tier.name} blocks {sorted(stale)} are fenced by finished plans")
        empty = [owner for owner in self._held if not self.gpu.held(owner)]
        if empty:
            raise InvariantViolation("CONS-GPU", f"owners {empty[:5]!r} are held but hold no GPU block")

    def usage(self) -> dict[str, int]:
        return {
            "gpu_capacity": self.gpu.capacity,
            "gpu_free": self.gpu.num_free,
            "gpu_owned": len(self.gpu.owner_of),
            "gpu_held": self.gpu_held_blocks,
            "gpu_fenced": len(self.gpu.fenced),
            "host_capacity": self.host.capacity,
            "host_free": self.host.num_free,
            "host_owned": len(self.host.owner_of),
            "host_fenced": len(self.host.fenced),
        }
