"""State colours of the report, derived from the diagrams' residency colours (`kvstate.diagrams.dot`).

Every state takes the hue of its KV residency (GPU green, host blue, no KV grey, as in the lifecycle diagram's
clusters); states sharing a residency get distinct shades of that hue, in spec order. The state that plays the
`dropped` role (KV dropped, replay pending: `kvstate.roles.DROPPED`) keeps its grey and is hatched in the
diagrams' destructive red. `COLOR_KEY` says all of this in words, for every figure and page that shows the colours.
"""

from __future__ import annotations

from kvstate.diagrams.dot import CLUSTER_COLORS, DESTRUCTIVE_COLOR
from kvstate.roles import DROPPED
from kvstate.spec import Spec

SHADES = {  # per residency; for gpu and host the first shade is the diagram's stroke colour
    "gpu": (CLUSTER_COLORS["gpu"][1], "#66bb6a", "#a5d6a7", "#1b5e20"),
    "host": (CLUSTER_COLORS["host"][1], "#64b5f6", "#0d47a1"),
    "none": ("#bdbdbd", "#e0e0e0", CLUSTER_COLORS["none"][1], "#424242"),
}
DESTRUCTIVE_HATCH_COLOR = "#c62828"  # matplotlib has no "red3"; this is Graphviz red3's neighbour
COLOR_KEY = (
    "green = KV on GPU, blue = KV on host, grey = no KV; grey hatched red = KV dropped, replay pending "
    "(the red of the diagram's destructive edges)"
)


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


def hatched(spec: Spec, state: str) -> bool:
    """Whether `state` is drawn hatched: it plays the `dropped` role."""
    return spec.state_by_role.get(DROPPED) == state


__all__ = ["COLOR_KEY", "DESTRUCTIVE_COLOR", "DESTRUCTIVE_HATCH_COLOR", "SHADES", "hatched", "state_colors"]
