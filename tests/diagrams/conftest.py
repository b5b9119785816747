"""What the diagram tests share: a long chain of states, a diagram no spec of ours is."""

from __future__ import annotations

import pytest

from kvstate.diagrams.ir import Diagram, Edge, EdgeKind, Node


@pytest.fixture
def chain():
    """A function: the diagram of a chain of `states` states, each one step from the next."""

    def build(states: int) -> Diagram:
        nodes = tuple(
            Node(f"s{i}", "gpu" if i % 2 else "none", "a state of a long chain", i == states - 1) for i in range(states)
        )
        edges = tuple(
            Edge(f"s{i}", f"s{i + 1}", "step", "step", None, None, False, EdgeKind.KEEP) for i in range(states - 1)
        )
        return Diagram("chain", 1, "s0", nodes, edges, all_edges=True)

    return build
