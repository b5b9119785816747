"""The diagram intermediate representation: what every renderer draws, built once from a `Spec`.

Invariants kept by `build_diagram`:
* every state of the spec is a node in exactly one cluster, the one named by its residency;
* nodes follow spec order; clusters follow `kvstate.spec.RESIDENCIES` order (gpu, held, none) and a
  residency without states has no cluster;
* every spec transition is exactly one `Edge`, in spec order (events, then their transitions), with the
  `EdgeKind` its source, destination and event imply (never its names);
* `drawn_edges` covers every edge exactly once: with `all_edges` one drawn edge per edge; otherwise the edges
  of a broadcast event (one enabled in every non-terminal state) into a terminal state are drawn as one edge
  from the `ANY_STATE` pseudo-node, and edges sharing source, destination, effect, kind and origin are drawn
  as one; edges tagged apart (a diff's changes) are bundled only with edges of the same tag, and never from
  `ANY_STATE`;
* nothing depends on dict order, the clock or the spec's file path, so renderers are byte-stable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kvstate.spec import RESIDENCIES, Spec, Transition

CLUSTER_TITLES = {
    "gpu": "GPU tier: KV in GPU blocks",
    "held": "held: on the GPU until offloaded, then in the host tier",
    "none": "no KV",
}
ANY_STATE = "__any_state__"  # the pseudo-node bundled broadcast edges start from


class EdgeKind(StrEnum):
    """What a transition does to the request's KV, derived from the spec's residencies and flags."""

    DROP = "drop"  # destructive, into a no-KV state: the KV is dropped and the request must be replayed
    HOLD = "hold"  # destructive decision whose destination still holds the KV: nothing dropped yet
    TERMINATE = "terminate"  # into a terminal state: the request ends and its KV is freed
    DEFER = "defer"  # a self-loop of an event that ends requests elsewhere: recorded now, carried out later
    KEEP = "keep"  # every other edge: the KV is kept (possibly moved between tiers, as a held request's offload)


@dataclass(frozen=True, slots=True)
class Node:
    """A lifecycle state as drawn; `final` marks a terminal state, `role` is the state's role in the spec
    (`kvstate.roles`; "" for none): the layout places states by it."""

    name: str
    residency: str
    meaning: str
    final: bool
    role: str = ""


@dataclass(frozen=True, slots=True)
class Cluster:
    """The states of one residency (one of `RESIDENCIES`): where their KV may live."""

    residency: str
    title: str
    nodes: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Edge:
    """One spec transition as drawn. `event` is the event's name, `event_label` its diagram label; `origin`
    (who decides the event), `feeds` (the output list it feeds, with that list's `feeds_production_name`) and
    `production_name` (the production engine's term) are the event's, as the spec states them."""

    source: str
    dest: str
    event: str
    event_label: str
    guard: str | None
    effect: str | None
    destructive: bool
    kind: EdgeKind = EdgeKind.KEEP
    origin: str = "scheduler"
    feeds: str | None = None
    feeds_production_name: str = ""
    production_name: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        """(event, source, dest): how a trace names the transition."""
        return (self.event, self.source, self.dest)


@dataclass(frozen=True, slots=True)
class DrawnEdge:
    """One arrow of a drawing: one or several `Edge`s (same destination, effect, kind and origin) drawn together.

    `source` is the members' common source, or `ANY_STATE` for a bundle of broadcast edges.
    """

    source: str
    dest: str
    kind: EdgeKind
    members: tuple[Edge, ...]

    @property
    def effect(self) -> str | None:
        return self.members[0].effect

    @property
    def origin(self) -> str:
        return self.members[0].origin

    @property
    def sources(self) -> tuple[str, ...]:
        """The real source states of the members, first-appearance order."""
        return tuple(dict.fromkeys(edge.source for edge in self.members))

    def head_parts(self, fired: Mapping[tuple[str, str, str], int] | None = None) -> tuple[str, ...]:
        """The label without the effect, one part per line. One distinct `event [guard]` among the members (a
        single edge, say): `event`, then `[guard]` when guarded; several: each `event [guard]` comma-separated on
        one line. With `fired`, each event is
        followed by `×N`, N summed over the members with that event and guard."""
        totals: dict[tuple[str, str | None], int] = {}
        for edge in self.members:
            head = (edge.event_label, edge.guard)
            totals[head] = totals.get(head, 0) + (fired.get(edge.key, 0) if fired is not None else 0)
        heads = [(label + (f" ×{n}" if fired is not None else ""), guard) for (label, guard), n in totals.items()]
        if len(heads) == 1:
            ((label, guard),) = heads
            return (label,) if guard is None else (label, f"[{guard}]")
        return (", ".join(label + (f" [{guard}]" if guard else "") for label, guard in heads),)

    def label_parts(self, fired: Mapping[tuple[str, str, str], int] | None = None) -> tuple[str, ...]:
        """`head_parts`, then `/ effect` when the members have an effect: `event`, `[guard]`, `/ effect` for one
        edge, one part per line."""
        return self.head_parts(fired) + ((f"/ {self.effect}",) if self.effect is not None else ())


@dataclass(frozen=True, slots=True)
class Diagram:
    """The whole lifecycle as drawn: nodes in spec order, the initial state and every edge.

    `all_edges` draws every transition as its own arrow; by default broadcast events are bundled (see the module
    docstring). `fired`, when given, holds each edge's firing count in a trace (keyed by `Edge.key`). `apart`, when
    given, tags edges (keyed by `Edge.key`, such as a diff's change): an arrow bundles only edges of one tag, and a
    tagged edge's event is not drawn from `ANY_STATE`; `bundled`, when given, limits the events drawn from
    `ANY_STATE` to those it lists (of the broadcast ones).
    """

    title: str
    version: int
    initial: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    all_edges: bool = False
    fired: Mapping[tuple[str, str, str], int] | None = field(default=None, compare=False)
    apart: Mapping[tuple[str, str, str], str] | None = field(default=None, compare=False)
    bundled: tuple[str, ...] | None = None

    @property
    def clusters(self) -> tuple[Cluster, ...]:
        """One cluster per residency that has states, in `RESIDENCIES` order; nodes keep spec order."""
        return tuple(
            Cluster(residency, CLUSTER_TITLES[residency], members)
            for residency in RESIDENCIES
            if (members := tuple(node for node in self.nodes if node.residency == residency))
        )

    @property
    def final_nodes(self) -> tuple[Node, ...]:
        return tuple(node for node in self.nodes if node.final)

    @property
    def event_edges(self) -> tuple[Edge, ...]:
        """The first edge of each event, in spec order: it carries the event's label and reviewer facts."""
        first: dict[str, Edge] = {}
        for edge in self.edges:
            first.setdefault(edge.event, edge)
        return tuple(first.values())

    @property
    def active_states(self) -> tuple[str, ...]:
        return tuple(node.name for node in self.nodes if not node.final)

    @property
    def broadcast_events(self) -> tuple[str, ...]:
        """Events enabled in every non-terminal state (an edge, a self-loop included, from each), spec order."""
        sources: dict[str, set[str]] = {}
        for edge in self.edges:
            sources.setdefault(edge.event, set()).add(edge.source)
        active = set(self.active_states)
        return tuple(event for event, states in sources.items() if states >= active)

    @property
    def drawn_edges(self) -> tuple[DrawnEdge, ...]:
        """The arrows to draw, covering every edge exactly once, in order of each arrow's first member."""
        if self.all_edges:
            return tuple(DrawnEdge(e.source, e.dest, e.kind, (e,)) for e in self.edges)
        tags = self.apart or {}
        broadcast = set(self.broadcast_events) - {e.event for e in self.edges if e.key in tags}
        if self.bundled is not None:
            broadcast &= set(self.bundled)
        groups: dict[tuple, list[Edge]] = {}
        for edge in self.edges:
            bundled = edge.kind is EdgeKind.TERMINATE and edge.event in broadcast
            source = ANY_STATE if bundled else edge.source
            key = (source, edge.dest, edge.effect, edge.kind, edge.origin, tags.get(edge.key))
            groups.setdefault(key, []).append(edge)
        return tuple(
            DrawnEdge(source, dest, kind, tuple(members)) for (source, dest, _, kind, *_), members in groups.items()
        )

    @property
    def any_state_excludes(self) -> tuple[str, ...]:
        """Non-terminal states the `ANY_STATE` bundle does not start from (its events loop there instead)."""
        bundled = {s for drawn in self.drawn_edges if drawn.source == ANY_STATE for s in drawn.sources}
        return tuple(s for s in self.active_states if bundled and s not in bundled)

    @property
    def any_state_label(self) -> str:
        """The `ANY_STATE` pseudo-node's label: "any state", then the states it excludes on a second line."""
        excluded = self.any_state_excludes
        return "any state" + (f"\nbut {', '.join(excluded)}" if excluded else "")

    def count(self, drawn: DrawnEdge) -> int | None:
        """How often the members of `drawn` fired in total, or None without `fired`."""
        return None if self.fired is None else sum(self.fired.get(edge.key, 0) for edge in drawn.members)


def edge_kind(spec: Spec, source: str, dest: str, destructive: bool, event: str | None = None) -> EdgeKind:
    """The `EdgeKind` of a transition, from the residencies and terminal flags of its states and, for a self-loop,
    whether its `event` ends requests on another edge (a deferred ending; without `event` every self-loop is one)."""
    target = spec.state_by_name[dest]
    if source == dest and (event is None or ends_requests(spec, event)):
        return EdgeKind.DEFER
    if target.terminal:
        return EdgeKind.TERMINATE
    if destructive:
        return EdgeKind.DROP if target.residency == "none" else EdgeKind.HOLD
    return EdgeKind.KEEP


def ends_requests(spec: Spec, event: str) -> bool:
    """Whether some edge of `event` leads into a terminal state."""
    return any(spec.state_by_name[t.dest].terminal for t in spec.event_by_name[event].transitions)


def build_diagram(spec: Spec, *, all_edges: bool = False) -> Diagram:
    """The diagram of `spec`; see the module docstring for the invariants it keeps."""
    nodes = tuple(
        Node(name=s.name, residency=s.residency, meaning=s.meaning, final=s.terminal, role=s.role) for s in spec.states
    )
    edges = tuple(edge_of(spec, t) for t in spec.transitions)
    return Diagram(
        title=spec.name, version=spec.version, initial=spec.initial, nodes=nodes, edges=edges, all_edges=all_edges
    )


def edge_of(spec: Spec, transition: Transition) -> Edge:
    """The `Edge` of one spec transition, with its event's reviewer facts (origin, list fed, production names)."""
    event = spec.event_by_name[transition.event]
    fed = next((output for output in spec.output_lists if output.name == event.feeds), None)
    return Edge(
        source=transition.source,
        dest=transition.dest,
        event=transition.event,
        event_label=event.label,
        guard=transition.guard,
        effect=transition.effect,
        destructive=transition.destructive,
        kind=edge_kind(spec, transition.source, transition.dest, transition.destructive, transition.event),
        origin=event.origin,
        feeds=event.feeds,
        feeds_production_name=fed.production_name if fed is not None else "",
        production_name=event.production_name,
    )
