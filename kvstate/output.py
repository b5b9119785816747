"""The scheduler's output for one iteration, serializable as request ids.

Invariants kept: the request lists are pairwise disjoint (OUT-DISJOINT); `recompute_paused` defaults to
empty, so code that builds an output without naming it keeps working, and a dict without the key loads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import NamedTuple, cast, overload

from kvstate.errors import InvariantViolation, KVStateError, UnknownRequestId
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan, TieredBlockPool
from kvstate.request import Request
from kvstate.roles import LIST_NAMES
from kvstate.spec import Spec, default_spec
from kvstate.untrusted import shown

# The most block copies into one tier an output may carry when the tiers' capacities are not given to `from_dict`
# (an output writes each destination block once, so a tier's capacity bounds them when it is given).
MAX_MIGRATION_PAIRS = 1 << 16

# The lists whose requests compute in the forward pass, in batch order (`SchedulerOutput.scheduled`).
SCHEDULED_LISTS: tuple[str, ...] = ("context", "replay", "generation")


class PlannedChunk(NamedTuple):
    """What one scheduled request computes in a forward pass: `tokens` at positions `start`.., written into the
    KV slots of `block_table`; `produces_token` when the chunk ends its (re)prefill or is a decode step."""

    request: Request
    start: int
    tokens: tuple[int, ...]
    block_table: tuple[int, ...]
    produces_token: bool


@dataclass(frozen=True, slots=True)
class PlannedBatch(Sequence[PlannedChunk]):
    """The forward pass of one output as parallel columns: entry i of every column belongs to the i-th chunk, in
    batch order (all columns have the same length). A consumer that builds its own batch reads whole columns, and
    planning makes no record per chunk; as a sequence it yields the same chunks as `PlannedChunk` records, each
    built when it is read."""

    requests: list[Request]
    starts: list[int]
    tokens: list[tuple[int, ...]]
    block_tables: list[tuple[int, ...]]
    produces_token: list[bool]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[PlannedChunk]:
        return map(PlannedChunk, self.requests, self.starts, self.tokens, self.block_tables, self.produces_token)

    @overload
    def __getitem__(self, index: int) -> PlannedChunk: ...

    @overload
    def __getitem__(self, index: slice) -> list[PlannedChunk]: ...

    def __getitem__(self, index: int | slice) -> PlannedChunk | list[PlannedChunk]:
        if isinstance(index, slice):
            return list(self)[index]
        return PlannedChunk(
            self.requests[index],
            self.starts[index],
            self.tokens[index],
            self.block_tables[index],
            self.produces_token[index],
        )


def planned_chunks(output: SchedulerOutput, pool: TieredBlockPool) -> PlannedBatch:
    """The forward pass of `output`, in batch order (`output.scheduled`): the rest of a prefill chunk (of the prompt,
    or of the replay prompt) or the last generated token of a decode step. Requests ended since the output was
    planned drop out: they no longer hold the GPU blocks their chunk would write. Block tables are the pool's own
    (immutable) tuples. Built column by column (`PlannedBatch`), the decode steps (the bulk of a batch) without a
    per-request branch: it runs for every scheduled request on every step. Each column is a comprehension over the
    requests, which the interpreter specializes to a slot read per request (`map` over an `attrgetter` calls it
    generically: twice the time on CPython 3.11)."""
    table_of = pool.gpu_block_table_of()
    decoding, decode_tables = _holding_blocks(output.generation, table_of)
    starts = [r.num_computed_tokens for r in decoding]
    tokens = [r.last_token for r in decoding]
    produces = [True] * len(decoding)
    if not output.context and not output.replay:  # a decode-only pass (the steady state)
        return PlannedBatch(decoding, starts, tokens, decode_tables, produces)
    prefilling, prefill_tables = _holding_blocks(output.context + output.replay, table_of)
    chunk_tokens = output.chunk_tokens
    prefill_starts = [r.num_computed_tokens for r in prefilling]
    ends = [start + chunk_tokens[r.request_id] for r, start in zip(prefilling, prefill_starts, strict=True)]
    return PlannedBatch(
        prefilling + decoding,
        prefill_starts + starts,
        [r.prefill_tokens[start:end] for r, start, end in zip(prefilling, prefill_starts, ends, strict=True)] + tokens,
        prefill_tables + decode_tables,
        [end >= len(r.prefill_tokens) for r, end in zip(prefilling, ends, strict=True)] + produces,
    )


def _holding_blocks(
    requests: list[Request], table_of: Callable[[Hashable], tuple[int, ...] | None]
) -> tuple[list[Request], list[tuple[int, ...]]]:
    """The requests that still hold GPU blocks, in order, and their block tables (`table_of`: None for none)."""
    found = [table_of(r.request_id) for r in requests]
    if all(found):
        return requests, cast("list[tuple[int, ...]]", found)
    kept = [i for i, table in enumerate(found) if table]
    return [requests[i] for i in kept], [cast("tuple[int, ...]", found[i]) for i in kept]


@dataclass(frozen=True, slots=True)
class FailedMigration:
    """An amendment to one pass's output, returned by `Scheduler.fail_migration`: the executor could not copy
    `plan`, so the scheduler withdrew it (spec §4.0) and fired `event` (`lose_host_copy` for a suspend,
    `recompute_pause` for a resume) on `request`. `SchedulerOutput.amended` applies it to the output."""

    plan: MigrationPlan
    request: Request
    event: str


# eq=True (with its own `__eq__`) makes the dataclass set `__hash__` to None: mutable, compared by content, not
# hashable. Ruff does not see that generated None (PLW1641); mypy rejects writing it by hand.
@dataclass(eq=True)
class SchedulerOutput:  # noqa: PLW1641
    """What one iteration computes and moves. `chunk_tokens[id]` = tokens each scheduled request computes."""

    context: list[Request] = field(default_factory=list)
    generation: list[Request] = field(default_factory=list)
    replay: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    suspended: list[Request] = field(default_factory=list)
    migrations: list[MigrationPlan] = field(default_factory=list)
    chunk_tokens: dict[Hashable, int] = field(default_factory=dict)
    num_fitting_requests: int = 0
    recompute_paused: list[Request] = field(default_factory=list)

    def lists(self) -> Iterator[tuple[str, list[Request]]]:
        for name in LIST_NAMES:
            yield name, getattr(self, name)

    def amended(self, failure: FailedMigration) -> SchedulerOutput:
        """A new output: this one with `failure`'s plan withdrawn from `migrations` and its request moved from
        `suspended` / `resumed` to `recompute_paused` (OUT-DISJOINT, OUT-STATE hold). This output is unchanged."""
        request, plan_id = failure.request, failure.plan.plan_id
        return replace(
            self,
            migrations=[p for p in self.migrations if p.plan_id != plan_id],
            suspended=[r for r in self.suspended if r is not request],
            resumed=[r for r in self.resumed if r is not request],
            recompute_paused=[*self.recompute_paused, request],
        )

    @property
    def scheduled(self) -> list[Request]:
        """Requests that compute in this iteration's forward pass, in batch order (`SCHEDULED_LISTS`)."""
        return list(chain.from_iterable(getattr(self, name) for name in SCHEDULED_LISTS))

    @property
    def num_scheduled(self) -> int:
        """`len(scheduled)`, without building the list (the lengths of the `SCHEDULED_LISTS`)."""
        return len(self.context) + len(self.replay) + len(self.generation)

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_tokens.values())

    def to_dict(self) -> dict:
        """A JSON-safe dict naming requests by id."""
        d: dict = {name: [r.request_id for r in requests] for name, requests in self.lists()}
        d["migrations"] = [plan.to_dict() for plan in self.migrations]
        d["chunk_tokens"] = [[rid, n] for rid, n in self.chunk_tokens.items()]
        d["num_fitting_requests"] = self.num_fitting_requests
        return d

    @classmethod
    def from_dict(
        cls, d: Mapping, requests_by_id: Mapping[Hashable, Request], *, capacities: Mapping[str, int] | None = None
    ) -> SchedulerOutput:
        """Rebuild an output from `to_dict()`; every id must be in `requests_by_id` (the active requests).

        The dict comes from another rank, so it is checked as untrusted data before anything is built: an unknown
        request id raises `UnknownRequestId`; any other departure from the shape `to_dict()` writes (a non-mapping,
        a string or number where a list belongs, an id in two lists (OUT-DISJOINT), a chunk count below 1, for a
        request not scheduled or longer than the request can ever be (prompt + max_new_tokens), a
        `num_fitting_requests` above the requests scheduled, a migration without `pairs`, in an unknown direction,
        with a negative block id, a block id outside its tier's capacity (`capacities`: blocks per tier, "gpu"
        and "host", when given), a destination block written twice, a repeated plan id, a second migration of one
        request (one copy per request), or more copies into a tier than it has blocks (`MAX_MIGRATION_PAIRS`
        without `capacities`), counted before a pair is read) raises `MalformedOutput` naming the key; values are
        echoed short.
        """
        if not isinstance(d, Mapping):
            raise MalformedOutput(
                f"a serialized scheduler output must be a mapping (from to_dict()), got {type(d).__name__}"
            )
        lists: dict[str, list[Request]] = {}
        listed: dict[Hashable, str] = {}
        for name in LIST_NAMES:
            lists[name] = []
            for rid in _sequence(d, name):
                request = _lookup(requests_by_id, rid, name)
                if rid in listed:
                    raise MalformedOutput(
                        f"request {shown(rid)} is in lists {listed[rid]!r} and {name!r}; the lists "
                        "of an output are disjoint (OUT-DISJOINT)"
                    )
                listed[rid] = name
                lists[name].append(request)
        scheduled = {r.request_id for name in ("context", "replay", "generation") for r in lists[name]}
        chunk_tokens: dict[Hashable, int] = {}
        for entry in _sequence(d, "chunk_tokens"):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise MalformedOutput(f"'chunk_tokens' entries are [request id, tokens] pairs, got {shown(entry)}")
            rid, n = entry
            if not isinstance(rid, (int, str)) or rid not in scheduled or rid in chunk_tokens:
                why = (
                    "twice"
                    if isinstance(rid, (int, str)) and rid in chunk_tokens
                    else "for a request not in context, replay or generation"
                )
                raise MalformedOutput(
                    f"'chunk_tokens' gives request {shown(rid)} a chunk {why}; each scheduled request has exactly one"
                )
            request = requests_by_id[rid]
            chunk_tokens[rid] = _count(
                n,
                f"'chunk_tokens' of request {shown(rid)}",
                minimum=1,
                maximum=len(request.prompt) + request.max_new_tokens,
                why="the tokens the request can ever hold (prompt + max_new_tokens)",
            )
        if scheduled - set(chunk_tokens):
            rid = next(iter(scheduled - set(chunk_tokens)))
            raise MalformedOutput(
                f"scheduled request {shown(rid)} has no 'chunk_tokens' entry; each scheduled request has exactly one"
            )
        migrations = _migrations(_sequence(d, "migrations"), requests_by_id, capacities)
        fitting = _count(
            d.get("num_fitting_requests", 0),
            "'num_fitting_requests'",
            minimum=0,
            maximum=len(chunk_tokens),
            why="the requests the output schedules",
        )
        return cls(**lists, migrations=migrations, chunk_tokens=chunk_tokens, num_fitting_requests=fitting)

    def __eq__(self, other: object) -> bool:
        """Equal when they name the same requests, chunks and migrations (requests compare by id here)."""
        if not isinstance(other, SchedulerOutput):
            return NotImplemented
        return self.to_dict() == other.to_dict()


