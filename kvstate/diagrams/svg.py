"""Draw DOT source with the Graphviz `dot` program, when it is installed, within a time limit.

The DOT sources carry their own layout (`kvstate.diagrams.layout`), so `dot` draws them with the `neato` engine
in its "positions given" mode (`DRAW_AS_GIVEN`): Graphviz only draws. SVG is not byte-stable across Graphviz
versions, so it is generated but never diffed; the DOT source is.
Invariants kept: `dot` never runs longer than its `timeout` (it is killed, and a `KVStateError` says what to
do); an SVG drawing is passed through `kvstate.diagrams.escape.safe_svg`, so it holds no link or script.
"""

from __future__ import annotations

import shutil
import subprocess

from kvstate.diagrams.escape import UnsafeSvgError, safe_svg
from kvstate.errors import KVStateError

DOT_MISSING = "Graphviz `dot` is not installed; install Graphviz (e.g. apt-get install graphviz) to render SVG"
DOT_TIMEOUT_S = 60.0
FORMATS = ("svg", "png")
DRAW_AS_GIVEN = ("-Kneato", "-n2")  # nodes, edges, labels and clusters where the source puts them


def render_image(dot_source: str, fmt: str = "svg", *, timeout: float = DOT_TIMEOUT_S) -> bytes | None:
    """`dot_source` drawn as `fmt` (one of `FORMATS`), or None when the `dot` program is not on PATH.

    Raises `KVStateError` when `dot` rejects the source, fails, or runs past `timeout` seconds (it is then
    killed).
    """
    if fmt not in FORMATS:
        raise ValueError(f"image format {fmt!r} is not one of {FORMATS}")
    program = shutil.which("dot")
    if program is None:
        return None
    try:
        done = subprocess.run(
            [program, *DRAW_AS_GIVEN, f"-T{fmt}"],
            input=dot_source.encode("utf-8"),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise KVStateError(
            f"Graphviz `dot` did not finish drawing the diagram within {timeout:g} s and was stopped; the spec is "
            "probably too large to lay out: draw a smaller spec, or allow more time with --dot-timeout SECONDS"
        ) from err
    except OSError as err:
        raise KVStateError(
            f"cannot run Graphviz `dot` ({program}): {err.strerror}; check the Graphviz installation"
        ) from err
    if done.returncode != 0:
        stderr = done.stderr.decode("utf-8", "replace").strip()
        raise KVStateError(
            f"Graphviz `dot` rejected the generated DOT source (exit {done.returncode}): {stderr}; report this as a bug"
        )
    if fmt != "svg":
        return done.stdout
    try:
        return safe_svg(done.stdout).encode("utf-8")
    except UnsafeSvgError as err:
        raise KVStateError(f"Graphviz `dot` wrote an SVG that cannot be checked: {err}; report this as a bug") from err


def render_svg(dot_source: str, *, timeout: float = DOT_TIMEOUT_S) -> bytes | None:
    """The sanitized SVG drawing of `dot_source`, or None when `dot` is not installed (see `render_image`)."""
    return render_image(dot_source, "svg", timeout=timeout)
