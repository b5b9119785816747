"""What each effect of the spec does to the blocks of the request it fires on, as its trace line shows them.

`EFFECT_RULES` maps every effect name of `kvstate.semantics.EffectHooks` (the names are taken from it, so a renamed
effect fails here) to a rule, or to None where the residency of the edge's destination already says everything (an
allocation from a state without blocks, a release into one). The trace validator finds a line's effect through the
spec's edge (`Transition.effect`), never through an event or state name, and applies its rule to the request's blocks
before the line (`BlocksBefore`, as of its last line) and the line itself. A rule returns None when the line is what
the effect leaves, else a `Problem`: the field that is wrong, the invariant it breaks (or None) and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from kvstate.semantics import EffectHooks

__all__ = ["EFFECT_RULES", "BlocksBefore", "EffectRule", "Problem", "moves_nothing", "offloads", "onboards"]


class BlocksBefore(NamedTuple):
    """A request's blocks just before one of its lines, as of its last line: `gpu` is exact when it was in a state
    that does not compute (nothing allocates for it between its lines), else a lower bound (`exact` False)."""

    gpu: int
    host: int
    exact: bool


# what an effect rule reports: (the field that is wrong, the invariant id it breaks or None, why)
Problem = tuple[str, str | None, str]
EffectRule = Callable[[BlocksBefore, dict], "Problem | None"]


def moves_nothing(before: BlocksBefore, line: dict) -> Problem | None:
    """No block moves: the request keeps its blocks where they are (a hold, a pause awaiting consensus)."""
    if line["host_blocks"] != before.host:
        return "host_blocks", None, f"is {line['host_blocks']} but was {before.host}: the effect moves no block"
    gpu = line["gpu_blocks"]
    if gpu < before.gpu or (before.exact and gpu != before.gpu):
        was = f"{before.gpu}" if before.exact else f"at least {before.gpu}"
        return "gpu_blocks", None, f"is {gpu} but was {was}: the effect moves no block (nothing is copied or freed)"
    return None


def offloads(before: BlocksBefore, line: dict) -> Problem | None:
    """k >= 1 of the request's GPU blocks move to the host tier; their GPU sources stay fenced until the copy ends."""
    gpu, host, moved = line["gpu_blocks"], line["host_blocks"], before.gpu - line["gpu_blocks"]
    if moved < 1:
        return "gpu_blocks", None, f"is {gpu} but was {before.gpu}: an offload moves at least one GPU block down"
    if host != before.host + moved:
        why = f"the {moved} GPU block(s) the offload took arrive in the host tier (host_blocks {before.host + moved})"
        return "host_blocks", None, f"is {host} but was {before.host}: {why}"
    if line["gpu_fenced"] < moved:
        why = f"the offload's {moved} GPU source block(s) stay fenced until its copy completes"
        return "gpu_fenced", "FENCE", f"is {line['gpu_fenced']}, fewer than {moved}: {why}"
    return None


def onboards(before: BlocksBefore, line: dict) -> Problem | None:
    """The request ends with all its blocks on the GPU: its GPU blocks locked again with no copy, its host blocks
    copied up into fresh GPU blocks (RESUME-COPY), their host sources fenced until the copy completes."""
    for field, want in (("host_blocks", 0), ("gpu_blocks", before.gpu + before.host)):
        if line[field] != want:
            why = f"a resume keeps its {before.gpu} GPU block(s) and copies its {before.host} host block(s) up"
            return field, "RESUME-COPY", f"is {line[field]} but must be {want}: {why}"
    if line["host_fenced"] < before.host:
        why = f"the resume's {before.host} host source block(s) stay fenced until its copy completes"
        return "host_fenced", "FENCE", f"is {line['host_fenced']}, fewer than {before.host}: {why}"
    return None


# effect name (`kvstate.semantics.EffectHooks`) -> what it does to its request's blocks, or None where the residency
# of the edge's destination already says it all (an allocation from, or a release into, a state without blocks)
EFFECT_RULES: Mapping[str, EffectRule | None] = MappingProxyType(
    {
        EffectHooks.allocate_first_chunk.__name__: None,
        EffectHooks.hold_blocks.__name__: moves_nothing,
        EffectHooks.offload_held_blocks.__name__: offloads,
        EffectHooks.lock_and_onboard.__name__: onboards,
        EffectHooks.release_kv_and_reset.__name__: None,
        EffectHooks.hold_for_consensus.__name__: moves_nothing,
        EffectHooks.release_kv_and_terminate.__name__: None,
        EffectHooks.defer_termination.__name__: moves_nothing,
    }
)