class MalformedOutput(KVStateError, ValueError):
    """A serialized scheduler output (`SchedulerOutput.from_dict`) is not in the shape `to_dict()` writes."""


def _lookup(requests_by_id: Mapping[Hashable, Request], rid: object, where: str) -> Request:
    if not isinstance(rid, (int, str)) or isinstance(rid, bool):
        raise MalformedOutput(
            f"scheduler output list {where!r} holds {shown(rid)}; request ids are integers or strings"
        )
    try:
        return requests_by_id[rid]
    except KeyError:
        raise UnknownRequestId(
            f"scheduler output list {where!r} names request {shown(rid)}, which is not active here; "
            "send outputs only to ranks that know the same requests"
        ) from None


def _sequence(d: Mapping, key: str) -> list | tuple:
    value = d.get(key, [])
    if not isinstance(value, (list, tuple)):
        raise MalformedOutput(f"{key!r} must be a list, got {type(value).__name__} {shown(value)}")
    return value


def _count(value: object, what: str, *, minimum: int, maximum: int | None = None, why: str = "") -> int:
    """`value`, an integer from `minimum` to `maximum` (`why` says what the maximum is)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MalformedOutput(f"{what} must be an integer >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise MalformedOutput(f"{what} is {shown(value)}, more than {maximum}, {why}")
    return value


def _migrations(
    entries: list | tuple, requests_by_id: Mapping[Hashable, Request], capacities: Mapping[str, int] | None
) -> list[MigrationPlan]:
    """The plans of `entries`: at most one per request (one copy per request is in flight) and per plan id, and
    no more copies into a tier than it has blocks, counted before a plan's pairs are read."""
    if len(entries) > len(requests_by_id):
        raise MalformedOutput(
            f"'migrations' holds {len(entries)} plans for {len(requests_by_id)} active requests; a request has at "
            "most one copy in flight"
        )
    room = {tier: MAX_MIGRATION_PAIRS if capacities is None else capacities[tier] for tier in ("gpu", "host")}
    migrations: list[MigrationPlan] = []
    plan_of: dict[Hashable, int] = {}  # request id -> its plan id
    plan_ids: set[int] = set()
    for entry in entries:
        plan = _migration(entry, requests_by_id, capacities, room)
        if plan.plan_id in plan_ids:
            raise MalformedOutput(f"'migrations' repeats a plan id ({plan.plan_id}); each plan id is unique")
        if plan.request_id in plan_of:
            raise MalformedOutput(
                f"'migrations': plans {plan_of[plan.request_id]} and {plan.plan_id} both copy request "
                f"{shown(plan.request_id)}; a request has at most one copy in flight (one copy per request)"
            )
        plan_ids.add(plan.plan_id)
        plan_of[plan.request_id] = plan.plan_id
        migrations.append(plan)
    _check_destinations(migrations)
    return migrations


