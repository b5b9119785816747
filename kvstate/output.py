"""The scheduler's output for one iteration, serializable as request ids.

Invariants kept: the request lists are pairwise disjoint (OUT-DISJOINT); `recompute_paused` defaults to
empty, so code that builds an output without naming it keeps working, and a dict without the key loads.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

from kvstate.errors import KVStateError
from kvstate.pool import MigrationPlan, TieredBlockPool
from kvstate.request import Request

# list name -> the lifecycle states a request in it may be in once the pass is over (OUT-STATE)
LIST_STATES: Mapping[str, tuple[str, ...]] = {
    "context": ("running",),
    "generation": ("running",),
    "replay": ("replaying",),
    "resumed": ("running",),
    "suspended": ("suspended", "recompute_paused"),
    "recompute_paused": ("recompute_paused", "awaiting_consensus"),
    "aborted": ("done",),
}
# A request suspended in a pass may be promoted later in the same pass; it is then listed as recompute-paused.

# states in which a request computes in a forward pass (it holds GPU blocks and is not awaiting consensus)
COMPUTING_STATES = ("running", "replaying")


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """What one scheduled request computes in a forward pass: `tokens` at positions `start`.., written into the
    KV slots of `block_table`; `produces_token` when the chunk ends its (re)prefill or is a decode step."""

    request: Request
    start: int
    tokens: tuple[int, ...]
    block_table: tuple[int, ...]
    produces_token: bool


def planned_chunks(output: SchedulerOutput, pool: TieredBlockPool) -> list[PlannedChunk]:
    """The forward pass of `output`, in batch order: the rest of a prefill chunk (of the prompt, or of the replay
    prompt) or the last generated token of a decode step. Requests ended since the output was planned drop out."""
    chunks = []
    for request in output.scheduled:
        if request.state not in COMPUTING_STATES:
            continue
        n = output.chunk_tokens[request.request_id]
        start = request.num_computed_tokens
        tokens = request.prefill_tokens[start:start + n] if request.is_prefilling else (request.generated[-1],)
        chunks.append(PlannedChunk(request, start, tuple(tokens), pool.gpu_blocks(request.request_id),
                                   start + n >= len(request.prefill_tokens)))
    return chunks


class UnknownRequest(KVStateError, KeyError):
    """A serialized output names a request id that is not active on the receiving side."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class SchedulerOutput:
    """What one iteration computes and moves. `chunk_tokens[id]` = tokens each scheduled request computes."""

    context: list[Request] = field(default_factory=list)
    generation: list[Request] = field(default_factory=list)
    replay: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    suspended: list[Request] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)
    migrations: list[MigrationPlan] = field(default_factory=list)
    chunk_tokens: dict[Hashable, int] = field(default_factory=dict)
    num_fitting_requests: int = 0
    recompute_paused: list[Request] = field(default_factory=list)

    @classmethod
    def list_names(cls) -> tuple[str, ...]:
        return tuple(LIST_STATES)

    def lists(self) -> Iterator[tuple[str, list[Request]]]:
        for name in LIST_STATES:
            yield name, getattr(self, name)

    @property
    def scheduled(self) -> list[Request]:
        """Requests that compute in this iteration's forward pass, in batch order."""
        return self.context + self.replay + self.generation

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
    def from_dict(cls, d: Mapping, requests_by_id: Mapping[Hashable, Request]) -> SchedulerOutput:
        """Rebuild an output from `to_dict()`; every id must be in `requests_by_id` (the active requests)."""

        def lookup(rid: Hashable, where: str) -> Request:
            try:
                return requests_by_id[rid]
            except KeyError:
                raise UnknownRequest(
                    f"scheduler output list {where!r} names request {rid!r}, which is not active here; "
                    "send outputs only to ranks that know the same requests"
                ) from None

        lists = {name: [lookup(rid, name) for rid in d.get(name, [])] for name in LIST_STATES}
        return cls(
            **lists,
            migrations=[MigrationPlan.from_dict(p) for p in d.get("migrations", [])],
            chunk_tokens={rid: int(n) for rid, n in d.get("chunk_tokens", [])},
            num_fitting_requests=int(d.get("num_fitting_requests", 0)),
        )

    def __eq__(self, other: object) -> bool:
        """Equal when they name the same requests, chunks and migrations (requests compare by id here)."""
        if not isinstance(other, SchedulerOutput):
            return NotImplemented
        return self.to_dict() == other.to_dict()
