"""kvstate: a formally specified request lifecycle for paged KV caches with a GPU tier and a host tier.

The specification in `spec/` is the single source of truth; everything here is derived from it.
"""

from kvstate.config import ConfigError, RequestRejected, SchedulerConfig
from kvstate.errors import (
    GuardRejected,
    IllegalTransition,
    InvariantViolation,
    KVStateError,
    PoolError,
    SchedulerStalled,
    SpecError,
    TierFull,
    UnknownRequestId,
)
from kvstate.lifecycle import Lifecycle, TransitionTable
from kvstate.output import FailedMigration, SchedulerOutput
from kvstate.pool import MigrationPlan, TieredBlockPool
from kvstate.request import Request
from kvstate.scheduler import Scheduler, Step
from kvstate.semantics import EFFECTS, GUARDS, EffectHooks, PassView, PoolView, RequestView
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import Event, ExclusiveGuards, Invariant, Spec, State, Transition, load_spec, packaged_spec_path
from kvstate.stats import IterationStats
from kvstate.trace import FiredTransition
from kvstate.validate import validate_spec

__all__ = [
    "EFFECTS",
    "GUARDS",
    "ConfigError",
    "EffectHooks",
    "Event",
    "ExclusiveGuards",
    "FailedMigration",
    "FiredTransition",
    "GuardRejected",
    "IllegalTransition",
    "Invariant",
    "InvariantViolation",
    "IterationStats",
    "KVStateError",
    "Lifecycle",
    "MigrationPlan",
    "PassView",
    "PoolError",
    "PoolView",
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
    "Step",
    "TierFull",
    "TieredBlockPool",
    "Transition",
    "TransitionTable",
    "UnknownRequestId",
    "load_spec",
    "packaged_spec_path",
    "reference_output",
    "validate_spec",
]
