"""The conformance kit: fuzz any scheduler against the lifecycle specification with a Hypothesis state machine.

The system under test is reached only through a small adapter (`SchedulerAdapter`), so one machine tests many
schedulers (zarr's stateful store test takes its store the same way). `ConformanceMachine` drives it with
Hypothesis rules and checks it against the spec after every rule and every step: the spec's edges, states and
invariants, and, for an adapter that reports its scheduling passes (`take_passes()`, see `PassReporting`), the
victim, promotion and admission policy it declares (`MachineConfig(policy=...)`, else the adapter's `policy`
attribute, else the spec's own `[policy]`; `kvstate.declared.preset` names vLLM's, SGLang's and TensorRT-LLM's).

A pass report's types are re-exported here (`ObservedPass`, `PassSnapshot`, `RequestSnapshot`, `PassRecord`,
`Victim`, `Promotion`, `Offload`, `Wait`, `PassOutput`, `Listed`), so an adapter imports them from one place.

Modules, one concept each:

* `adapter`: the `SchedulerAdapter` protocol, `PassReporting`, `USAGE_KEYS` and the checks of an adapter's contract;
* `kvstate_adapter`: `KVStateAdapter`, the adapter of this package's own `Scheduler`;
* `strategies`: `Submission` and the Hypothesis strategies the rules draw from;
* `spec_model`: what the machine derives from the spec, and the invariants it checks;
* `observed_edges`: which paths of spec edges a request's observed counters admit between two observations;
* `binding`: `MachineConfig`, and `MachineBinding`, what a machine class derives when it is defined;
* `machine`: `ConformanceMachine`, its rules and checks (listed in its docstring), and `conformance_machine`;
* `inferred_passes`: the pass of a step inferred from its state changes, for an adapter without `take_passes`;
* `shrink_progress`: the lines a failing run prints while Hypothesis shrinks it;
* `errors`: `LifecycleViolation` and `AdapterContractError`.

Hypothesis profiles (`kvstate.hypothesis_profiles`): importing this package registers `ci`, `thorough`, `dev`,
`long` and `fail-fast` and loads none, so no global Hypothesis setting changes, unless KVSTATE_HYPOTHESIS_PROFILE
names one; `pytest --hypothesis-profile=NAME` loads one by name (the package's pytest plugin registers them).
Machines bound to an adapter also run without a deadline whatever profile is loaded (a scheduler step may be slow),
and draw token ids below the adapter's `vocab_size` when it has one.

Usage: subclass `ConformanceMachine` and give it the adapter (and optionally a `MachineConfig`); add rules or
checks of your own in the subclass::

    from kvstate.config import SchedulerConfig
    from kvstate.testing import ConformanceMachine, KVStateAdapter, MachineConfig


    class Machine(ConformanceMachine):
        adapter_factory = staticmethod(
            lambda: KVStateAdapter(SchedulerConfig(gpu_blocks=16, host_blocks=16, block_size=4))
        )
        config = MachineConfig(max_new_tokens=8)


    TestMachine = Machine.TestCase

`ConformanceMachine.bind(factory, name="Machine", **config)` (or `conformance_machine(...)`, the same) makes such a
subclass in one call.
"""

from __future__ import annotations

from kvstate.declared import Listed, ObservedPass, PassOutput
from kvstate.hypothesis_profiles import PROFILE_ENV, PROFILES, load_profile, register_profiles
from kvstate.policy import Offload, PassRecord, PassSnapshot, Promotion, RequestSnapshot, Victim, Wait
from kvstate.testing.adapter import USAGE_KEYS, PassReporting, SchedulerAdapter, checked_usage
from kvstate.testing.binding import MachineBinding, MachineConfig
from kvstate.testing.errors import AdapterContractError, LifecycleViolation
from kvstate.testing.kvstate_adapter import KVStateAdapter
from kvstate.testing.machine import ConformanceMachine, conformance_machine
from kvstate.testing.strategies import Submission

__all__ = [
    "PROFILES",
    "PROFILE_ENV",
    "USAGE_KEYS",
    "AdapterContractError",
    "ConformanceMachine",
    "KVStateAdapter",
    "LifecycleViolation",
    "Listed",
    "MachineBinding",
    "MachineConfig",
    "ObservedPass",
    "Offload",
    "PassOutput",
    "PassRecord",
    "PassReporting",
    "PassSnapshot",
    "Promotion",
    "RequestSnapshot",
    "SchedulerAdapter",
    "Submission",
    "Victim",
    "Wait",
    "checked_usage",
    "conformance_machine",
    "load_profile",
    "register_profiles",
]

register_profiles()  # registered, not loaded: importing this package changes no Hypothesis setting
load_profile()  # unless KVSTATE_HYPOTHESIS_PROFILE asks for one
