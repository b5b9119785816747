"""State colours of the report, derived from the diagrams' residency colours (`kvstate.diagrams.dot`).

Every state takes the hue of its KV residency (GPU green, held blue, no KV grey, as in the lifecycle diagram's
clusters); states sharing a residency get distinct shades of that hue, in spec order. A request in a held state is
drawn lighter while its KV is still on the GPU, and darker the more of it was offloaded to the host tier
(`placement_color`). The state that plays the `dropped` role (KV dropped, replay pending: `kvstate.roles.DROPPED`)
keeps its grey and is hatched in the diagrams' destructive red. `COLOR_KEY` says all of this in words, for every
figure and page that shows the colours.
"""

from __future__ import annotations

from kvstate.diagrams.dot import CLUSTER_COLORS, DESTRUCTIVE_COLOR
from kvstate.roles import DROPPED
from kvstate.spec import Spec

SHADES = {  # per residency; for gpu and held the first shade is the diagram's stroke colour
    "gpu": (CLUSTER_COLORS["gpu"][1], "#66bb6a", "#a5d6a7", "#1b5e20"),
    "held": (CLUSTER_COLORS["held"][1], "#64b5f6", "#0d47a1"),
    "none": ("#bdbdbd", "#e0e0e0", CLUSTER_COLORS["none"][1], "#424242"),
}
# where a held request's KV is (`kvstate.report.model.placement`), and how much of its shade's distance to white
# is kept: light while still on the GPU, full once wholly offloaded
PLACEMENTS = {"gpu": 0.45, "split": 0.75, "host": 1.0}
PLACEMENT_WORDS = {"gpu": "on GPU", "split": "split", "host": "on host"}
DESTRUCTIVE_HATCH_COLOR = "#c62828"  # matplotlib has no "red3"; this is Graphviz red3's neighbour
COLOR_KEY = (
    "green = KV on GPU, blue = KV held (light: on the GPU, dark: offloaded to the host), grey = no KV; "
    "grey hatched red = KV dropped, replay pending (the red of the diagram's destructive edges)"
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


def placement_color(color: str, placement: str) -> str:
    """`color` (#rrggbb) as drawn for a held request's KV at `placement` (`PLACEMENTS`; "" keeps it)."""
    keep = PLACEMENTS.get(placement, 1.0)
    channels = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(255 - (255 - c) * keep):02x}" for c in channels)


def hatched(spec: Spec, state: str) -> bool:
    """Whether `state` is drawn hatched: it plays the `dropped` role."""
    return spec.state_by_role.get(DROPPED) == state


__all__ = [
    "COLOR_KEY",
    "DESTRUCTIVE_COLOR",
    "DESTRUCTIVE_HATCH_COLOR",
    "PLACEMENTS",
    "PLACEMENT_WORDS",
    "SHADES",
    "hatched",
    "placement_color",
    "state_colors",
]
