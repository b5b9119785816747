"""kvstate: a formally specified request lifecycle for paged KV caches with a GPU tier and a host tier.

The specification in `spec/` is the single source of truth; everything here is derived from it.
"""

from kvstate.errors import GuardRejected, IllegalTransition, KVStateError, SpecError
from kvstate.lifecycle import Lifecycle, TransitionTable
from kvstate.semantics import EFFECTS, GUARDS, EffectHooks, PoolView, RequestView
from kvstate.spec import Event, ExclusiveGuards, Invariant, Spec, State, Transition, load_spec, packaged_spec_path
from kvstate.validate import validate_spec

__all__ = [
    "EFFECTS",
    "GUARDS",
    "EffectHooks",
    "Event",
    "ExclusiveGuards",
    "GuardRejected",
    "IllegalTransition",
    "Invariant",
    "KVStateError",
    "Lifecycle",
    "PoolView",
    "RequestView",
    "Spec",
    "SpecError",
    "State",
    "Transition",
    "TransitionTable",
    "load_spec",
    "packaged_spec_path",
    "validate_spec",
]
