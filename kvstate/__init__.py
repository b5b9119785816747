"""kvstate: a formally specified request lifecycle for paged KV caches with a GPU tier and a host tier.

The specification in `spec/` is the single source of truth; everything here is derived from it.
"""

from kvstate.config import ConfigError, RequestRejected, SchedulerConfig
from kvstate.errors import GuardRejected, IllegalTransition, InvariantViolation, KVStateError, PoolError, SpecError
from kvstate.lifecycle import Lifecycle, TransitionTable
from kvstate.output import SchedulerOutput, UnknownRequest
from kvstate.pool import MigrationPlan, TieredBlockPool
from kvstate.request import Request
from kvstate.scheduler import Scheduler, SchedulerStalled, UnknownRequestId
from kvstate.semantics import EFFECTS, GUARDS, EffectHooks, PoolView, RequestView
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import Event, ExclusiveGuards, Invariant, Spec, State, Transition, load_spec, packaged_spec_path
from kvstate.stats import IterationStats
from kvstate.validate import validate_spec

__all__ = [
    "ConfigError",
    "EffectHooks",
    "EFFECTS",
    "Event",
    "ExclusiveGuards",
    "GuardRejected",
    "GUARDS",
    "IllegalTransition",
    "Invariant",
    "InvariantViolation",
    "IterationStats",
    "KVStateError",
    "Lifecycle",
    "load_spec",
    "MigrationPlan",
    "packaged_spec_path",
    "PoolError",
    "PoolView",
    "reference_output",
    "Request",
    "RequestRejected",
    "RequestView",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStalled",
    "SimExecutor",
    "Spec",
    "SpecError",
    "State",
    "TieredBlockPool",
    "Transition",
    "TransitionTable",
    "UnknownRequest",
    "UnknownRequestId",
    "validate_spec",
]
