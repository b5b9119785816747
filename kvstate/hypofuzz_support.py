"""HypoFuzz campaigns beside the Hypothesis this package requires.

HypoFuzz 25.11.1 (the newest release) reads a shrunk failure's explanation comments as
`ConjectureResult.slice_comments`; Hypothesis 6.170 names that field `span_comments`. Without an alias a campaign's
worker dies at the first failure it shrinks, before it records it. `install()` adds a read-only alias where
Hypothesis lacks the old name; the kit's pytest plugin calls it in a HypoFuzz run only (`hypothesis fuzz`), so no
other run sees a changed Hypothesis.
"""

from __future__ import annotations

import sys

__all__ = ["in_hypofuzz_run", "install"]


def in_hypofuzz_run() -> bool:
    """Whether this process is one of a HypoFuzz campaign's (its command, or a worker it started)."""
    detection = sys.modules.get("hypofuzz.detection")
    return detection is not None and bool(detection.in_hypofuzz_run())


def install() -> None:
    """Alias `ConjectureResult.slice_comments` to `span_comments` where Hypothesis has only the latter. Raises
    `RuntimeError` naming both when it has neither (a Hypothesis that moved them again)."""
    from hypothesis import __version__
    from hypothesis.internal.conjecture.data import ConjectureResult

    if hasattr(ConjectureResult, "slice_comments"):
        return
    if "span_comments" not in getattr(ConjectureResult, "__dataclass_fields__", {}):
        raise RuntimeError(
            f"Hypothesis {__version__}'s ConjectureResult has neither slice_comments (which HypoFuzz reads) nor "
            "span_comments (its new name); install the HypoFuzz release made for this Hypothesis"
        )
    ConjectureResult.slice_comments = property(lambda result: result.span_comments)  # type: ignore[attr-defined]
