"""Model checking of the lifecycle spec and refinement checking of the real scheduler (`kvstate check`).

* `model`: the abstract model derived from the spec (counts, not tokens), with symmetry reduction; `records`: its
  states, `AbstractState` records of `AbstractRequest` records, and its edges, `Edge` values labelled by an
  `Action`; `effects`: the views of its records that the real guards read, and the spec's effects on them;
* `invariants`: predicates keyed by spec invariant id, and which layer checks which invariant;
* `explore`: BFS, deadlock, no trap, weakly fair lassos (the fairness in its docstring), coverage;
* `refinement`: exhaustive exploration of the real `Scheduler` driven by `SimExecutor` under every executor timing,
  from its parts: `observed` (the scheduler under observation), `world` (a world and its fingerprint), `environment`
  (the executor's and the environment's choices), `abstraction` (a world's abstract state), `refinement_checks`
  (the checks on every transition and action) and `world_graph` (the worlds found, and the livelock search);
* `stepmatch`: step refinement, each scheduler action as a sequence of abstract actions;
* `runner`: the `kvstate check` code path, reports and counterexample regression tests;
* `simulate`: `kvstate check --simulate N`, seeded random walks over the refinement's actions, each checked as the
  exhaustive search checks it, with shrunk counterexamples (bounds too large to exhaust);
* `replay`: replaying a counterexample, as the generated regression tests do;
* `sweep`: swept bounds (`kvstate check --sweep NAME`) and their summary table;
* `sweep_runners`: where a sweep's configurations run (this process, a local Dask cluster, a Dask cluster);
* `bounds`: named bounds from `spec/bounds.toml`;
* `search`: what both searches share: their limits and shortest-path reconstruction;
* `trace`: `kvstate validate`, checking an engine's NDJSON trace (spec/TRACE.md) against the spec.
"""

from kvstate.checker.bounds import Bound, BoundsError, load_bounds, select_bounds
from kvstate.checker.effects import AbstractEffects
from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED, ModelResult, explore
from kvstate.checker.invariants import STATE_PREDICATES, STEP_PREDICATES, CheckerError, plan_invariants
from kvstate.checker.model import AbstractModel
from kvstate.checker.observed import ObservedScheduler
from kvstate.checker.records import AbstractRequest, AbstractState, Action, Edge
from kvstate.checker.refinement import Refinement
from kvstate.checker.replay import replay_abstract, replay_refinement
from kvstate.checker.runner import EXIT_CODES, BoundReport, check_bound, run_check
from kvstate.checker.simulate import SimulationResult, SimulationScope, Simulator, run_simulation, simulate_bound
from kvstate.checker.stepmatch import StepMatcher
from kvstate.checker.sweep import Sweep, SweepReport, load_sweeps, run_sweep, select_sweep
from kvstate.checker.trace import Divergence, TraceError, TraceReport, validate_trace

__all__ = [
    "EXIT_CODES",
    "HOLDS",
    "INCOMPLETE",
    "STATE_PREDICATES",
    "STEP_PREDICATES",
    "VIOLATED",
    "AbstractEffects",
    "AbstractModel",
    "AbstractRequest",
    "AbstractState",
    "Action",
    "Bound",
    "BoundReport",
    "BoundsError",
    "CheckerError",
    "Divergence",
    "Edge",
    "ModelResult",
    "ObservedScheduler",
    "Refinement",
    "SimulationResult",
    "SimulationScope",
    "Simulator",
    "StepMatcher",
    "Sweep",
    "SweepReport",
    "TraceError",
    "TraceReport",
    "check_bound",
    "explore",
    "load_bounds",
    "load_sweeps",
    "plan_invariants",
    "replay_abstract",
    "replay_refinement",
    "run_check",
    "run_simulation",
    "run_sweep",
    "select_bounds",
    "select_sweep",
    "simulate_bound",
    "validate_trace",
]
