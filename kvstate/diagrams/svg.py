"""Render DOT source as SVG with the Graphviz `dot` program, when it is installed.

SVG is not byte-stable across Graphviz versions, so it is generated but never diffed; the DOT source is.
"""

from __future__ import annotations

import graphviz

from kvstate.errors import KVStateError

DOT_MISSING = "Graphviz `dot` is not installed; install Graphviz (e.g. apt-get install graphviz) to render SVG"


def render_svg(dot_source: str) -> bytes | None:
    """The SVG drawing of `dot_source`, or None when the `dot` program is not on PATH.

    Raises `KVStateError` when `dot` is installed but rejects the source.
    """
    try:
        return graphviz.pipe("dot", "svg", dot_source.encode("utf-8"))
    except graphviz.ExecutableNotFound:
        return None
    except graphviz.CalledProcessError as err:
        stderr = err.stderr.decode("utf-8", "replace").strip() if err.stderr else ""
        raise KVStateError(f"Graphviz `dot` rejected the generated DOT source: {stderr}; report this as a bug") from err
