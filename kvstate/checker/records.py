"""The records of the abstract model: its states, their requests and pool counts, its actions and edges.

Abstract state (hashable, immutable): an `AbstractState(requests, gpu_free, host_free, gpu_fenced, host_fenced)`
where `requests` is a sorted tuple of `AbstractRequest(group, state, computed, generated, gpu, host, deferred,
prefill, in_flight, fenced_gpu, fenced_host, incoming)` records (named tuples: they compare, hash and sort as the
plain tuples of their fields): `group` indexes the bound's distinct (prompt_len, max_new_tokens) pairs, `state` is a
spec state ("" = not arrived yet), `deferred` the termination reason recorded while awaiting consensus ("" = none)
and `prefill` the length of the (replay) prompt. The host tier is present iff the bound's host capacity is > 0; the
pipeline depth is the bound's. `in_flight` (0/1) marks a decode step that may still be in the pipeline when a
recompute-pause or a suspend was decided (pipeline stages > 1 only). A suspended request holds its KV split: `host`
blocks (the prefix of its table that offloads moved) and `gpu` blocks (held, still on the GPU); a request in a gpu
state holds `gpu` blocks only. A request's copy in flight (the guards allow one at a time: SPEC.md section 4.0) is
`fenced_gpu` and `fenced_host`, the blocks it fences in each tier (its sources, and its destinations once the
request released them), and `incoming`, the destinations the request still holds (host blocks for an offload, whose
sources are GPU blocks; GPU blocks for a resume, whose sources are host blocks); the pool's fenced counts are their
sums, and a finished request keeps the record of its copy until it completes.
Sorting the tuples is the symmetry reduction: requests with equal parameters are interchangeable, so states that
differ only by a permutation of them are one state.

An `Action(kind, slot, name)` names what an edge does; `AbstractModel.apply` returns the `Edge` it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvstate.spec import Transition

ABSENT = ""  # the state of a request that has not arrived yet
NONE = ""  # no deferred termination reason
STOP = "stop"  # the name of a compute action whose token is a stop token


class AbstractRequest(NamedTuple):
    """One request of an abstract state; fields in sort order (the symmetry reduction sorts by them)."""

    group: int  # index into the bound's distinct (prompt_len, max_new_tokens) pairs
    state: str  # a spec state, or ABSENT
    computed: int  # KV tokens computed
    generated: int  # tokens produced
    gpu: int  # GPU blocks held
    host: int  # host blocks held
    deferred: str  # the termination reason recorded while awaiting consensus, or NONE
    prefill: int  # length of the (replay) prompt
    in_flight: int  # 1: a decode step still in the pipeline when a recompute-pause or a suspend was decided
    fenced_gpu: int = 0  # GPU blocks its in-flight copy fences: its sources, and its destinations once released
    fenced_host: int = 0  # host blocks its in-flight copy fences, likewise
    incoming: int = 0  # blocks it holds that its in-flight copy still writes (its destinations, until released)


class PoolCounts(NamedTuple):
    """The pool part of an abstract state."""

    gpu_free: int
    host_free: int
    gpu_fenced: int
    host_fenced: int


class AbstractState(NamedTuple):
    """A node of the abstract state graph: the requests (sorted: canonical) and the pool counts."""

    requests: tuple[AbstractRequest, ...]
    gpu_free: int
    host_free: int
    gpu_fenced: int
    host_fenced: int


class Action(NamedTuple):
    """What an edge does: ("arrive", k, None), ("event", k, "suspend"), ("compute", k, None) or
    ("complete", k, None); `k` is the request's slot in the state the edge leaves. `tokens` (bounds with a token
    budget per pass only) cuts a compute step's chunk, or the first chunk an event allocates, to that many tokens,
    as a pass whose budget runs out does. `blocks` is the block count an event whose guard or effect reads the
    pool's `offload_limit` (the offload of held blocks) is fired with: the abstract model tries every count an
    allocation may ask for (`AbstractModel.limited_events`). Plain 3-tuples are accepted wherever an action is
    (counterexample files write them as literals)."""

    kind: str
    slot: int | None
    name: str | None
    tokens: int | None = None
    blocks: int | None = None


def abstract_state(state: tuple) -> AbstractState:
    """`state` as records: a plain tuple of the same layout (as a hand-built test state may be) or a record."""
    requests, *pool = state
    return AbstractState(tuple(AbstractRequest(*r) for r in requests), *pool)


@dataclass(frozen=True, slots=True)
class Edge:
    """One edge of the abstract state graph, before canonicalization: `before` and `after_requests` list the
    requests in the same order (`slot` indexes both); `taken` are the spec transitions the edge fired."""

    action: Action
    before: AbstractState
    after_requests: tuple[AbstractRequest, ...]
    after_pool: PoolCounts
    taken: tuple[Transition, ...]

    @property
    def slot(self) -> int | None:
        return self.action[1]
