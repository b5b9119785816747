"""The diagram intermediate representation: what every renderer draws, built once from a `Spec`.

Invariants kept by `build_diagram`:
* every state of the spec is a node in exactly one cluster, the one named by its residency;
* nodes follow spec order; clusters follow `kvstate.spec.RESIDENCIES` order (gpu, host, none) and a
  residency without states has no cluster;
* every spec transition is exactly one edge, in spec order (events, then their transitions);
* nothing depends on dict order, the clock or the spec's file path, so renderers are byte-stable.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.spec import RESIDENCIES, Spec

CLUSTER_TITLES = {
    "gpu": "GPU tier: KV in GPU blocks",
    "host": "host tier: KV in pinned host memory",
    "none": "no KV held",
}


@dataclass(frozen=True, slots=True)
class Node:
    """A lifecycle state as drawn; `final` marks a terminal state."""

    name: str
    residency: str
    meaning: str
    final: bool


@dataclass(frozen=True, slots=True)
class Cluster:
    """The states whose KV lives in one tier (`residency` is one of `RESIDENCIES`)."""

    residency: str
    title: str
    nodes: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Edge:
    """One spec transition as drawn. `event` is the event's name, `event_label` its diagram label."""

    source: str
    dest: str
    event: str
    event_label: str
    guard: str | None
    effect: str | None
    destructive: bool

    @property
    def label_parts(self) -> tuple[str, ...]:
        """`event`, then `[guard]` when guarded, then `/ effect` when the edge has an effect."""
        parts = [self.event_label]
        if self.guard is not None:
            parts.append(f"[{self.guard}]")
        if self.effect is not None:
            parts.append(f"/ {self.effect}")
        return tuple(parts)

    @property
    def label(self) -> str:
        """The one-line label `event [guard] / effect`."""
        return " ".join(self.label_parts)


@dataclass(frozen=True, slots=True)
class Diagram:
    """The whole lifecycle as drawn: nodes in spec order, the initial state and every edge."""

    title: str
    version: int
    initial: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]

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


def build_diagram(spec: Spec) -> Diagram:
    """The diagram of `spec`; see the module docstring for the invariants it keeps."""
    nodes = tuple(Node(name=s.name, residency=s.residency, meaning=s.meaning, final=s.terminal) for s in spec.states)
    edges = tuple(
        Edge(
            source=t.source,
            dest=t.dest,
            event=t.event,
            event_label=spec.event_by_name[t.event].label,
            guard=t.guard,
            effect=t.effect,
            destructive=t.destructive,
        )
        for t in spec.transitions
    )
    return Diagram(title=spec.name, version=spec.version, initial=spec.initial, nodes=nodes, edges=edges)
