"""State colours of the report, derived from the diagrams' residency colours (`kvstate.diagrams.dot`).

Every state takes the hue of its KV residency (GPU green, host blue, no KV grey, as in the lifecycle diagram's
clusters); states sharing a residency get distinct shades of that hue, in spec order. A destructive waiting
state (`recompute_paused`: KV dropped, replay pending) is also hatched in the diagrams' destructive red.
"""

from __future__ import annotations

from kvstate.diagrams.dot import CLUSTER_COLORS, DESTRUCTIVE_COLOR
from kvstate.spec import Spec

SHADES = {  # per residency, darkest first; the diagram's stroke colour is the first shade
    "gpu": (CLUSTER_COLORS["gpu"][1], "#66bb6a", "#a5d6a7", "#1b5e20"),
    "host": (CLUSTER_COLORS["host"][1], "#64b5f6", "#0d47a1"),
    "none": ("#bdbdbd", CLUSTER_COLORS["none"][1], "#e0e0e0", "#424242"),
}
DESTRUCTIVE_HATCH_COLOR = "#c62828"  # matplotlib has no "red3"; this is Graphviz red3's neighbour
REPLAY_PENDING = "recompute_paused"


def state_colors(spec: Spec) -> dict[str, str]:
    """{state: hex colour} for every non-terminal state, shades assigned in spec order within a residency."""
    used: dict[str, int] = {}
    colors = {}
    for state in spec.states:
        if state.terminal:
            continue
        shades = SHADES[state.residency]
        colors[state.name] = shades[used.get(state.residency, 0) % len(shades)]
        used[state.residency] = used.get(state.residency, 0) + 1
    return colors


def hatched(state: str) -> bool:
    return state == REPLAY_PENDING


__all__ = ["DESTRUCTIVE_COLOR", "DESTRUCTIVE_HATCH_COLOR", "hatched", "state_colors"]