def _migration(
    p: object, requests_by_id: Mapping[Hashable, Request], capacities: Mapping[str, int] | None, room: dict[str, int]
) -> MigrationPlan:
    """One plan; `room` (blocks per tier the output may still copy into) is reduced by its pairs."""
    if not isinstance(p, Mapping):
        raise MalformedOutput(f"'migrations' entries are mappings (MigrationPlan.to_dict()), got {shown(p)}")
    missing = [k for k in ("plan_id", "request_id", "direction", "pairs") if k not in p]
    if missing:
        raise MalformedOutput(f"a migration lacks {', '.join(map(repr, missing))}; got keys {sorted(map(str, p))}")
    plan_id = _count(p["plan_id"], "a migration's 'plan_id'", minimum=0)
    _lookup(requests_by_id, p["request_id"], f"migrations (plan {plan_id})")
    if p["direction"] not in (TO_HOST, TO_GPU):
        raise MalformedOutput(
            f"migration plan {plan_id} has direction {shown(p['direction'])}; it is {TO_HOST!r} or {TO_GPU!r}"
        )
    tiers = _TIERS[p["direction"]]  # (source tier, destination tier)
    sizes = [None if capacities is None else capacities[tier] for tier in tiers]
    listed = _sequence(p, "pairs")
    if len(listed) > room[tiers[1]]:
        limit = (
            f"its capacity of {capacities[tiers[1]]} blocks"
            if capacities is not None
            else f"MAX_MIGRATION_PAIRS = {MAX_MIGRATION_PAIRS} without capacities"
        )
        raise MalformedOutput(
            f"migration plan {plan_id}: 'pairs' holds {len(listed)} copies into the {tiers[1]} tier, more than the "
            f"{room[tiers[1]]} the output may still write there; an output writes each block of a tier at most "
            f"once ({limit})"
        )
    room[tiers[1]] -= len(listed)
    pairs: list[tuple[int, int]] = []
    for pair in listed:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise MalformedOutput(
                f"migration plan {plan_id}: 'pairs' holds {shown(pair)}; each pair is [source block, destination block]"
            )
        source, dest = (
            _count(
                b,
                f"migration plan {plan_id}: a block id",
                minimum=0,
                maximum=None if size is None else size - 1,
                why=f"the last block of the {tier} tier of {size} blocks",
            )
            for b, size, tier in zip(pair, sizes, tiers, strict=True)
        )
        pairs.append((source, dest))
    return MigrationPlan(plan_id, p["request_id"], p["direction"], tuple(pairs))


_TIERS = {TO_HOST: ("gpu", "host"), TO_GPU: ("host", "gpu")}  # direction -> (source tier, destination tier)


def _check_destinations(migrations: list[MigrationPlan]) -> None:
    """No block of a tier is the destination of two copies of one output."""
    written: set[tuple[str, int]] = set()
    for plan in migrations:
        tier = _TIERS[plan.direction][1]
        for _, dest in plan.pairs:
            if (tier, dest) in written:
                raise MalformedOutput(
                    f"migration plan {plan.plan_id} copies into {tier} block {dest}, which another copy of the "
                    "output writes too; each destination block is written once"
                )
            written.add((tier, dest))


def check_output(output: SchedulerOutput, spec: Spec | None = None) -> None:
    """OUT-DISJOINT and OUT-STATE (the states `spec`, by default the packaged one, implies for each list) for one
    output, right after the pass that produced it; a request ended since (a terminal state) is allowed in any list."""
    spec = spec if spec is not None else default_spec()
    seen: dict[int, str] = {}
    for name, requests in output.lists():
        for request in requests:
            if id(request) in seen:
                raise InvariantViolation(
                    "OUT-DISJOINT", f"request {request.request_id!r} is in both {seen[id(request)]!r} and {name!r}"
                )
            seen[id(request)] = name
    terminal = set(spec.terminal_states)
    for name, requests in output.lists():
        allowed = spec.list_states[name]
        for request in requests:
            if request.state not in allowed and request.state not in terminal:
                raise InvariantViolation(
                    "OUT-STATE",
                    f"request {request.request_id!r} in list {name!r} is "
                    f"{request.state}, expected one of {tuple(sorted(allowed))}",
                )
