"""A reusable Hypothesis conformance machine: fuzz any scheduler against the lifecycle specification.

The system under test is reached only through a small adapter (`SchedulerAdapter`), so one machine tests many
schedulers (zarr's stateful store test takes its store the same way). `ConformanceMachine` is a
`RuleBasedStateMachine` whose rules submit valid requests (one, or a burst of 2-4) and invalid ones,
step (a few iterations, or until some request reaches a given state), cancel a request in any state, make the
host tier disappear and reappear, and drain; after every rule (and after every step inside a rule) it
checks, with ids taken from the spec:

* every observed state is a spec state, every change between two observations of a request follows a path of
  spec edges (several events may fire in one step), and terminal states are absorbing;
* GEN-APPEND (outputs only grow), OUT-EQUIV (every output is a prefix of the unpressured reference output,
  and equals it once the request is done without having been cancelled);
* CONS-GPU / CONS-HOST (free + held + fenced = capacity), RES-STATE (blocks held in a tier never exceed what
  the requests in states resident in that tier can hold: leaked blocks are caught), NO-HOST-NO-SUSPEND;
* LIVE-REFUSE (an invalid or never-fitting submission is refused with a `ValueError` and changes nothing);
* the adapter's own `check_invariants()`;
* LIVE-DONE at teardown (and in the `drain` rule): with arrivals stopped, every request reaches a terminal
  state within `liveness_base + liveness_per_token * tokens` steps, and no block is held afterwards.

State names, the edge graph, terminal states, residencies and invariant statements all come from the spec
(the packaged one, `kvstate.spec.default_spec()`, or the one passed in). Failures print Hypothesis' replayable
step list, with rule arguments as plain values (`Submission(...)`, state names, ints, booleans): the printed
lines run as plain Python given the machine class and `Submission`.

Policy (victims, promotions, admissions): checked on every scheduling pass of an adapter that reports its passes
(`take_passes()`, see `PassReporting`), with `kvstate.policy.check_pass` (the model checker's step simulation),
against the policy the adapter declares (`MachineConfig(policy=...)`, else the adapter's `policy` attribute, else
the spec's own `[policy]`; `kvstate.declared.preset` names vLLM's, SGLang's and TensorRT-LLM's): VICTIM-TAIL,
VICTIM-ONCE, VICTIM-NOT-FINAL, PROMOTE-GATE, ADMIT-ORDER, ADMIT-HOLD, and WORK-CONSERVE where the policy has it.
An adapter without `take_passes` gets no policy check (`MachineBinding.checks_policy` is False).

Hypothesis profiles (`kvstate.hypothesis_profiles`): importing this module registers `ci`, `thorough`, `dev`,
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

import functools
import sys
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.errors import StopTest
from hypothesis.stateful import Bundle, MultipleResults, RuleBasedStateMachine, invariant, multiple, precondition, rule

from kvstate import roles
from kvstate.config import SchedulerConfig
from kvstate.declared import ObservedPass, preset, with_policy
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.hypothesis_profiles import PROFILE_ENV, PROFILES, load_profile, register_profiles
from kvstate.policy import check_pass, snapshot
from kvstate.pool import ceil_div
from kvstate.scheduler import Scheduler, SchedulingPass
from kvstate.sim import DEFAULT_VOCAB, SimExecutor, reference_output
from kvstate.spec import Policy, Spec, default_spec

__all__ = [
    "PROFILES",
    "PROFILE_ENV",
    "USAGE_KEYS",
    "AdapterContractError",
    "ConformanceMachine",
    "KVStateAdapter",
    "LifecycleViolation",
    "MachineBinding",
    "MachineConfig",
    "PassReporting",
    "SchedulerAdapter",
    "Submission",
    "conformance_machine",
    "load_profile",
]

# ---------------------------------------------------------------------------------------------- profiles
register_profiles()  # registered, not loaded: importing this module changes no Hypothesis setting
load_profile()  # unless KVSTATE_HYPOTHESIS_PROFILE asks for one

# Keys every `block_usage()` mapping must have.
USAGE_KEYS = (
    "gpu_capacity",
    "gpu_free",
    "gpu_held",
    "gpu_fenced",
    "host_capacity",
    "host_free",
    "host_held",
    "host_fenced",
)

# Spec invariants this machine checks; each must exist in the spec the machine is built from.
_CHECKED_INVARIANTS = (
    "CONS-GPU",
    "CONS-HOST",
    "RES-STATE",
    "NO-HOST-NO-SUSPEND",
    "GEN-APPEND",
    "OUT-EQUIV",
    "LIVE-DONE",
    "LIVE-REFUSE",
)
# ... and, for an adapter that reports its passes, the policy's (`kvstate.policy.check_pass` raises these)
_POLICY_INVARIANTS = (
    "VICTIM-TAIL",
    "VICTIM-ONCE",
    "VICTIM-NOT-FINAL",
    "PROMOTE-GATE",
    "ADMIT-ORDER",
    "ADMIT-HOLD",
    "WORK-CONSERVE",
)
# the RESET rules an OUT-EQUIV violation of a replayed request points to (`ConformanceMachine.replay_story`)
_RESET_INVARIANTS = ("RESET-PROMPT", "RESET-BUDGET", "RESET-CLEARED")


class LifecycleViolation(KVStateError, AssertionError):
    """An observed state, or a change between two observations, that the spec's state graph does not allow."""


class AdapterContractError(KVStateError, AssertionError):
    """The adapter broke the `SchedulerAdapter` protocol (missing ids or keys, wrong exception types)."""


# ------------------------------------------------------------------------------------------------ protocol
@runtime_checkable
class SchedulerAdapter(Protocol):
    """How the conformance machine drives a scheduler. Implement it for your engine to fuzz it against the spec.

    Attributes:
        gpu_token_capacity: the most tokens (prompt + max_new_tokens) one request may need to fit the GPU tier
            alone; the machine submits requests up to exactly this size and expects larger ones refused.
        block_size: tokens per KV block (used for edge-size prompts and block bounds).
        vocab_size (optional): token ids the scheduler accepts are below it; the machine draws prompt and stop
            tokens from that range (default `kvstate.sim.DEFAULT_VOCAB`, or `MachineConfig(vocab_size=...)`).

    Every method is called between iterations, never during one. Request ids are any hashable values the
    adapter picks; they must stay unique for the adapter's lifetime.
    """

    gpu_token_capacity: int
    block_size: int

    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> Hashable:
        """Queue a request and return its id. Refuse an invalid one (empty prompt, too large to ever fit the
        GPU tier) by raising a `ValueError` subclass, changing nothing."""

    def step(self) -> None:
        """Run one whole iteration: schedule, carry out migrations and complete their fences, forward pass,
        sampling, pipeline consensus. Requests may take several spec events in one step."""

    def cancel(self, request_id: Hashable) -> None:
        """Cancel a request. From a terminal state: raise `LookupError` or `ValueError`, or do nothing."""

    def states(self) -> Mapping[Hashable, str]:
        """The spec state name of every request ever submitted (terminal ones included)."""

    def outputs(self) -> Mapping[Hashable, Sequence[int]]:
        """The tokens every request ever submitted has generated so far."""

    def block_usage(self) -> Mapping[str, int]:
        """Block counts per tier, with at least the keys of `USAGE_KEYS` (host_capacity 0 = no host tier).
        `*_held` counts blocks owned by requests, `*_fenced` those reserved by copies in flight. A request holds
        at most ceil((prompt + max_new_tokens) / block_size) blocks, and only in the tier its state's residency
        names; held blocks beyond that bound are reported as leaked (RES-STATE)."""

    def check_invariants(self) -> None:
        """Optional deep self-check (raise on a violation); may do nothing."""

    def set_host_capacity(self, blocks: int) -> bool:
        """Make the host tier disappear (0) or reappear (`blocks` > 0); return False if not supported.
        Suspended requests lose their host copies when it disappears."""

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> list[int]:
        """The output of this request run alone with unlimited memory. Must be a pure function of its arguments
        (it is also called while generating test data, on a separate adapter instance)."""


class PassReporting(Protocol):
    """What an adapter adds to `SchedulerAdapter` to have its scheduling policy checked on every pass.

    Attributes:
        policy (optional): its engine's policy, a `kvstate.spec.Policy` or the name of a preset of
            `kvstate.declared.PRESETS`; without it (and without `MachineConfig(policy=...)`), the spec's own.
    """

    def take_passes(self) -> Sequence[ObservedPass]:
        """The scheduling passes the `step()` calls since the last call ran, oldest first, each as a
        `kvstate.declared.ObservedPass` (a snapshot of the active requests just before it, its victims and
        promotions in decision order, its output); forgets them."""


class KVStateAdapter:
    """`SchedulerAdapter` over this package's `Scheduler` driven by the slot-level `SimExecutor`.

    `scheduler_factory(config, spec)` and `executor_factory(scheduler, vocab, check_invariants=...)` let tests
    substitute subclasses (for instance deliberately broken ones). `deep_checks` turns the scheduler's own
    `check_invariants` on (inside every step and in `check_invariants()`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        spec: Spec | None = None,
        vocab: int = DEFAULT_VOCAB,
        deep_checks: bool = True,
        scheduler_factory: Callable[[SchedulerConfig, Spec], Scheduler] = Scheduler,
        executor_factory: Callable[..., SimExecutor] = SimExecutor,
    ) -> None:
        self.config = config
        self.vocab = vocab
        self.deep_checks = deep_checks
        self.scheduler = scheduler_factory(config, spec if spec is not None else default_spec())
        self.executor = executor_factory(self.scheduler, vocab, check_invariants=deep_checks)
        self.gpu_token_capacity = config.gpu_token_capacity
        self.block_size = config.block_size
        self.vocab_size = vocab
        self._passes: list[ObservedPass] = []
        self._schedule = self.scheduler.schedule
        self.scheduler.schedule = self._observed_schedule  # type: ignore[method-assign]

    def _observed_schedule(self):
        """The scheduler's own pass, kept with the snapshot taken just before it (`take_passes`)."""
        before = snapshot(self.scheduler)
        out = self._schedule()
        done = cast("SchedulingPass", self.scheduler.last_pass)  # schedule() keeps every pass it ran there
        self._passes.append(ObservedPass(before, done.record, out))
        return out

    def take_passes(self) -> list[ObservedPass]:
        passes, self._passes = self._passes, []
        return passes

    def __repr__(self) -> str:
        return f"KVStateAdapter({self.config!r})"

    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Hashable:
        return self.scheduler.submit(list(prompt), max_new_tokens, stop_token_ids=stop_token_ids).request_id

    def step(self) -> None:
        self.executor.step()

    def cancel(self, request_id: Hashable) -> None:
        self.scheduler.cancel(request_id)

    def states(self) -> dict[Hashable, str]:
        s = self.scheduler
        return {rid: r.state for table in (s.finished, s.requests) for rid, r in table.items()}

    def outputs(self) -> dict[Hashable, list[int]]:
        s = self.scheduler
        return {rid: list(r.generated) for table in (s.finished, s.requests) for rid, r in table.items()}

    def block_usage(self) -> dict[str, int]:
        return self.scheduler.pool.usage()

    def check_invariants(self) -> None:
        if self.deep_checks:
            self.scheduler.check_invariants()

    def set_host_capacity(self, blocks: int) -> bool:
        self.scheduler.set_host_capacity(blocks)
        self.executor.sync_host_tier()
        return True

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        return reference_output(prompt, max_new_tokens, stop_token_ids, self.vocab)


# ------------------------------------------------------------------------------------------- rule values
@dataclass(frozen=True, slots=True)
class Submission:
    """The arguments of one `submit` call, printed as-is in failing step lists."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Its worst case: prompt plus every token it may generate."""
        return len(self.prompt) + self.max_new_tokens

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """One line in Hypothesis' step lists (its pretty printer would put each prompt token on a line)."""
        printer.text(repr(self))


def _valid_submissions(
    capacity: int,
    block_size: int,
    vocab: int,
    max_new: int,
    max_stops: int,
    reference: Callable[[Sequence[int], int, Sequence[int]], list[int]],
) -> st.SearchStrategy:
    """Requests that fit the GPU tier alone, with edge sizes over-represented: one-token prompts, exactly one
    block, one block plus one token, and the largest prompt that fits; max_new_tokens 1 often; stop tokens
    that are random or taken from the reference output (so requests stop early); prompts that begin with a stem
    common to all requests (0, 1, 2, ... modulo the vocabulary), so that prefix caches get hits."""

    @st.composite
    def build(draw: st.DrawFn) -> Submission:
        new = draw(st.integers(1, max_new) | st.integers(1, max_new) | st.just(1))
        longest = capacity - new
        edges = sorted({n for n in (1, block_size, block_size + 1, longest) if 1 <= n <= longest})
        length = draw(st.sampled_from(edges) | st.integers(1, longest) | st.integers(1, min(longest, 2 * block_size)))
        stem = draw(st.just(0) | st.integers(0, length))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=length - stem, max_size=length - stem))
        prompt = tuple(i % vocab for i in range(stem)) + tuple(tail)
        stops = draw(st.lists(st.integers(0, vocab - 1), max_size=max_stops, unique=True))
        stop_at = draw(st.none() | st.none() | st.integers(0, new - 1))
        if stop_at is not None:
            token = reference(prompt, new, ())[stop_at]
            if token not in stops:
                stops.append(token)
        return Submission(prompt, new, tuple(stops))

    return build()


def _invalid_submissions(capacity: int, vocab: int) -> st.SearchStrategy:
    """Requests every scheduler must refuse: an empty prompt, or prompt + max_new_tokens over the capacity."""
    empty = st.builds(Submission, st.just(()), st.integers(1, capacity))

    @st.composite
    def too_large(draw: st.DrawFn) -> Submission:
        length = draw(st.integers(1, capacity))
        new = capacity - length + draw(st.integers(1, 3))
        prompt = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length)))
        return Submission(prompt, new)

    return st.one_of(empty, too_large())


# ------------------------------------------------------------------------------------------ spec model
class _SpecModel:
    """What the machine derives from the spec: states, the reachability closure of its edges, residencies,
    the destinations of the cancel event, and the invariants it checks."""

    def __init__(self, spec: Spec, cancel_event: str) -> None:
        self.spec = spec
        self.states = frozenset(s.name for s in spec.states)
        self.terminal = frozenset(spec.terminal_states)
        self.state_names = tuple(s.name for s in spec.states)
        self.live_states = tuple(s.name for s in spec.states if not s.terminal)
        if not self.terminal:
            raise ValueError(f"spec {spec.name!r} has no terminal state; LIVE-DONE needs one")
        self.reach = {s: spec.reachable_from(s) for s in self.states}
        self.initial_reach = self.reach[spec.initial]
        self.successors = {s: sorted(spec.successors.get(s, ())) for s in self.states}
        self.gpu_states = frozenset(spec.states_with_residency("gpu"))
        self.host_states = frozenset(spec.states_with_residency("host"))
        if cancel_event not in spec.event_by_name:
            raise ValueError(
                f"spec {spec.name!r} has no event {cancel_event!r}; pass cancel_event= naming the "
                f"event that cancels a request (events: {', '.join(spec.event_by_name)})"
            )
        self.cancel_event = cancel_event
        self.cancel_dests: dict[str, frozenset[str]] = {}
        for t in spec.event_by_name[cancel_event].transitions:
            self.cancel_dests[t.source] = self.cancel_dests.get(t.source, frozenset()) | {t.dest}
        by_id = {inv.id: inv for inv in spec.invariants}
        missing = [i for i in _CHECKED_INVARIANTS if i not in by_id]
        if missing:
            raise ValueError(
                f"spec {spec.name!r} ({spec.source}) lacks invariants {', '.join(missing)} that the "
                "conformance machine checks; add them to the spec or use the packaged one"
            )
        self.invariants = by_id

    def require(self, ids: Sequence[str], why: str) -> None:
        """Refuse a spec that lacks any of the invariants `ids` (`why`: what checks them)."""
        missing = [i for i in ids if i not in self.invariants]
        if missing:
            raise ValueError(
                f"spec {self.spec.name!r} ({self.spec.source}) lacks invariants {', '.join(missing)} that {why} "
                "checks; add them to the spec or use the packaged one"
            )

    def violation(self, invariant_id: str, detail: str) -> InvariantViolation:
        statement = self.invariants[invariant_id].statement
        return InvariantViolation(invariant_id, f"{detail}. [{invariant_id}: {statement}]")


def _note(text: str) -> None:
    """`hypothesis.note`, except outside a test (a printed step list replayed as plain Python)."""
    if currently_in_test_context():
        note(text)


def _guarded(method: Callable) -> Callable:
    """Mark the machine unhealthy while `method` runs; it stays so if `method` raises (see `teardown`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self.healthy = False
        result = method(self, *args, **kwargs)
        self.healthy = True
        return result

    return run


# ------------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class MachineConfig:
    """How a conformance machine drives its adapter; every field has a default.

    `spec`: the specification held against (default: the packaged one). `vocab_size`: token ids are drawn below
    it (default: the adapter's `vocab_size` attribute, else `kvstate.sim.DEFAULT_VOCAB`). `max_new_tokens`: the
    most tokens one request may generate (default: half the GPU token capacity). `max_stop_tokens`: stop tokens
    per request. `max_steps_per_rule`: iterations one `step` rule runs at most. `liveness_base`,
    `liveness_per_token`: LIVE-DONE's bound once arrivals stop, in steps (base + per_token x the tokens of the
    unfinished requests). `cancel_event`: the spec event that cancels a request. `policy`: the scheduling policy
    its passes are checked against, a `kvstate.spec.Policy` or a preset name of `kvstate.declared.PRESETS` (default:
    the adapter's `policy` attribute, else the spec's `[policy]`); checked only if the adapter has `take_passes` and
    `check_policy` is True (False: a test of another property that a policy check would catch first).
    """

    spec: Spec | None = None
    vocab_size: int | None = None
    max_new_tokens: int | None = None
    max_stop_tokens: int = 2
    max_steps_per_rule: int = 8
    liveness_base: int = 50
    liveness_per_token: int = 20
    cancel_event: str = "cancel"
    policy: Policy | str | None = None
    check_policy: bool = True


_ADAPTER_ATTRIBUTES = ("gpu_token_capacity", "block_size")
_ADAPTER_METHODS = (
    "submit",
    "step",
    "cancel",
    "states",
    "outputs",
    "block_usage",
    "check_invariants",
    "set_host_capacity",
    "reference",
)


def _contract_gaps(adapter: object) -> list[str]:
    """What `adapter` lacks of `SchedulerAdapter`: each missing member, and each method that is not callable."""
    gaps = [f"{m} (missing)" for m in (*_ADAPTER_ATTRIBUTES, *_ADAPTER_METHODS) if not hasattr(adapter, m)]
    return gaps + [
        f"{m} (is {type(getattr(adapter, m)).__name__}, not a method)"
        for m in _ADAPTER_METHODS
        if hasattr(adapter, m) and not callable(getattr(adapter, m))
    ]


def checked_usage(adapter: SchedulerAdapter) -> Mapping[str, int]:
    """`adapter.block_usage()`, refused with an `AdapterContractError` naming each `USAGE_KEYS` key it lacks."""
    usage = adapter.block_usage()
    if not isinstance(usage, Mapping):
        raise AdapterContractError(
            f"{type(adapter).__name__}.block_usage() returned {type(usage).__name__}; it must return a mapping "
            f"with the keys {', '.join(USAGE_KEYS)}"
        )
    missing = [k for k in USAGE_KEYS if k not in usage]
    if missing:
        raise AdapterContractError(
            f"{type(adapter).__name__}.block_usage() lacks the key(s) {', '.join(map(repr, missing))}; it must "
            f"report every one of {', '.join(USAGE_KEYS)} (host_capacity 0: no host tier)"
        )
    return usage


def _declared_policy(spec: Spec, config: MachineConfig, adapter: object) -> tuple[str, Spec] | None:
    """The name of the policy `adapter`'s passes are checked against and the spec that carries it, or None when the
    adapter reports no passes (see `MachineConfig.policy`)."""
    declared = config.policy if config.policy is not None else getattr(adapter, "policy", None)
    if not config.check_policy:
        return None
    if not callable(getattr(adapter, "take_passes", None)):
        if declared is not None:
            raise AdapterContractError(
                f"{type(adapter).__name__} declares a policy ({declared!r}) but has no take_passes() to report its "
                "scheduling passes; implement it (kvstate.testing.PassReporting) or declare no policy"
            )
        return None
    if declared is None:
        return "the spec's [policy]", spec
    if isinstance(declared, str):
        return f"preset {declared!r}", with_policy(spec, preset(declared, spec))
    if not isinstance(declared, Policy):
        raise AdapterContractError(
            f"policy {declared!r} is neither a kvstate.spec.Policy nor a preset name of kvstate.declared.PRESETS"
        )
    return "the declared policy", with_policy(spec, declared)


@dataclass(frozen=True)
class MachineBinding:
    """What a machine class derives once, when it is defined, from its `MachineConfig` and a probe adapter: the
    spec model, the adapter's sizes and the strategies the rules draw from.

    Invariants: valid submissions fit the probed GPU token capacity alone and invalid ones never do; token ids
    are below the vocabulary; the spec has every invariant the machine checks and the configured cancel event;
    `policy_spec` is the spec with the declared policy in place of its `[policy]` (None: the adapter reports no
    passes, and no policy is checked).
    """

    config: MachineConfig
    model: _SpecModel
    adapter_name: str
    capacity: int
    block_size: int
    initial_host: int
    valid: st.SearchStrategy
    invalid: st.SearchStrategy
    steps: st.SearchStrategy
    live_states: st.SearchStrategy
    any_state: st.SearchStrategy
    policy_name: str = ""
    policy_spec: Spec | None = None

    @property
    def checks_policy(self) -> bool:
        return self.policy_spec is not None

    @classmethod
    def probe(cls, adapter_factory: Callable[[], SchedulerAdapter], config: MachineConfig) -> MachineBinding:
        """Check the spec, call `adapter_factory()` once and derive the binding from what that adapter reports."""
        model = _SpecModel(config.spec if config.spec is not None else default_spec(), config.cancel_event)
        probe = adapter_factory()
        gaps = _contract_gaps(probe)
        if gaps:
            raise TypeError(
                f"adapter_factory() returned {type(probe).__name__}, which lacks {', '.join(gaps)} "
                "of kvstate.testing.SchedulerAdapter; implement them"
            )
        declared = _declared_policy(model.spec, config, probe)
        if declared is not None:
            model.require(_POLICY_INVARIANTS, "the policy check (kvstate.policy.check_pass)")
        capacity, block_size = int(probe.gpu_token_capacity), int(probe.block_size)
        if capacity < 2 or block_size < 1:
            raise ValueError(
                f"gpu_token_capacity={capacity} and block_size={block_size}: the GPU tier must fit at "
                "least a one-token prompt plus one new token"
            )
        vocab = config.vocab_size
        if vocab is None:
            vocab = int(getattr(probe, "vocab_size", DEFAULT_VOCAB))
        if vocab < 1:
            raise ValueError(f"vocab_size={vocab}: token ids are drawn from range(vocab_size), so it must be >= 1")
        max_new = max(1, min(config.max_new_tokens or capacity // 2, capacity - 1))
        return cls(
            config,
            model,
            type(probe).__name__,
            capacity,
            block_size,
            int(checked_usage(probe)["host_capacity"]),
            valid=_valid_submissions(capacity, block_size, vocab, max_new, config.max_stop_tokens, probe.reference),
            invalid=_invalid_submissions(capacity, vocab),
            steps=st.integers(1, max(1, config.max_steps_per_rule)),
            live_states=st.sampled_from(model.live_states),
            any_state=st.sampled_from(model.state_names),
            policy_name=declared[0] if declared else "",
            policy_spec=declared[1] if declared else None,
        )


def _drawn(strategy: str) -> st.SearchStrategy:
    """Values of the strategy named `strategy` in the binding of the machine that runs the rule.

    Rules are declared once, on `ConformanceMachine`, while each subclass binds its own adapter, so a rule's
    strategy is looked up on the running machine (`st.runner()`, which draws nothing: a failing case's data and
    its printed step list are what the bound strategy alone would give)."""
    return st.runner().flatmap(lambda machine: getattr(machine.binding, strategy))


# ------------------------------------------------------------------------------------------------ machine
class ConformanceMachine(RuleBasedStateMachine):
    """Drives the scheduler behind an adapter with Hypothesis rules and checks it against the spec after every
    rule and every step (the checks are listed in the module docstring).

    Subclass it and set `adapter_factory` (a callable with no arguments that returns a `SchedulerAdapter`; it is
    called once when the class is defined, for a probe, and once per test case) and, optionally, `config` (a
    `MachineConfig`); or call `ConformanceMachine.bind(factory, name=..., **config)`. A subclass may add rules,
    invariants or checks (extend `observe`, or one of the `check_*` methods it calls) like any Hypothesis machine.

    Invariants: `binding` is derived once per class from its `adapter_factory` and `config` (a subclass that
    sets neither inherits its parent's); only a bound class is instantiated; `last_states` and `last_outputs`
    are the latest observation, which passed every check; `healthy` is False while a rule runs and after one
    raised, and then teardown checks nothing more.
    """

    adapter_factory: ClassVar[Callable[[], SchedulerAdapter] | None] = None
    config: ClassVar[MachineConfig] = MachineConfig()
    binding: ClassVar[MachineBinding | None] = None
    requests = Bundle("requests")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "binding" not in own and ("adapter_factory" in own or "config" in own) and cls.adapter_factory:
            cls.binding = MachineBinding.probe(cls.adapter_factory, cls.config)
        if cls.binding is not None:
            cls.TestCase.settings = settings(deadline=None)  # the loaded profile, without a per-example deadline

    @classmethod
    def bind(
        cls, adapter_factory: Callable[[], SchedulerAdapter], *, name: str | None = None, **config: Any
    ) -> type[ConformanceMachine]:
        """A subclass of `cls` driving `adapter_factory()` with `MachineConfig(**config)`, named `name` (give it
        the name you bind the class to, so that printed step lists replay as written; default
        `<adapter class>Conformance`). Use `.TestCase` for unittest/pytest."""
        binding = MachineBinding.probe(adapter_factory, MachineConfig(**config))
        name = name or f"{binding.adapter_name}Conformance"
        namespace = {
            "adapter_factory": staticmethod(adapter_factory),
            "config": binding.config,
            "binding": binding,
            "__qualname__": name,
            "__module__": __name__,  # as a class statement here would have it (types.new_class would say "types")
        }
        return cast(
            "type[ConformanceMachine]", types.new_class(name, (cls,), exec_body=lambda ns: ns.update(namespace))
        )

    def __init__(self) -> None:
        binding, factory = type(self).binding, type(self).adapter_factory
        if binding is None or factory is None:
            raise TypeError(
                f"{type(self).__name__} has no adapter to drive: subclass ConformanceMachine and set "
                "adapter_factory, or use ConformanceMachine.bind(factory)"
            )
        super().__init__()
        self.probed: MachineBinding = binding  # the class's binding, known here to be set
        self.adapter = factory()
        self.submitted: dict[Hashable, Submission] = {}
        self.expected: dict[Hashable, list[int]] = {}
        self.cancelled: set[Hashable] = set()
        self.last_states: dict[Hashable, str] = {}
        self.last_outputs: dict[Hashable, list[int]] = {}
        self.host_resizable = self.probed.initial_host > 0
        self.steps_taken = 0
        self.passes_checked = 0
        self.visits: dict[Hashable, list[tuple[str, int]]] = {}  # each request's states, with its output length then
        self.healthy = True

    @property
    def model(self) -> _SpecModel:
        return self.probed.model

    # ------------------------------------------------------------------------------------------- rules
    @rule(target=requests, request=_drawn("valid"))
    @_guarded
    def submit(self, request: Submission) -> Hashable:
        return self._submit(request)

    @rule(target=requests, batch=st.lists(_drawn("valid"), min_size=2, max_size=4))
    @_guarded
    def submit_many(self, batch: list[Submission]) -> MultipleResults:
        """Several arrivals between two steps: what builds memory pressure."""
        return multiple(*(self._submit(request) for request in batch))

    @rule(request=_drawn("invalid"))
    @_guarded
    def submit_invalid(self, request: Submission) -> None:
        before = self._snapshot()
        try:
            rid = self.adapter.submit(list(request.prompt), request.max_new_tokens, list(request.stop_token_ids))
        except ValueError:
            pass
        except Exception as err:
            raise AdapterContractError(
                f"refusing {request} raised {type(err).__name__}: {err}; refusals must raise a ValueError subclass"
            ) from err
        else:
            why = (
                "an empty prompt"
                if not request.prompt
                else (f"{request.num_tokens} tokens, over the GPU token capacity {self.probed.capacity}")
            )
            raise self.model.violation("LIVE-REFUSE", f"{request} has {why} but was accepted as {rid!r}")
        if self._snapshot() != before:
            raise self.model.violation(
                "LIVE-REFUSE",
                f"refusing {request} changed request states, outputs or block usage; a refusal must change nothing",
            )

    @rule(iterations=_drawn("steps"))
    @_guarded
    def step(self, iterations: int) -> None:
        for _ in range(iterations):
            self._step()

    @rule(in_state=_drawn("live_states"))
    @_guarded
    def step_until(self, in_state: str) -> None:
        """Step until some request is in `in_state` (at most 4 x max_steps_per_rule steps), to set up cancels and
        host-tier changes in rare states."""
        terminal = self.model.terminal
        for _ in range(4 * self.probed.config.max_steps_per_rule):
            if in_state in self.last_states.values() or all(s in terminal for s in self.last_states.values()):
                return
            self._step()

    @precondition(lambda self: bool(self.last_states))
    @rule(in_state=_drawn("any_state"), nth=st.integers(0, 7))
    @_guarded
    def cancel(self, in_state: str, nth: int) -> None:
        """Cancel the `nth` (modulo) request in state `in_state` (terminal states included: cancelling a finished
        request must change nothing). If no request is in it, cancel the `nth` of those in the least populated
        non-terminal state present, so that cancels reach short-lived states whenever they occur."""
        groups: dict[str, list[Hashable]] = {}
        for rid, s in self.last_states.items():
            groups.setdefault(s, []).append(rid)
        live = [ids for s, ids in groups.items() if s not in self.model.terminal]
        candidates = groups.get(in_state) or (min(live, key=len) if live else next(iter(groups.values())))
        rid = candidates[nth % len(candidates)]
        if in_state not in groups:
            _note(f"# cancel: no request is {in_state}; fell back to request {rid!r} ({self.last_states[rid]})")
        self._cancel(rid)

    @precondition(lambda self: self.host_resizable)
    @rule(present=st.booleans())
    @_guarded
    def host_tier(self, present: bool) -> None:
        target = self.probed.initial_host if present else 0
        if int(self.adapter.block_usage()["host_capacity"]) == target:
            return
        if self.adapter.set_host_capacity(target) is False:
            self.host_resizable = False
            return
        usage = self.adapter.block_usage()
        if usage["host_capacity"] != target:
            raise AdapterContractError(
                f"set_host_capacity({target}) returned, but block_usage() reports "
                f"host_capacity={usage['host_capacity']}"
            )
        self.observe()

    @precondition(lambda self: any(s not in self.model.terminal for s in self.last_states.values()))
    @rule()
    @_guarded
    def drain(self) -> None:
        self._drain("drain")

    @invariant()
    @_guarded
    def conforms(self) -> None:
        self.observe()

    def teardown(self) -> None:
        # Check liveness only after a run whose every rule and invariant passed: never mask the failure that
        # ended the run, nor step a run that Hypothesis abandoned.
        if self.healthy and not isinstance(sys.exc_info()[1], StopTest):
            self._drain("teardown")
            usage = self.adapter.block_usage()
            if usage["gpu_held"] or usage["host_held"]:
                raise self.model.violation(
                    "RES-STATE",
                    f"every request is done, yet {usage['gpu_held']} GPU and "
                    f"{usage['host_held']} host blocks are held (usage {dict(usage)})",
                )

    # ------------------------------------------------------------------------------------------ actions
    def _submit(self, request: Submission) -> Hashable:
        try:
            rid = self.adapter.submit(list(request.prompt), request.max_new_tokens, list(request.stop_token_ids))
        except ValueError as err:
            raise self.model.violation(
                "LIVE-DONE",
                f"{request} fits the GPU tier alone ({request.num_tokens} <= "
                f"{self.probed.capacity} tokens) but was refused: {err}",
            ) from err
        if rid in self.submitted:
            raise AdapterContractError(
                f"submit returned id {rid!r}, already used by {self.submitted[rid]}; request ids must be unique"
            )
        self.submitted[rid] = request
        self.expected[rid] = list(
            self.adapter.reference(request.prompt, request.max_new_tokens, request.stop_token_ids)
        )
        _note(f"# submit -> request id {rid!r}")
        self.observe()
        return rid

    def _step(self) -> None:
        self.adapter.step()
        self.steps_taken += 1
        self.check_passes()
        self.observe()

    def check_passes(self) -> None:
        """Every pass the step ran, against the declared policy (`kvstate.policy.check_pass`)."""
        policy_spec = self.probed.policy_spec
        if policy_spec is None:
            return
        for observed in cast("PassReporting", self.adapter).take_passes():  # bound with a policy: it has them
            try:
                check_pass(policy_spec, observed.before, observed.record, observed.output)
            except InvariantViolation as err:
                detail = str(err).removeprefix(f"invariant {err.invariant_id} violated: ")
                raise self.model.violation(
                    err.invariant_id, f"{detail} (pass {self.passes_checked}; policy: {self.probed.policy_name})"
                ) from err
            self.passes_checked += 1

    def _cancel(self, rid: Hashable) -> None:
        before = self.last_states[rid]
        allowed, event = self.model.cancel_dests.get(before), self.model.cancel_event
        try:
            self.adapter.cancel(rid)
        except (LookupError, ValueError) as err:
            if allowed is not None:
                raise LifecycleViolation(
                    f"cancel({rid!r}) from state {before!r} raised {type(err).__name__}: {err}; the spec's "
                    f"{event!r} event has an edge from {before!r} to {sorted(allowed)}"
                ) from err
        after = self.adapter.states()[rid]
        if allowed is None:
            if after != before:
                raise LifecycleViolation(
                    f"cancel({rid!r}) moved it from {before!r} to {after!r}; the spec's "
                    f"{event!r} event has no edge from {before!r}"
                )
        else:
            if after not in allowed:
                raise LifecycleViolation(
                    f"cancel({rid!r}) moved it from {before!r} to {after!r}; the spec's "
                    f"{event!r} event goes from {before!r} to {sorted(allowed)}"
                )
            self.cancelled.add(rid)
        _note(f"# cancel {rid!r}: {before} -> {after}")
        self.observe()

    def _drain(self, where: str) -> None:
        terminal, config = self.model.terminal, self.probed.config
        active = [rid for rid, s in self.last_states.items() if s not in terminal]
        tokens = sum(self.submitted[rid].num_tokens for rid in active)
        bound = config.liveness_base + config.liveness_per_token * tokens
        for _ in range(bound):
            if all(s in terminal for s in self.last_states.values()):
                return
            self._step()
        stuck = {rid: s for rid, s in self.last_states.items() if s not in terminal}
        if stuck:
            listing = ", ".join(
                f"{rid!r}: {s} ({len(self.last_outputs[rid])}/{self.submitted[rid].max_new_tokens} tokens)"
                for rid, s in list(stuck.items())[:12]
            )
            raise self.model.violation(
                "LIVE-DONE",
                f"{where}: arrivals stopped, {bound} steps later (bound {config.liveness_base} + "
                f"{config.liveness_per_token} x {tokens} tokens) {len(stuck)} request(s) are not done: {listing}; "
                f"usage {dict(self.adapter.block_usage())}",
            )

    def _snapshot(self) -> tuple:
        return (
            dict(self.adapter.states()),
            {k: list(v) for k, v in self.adapter.outputs().items()},
            dict(self.adapter.block_usage()),
        )

    # ------------------------------------------------------------------------------------------- checks
    def observe(self) -> None:
        """Read the adapter's states, outputs and block usage, check them all, and keep them as the latest."""
        states = dict(self.adapter.states())
        outputs = {rid: list(out) for rid, out in self.adapter.outputs().items()}
        usage = self.adapter.block_usage()
        self.check_ids(states, outputs, usage)
        for rid, state in states.items():
            self.check_state(rid, self.last_states.get(rid), state)
        for rid, out in outputs.items():
            self.check_output(rid, self.last_outputs.get(rid), out, states[rid])
        self.check_blocks(states, usage)
        self.adapter.check_invariants()
        for rid, state in states.items():
            if self.last_states.get(rid) != state:
                self.visits.setdefault(rid, []).append((state, len(self.last_outputs.get(rid, ()))))
        self.last_states, self.last_outputs = states, outputs

    def check_ids(self, states: dict, outputs: dict, usage: Mapping[str, int]) -> None:
        """The adapter reports exactly the submitted requests, and every `USAGE_KEYS` key."""
        if states.keys() != self.submitted.keys() or outputs.keys() != self.submitted.keys():
            raise AdapterContractError(
                f"states() has ids {sorted(map(repr, states))} and outputs() {sorted(map(repr, outputs))}; both "
                f"must name exactly the submitted requests {sorted(map(repr, self.submitted))}"
            )
        missing = [k for k in USAGE_KEYS if k not in usage]
        if missing:
            raise AdapterContractError(f"block_usage() lacks {', '.join(missing)}; it must report {USAGE_KEYS}")

    def check_state(self, rid: Hashable, old: str | None, new: str) -> None:
        """`new` is a spec state that a path of spec edges leads to from `old` (terminal states absorb)."""
        model = self.model
        if new not in model.states:
            raise LifecycleViolation(
                f"request {rid!r} is in state {new!r}, which spec {model.spec.name!r} does "
                f"not define (states: {', '.join(sorted(model.states))})"
            )
        if old is None:
            if new not in model.initial_reach:
                raise LifecycleViolation(
                    f"new request {rid!r} is in {new!r}, not reachable from the spec's "
                    f"initial state {model.spec.initial!r}"
                )
        elif old != new:
            if old in model.terminal:
                raise LifecycleViolation(
                    f"request {rid!r} left terminal state {old!r} for {new!r}; terminal states are absorbing"
                )
            if new not in model.reach[old]:
                raise LifecycleViolation(
                    f"request {rid!r} went from {old!r} to {new!r}, but no path of spec "
                    f"edges leads there (edges from {old!r}: {model.successors[old]})"
                )

    def check_output(self, rid: Hashable, old: list[int] | None, out: list[int], state: str) -> None:
        """GEN-APPEND and OUT-EQUIV for one request's output."""
        model = self.model
        if old is not None and out[: len(old)] != old:
            raise model.violation("GEN-APPEND", f"request {rid!r} ({state}) had generated {old}, now {out}")
        expected = self.expected[rid]
        if out != expected[: len(out)]:
            raise model.violation(
                "OUT-EQUIV",
                f"request {rid!r} ({state}) generated {out}, which departs from "
                f"its unpressured reference {expected} ({self.submitted[rid]}); {self.replay_story(rid, out, state)}",
            )
        if state in model.terminal and rid not in self.cancelled and out != expected:
            raise model.violation(
                "OUT-EQUIV",
                f"request {rid!r} ended ({state}) with {out}, but its unpressured reference is {expected} "
                f"({self.submitted[rid]}); {self.replay_story(rid, out, state)}",
            )

    def replay_story(self, rid: Hashable, out: list[int], state: str) -> str:
        """Whether request `rid` was replayed, and which RESET rule its departure from the reference points to."""
        spec, expected = self.model.spec, self.expected[rid]
        visits = [*self.visits.get(rid, []), (state, len(self.last_outputs.get(rid, ())))]
        dropped = {spec.role(roles.DROPPED), spec.role(roles.PENDING_RESET)}
        pauses = sorted({n for s, n in visits if s in dropped})
        statement = {i: self.model.invariants[i].statement for i in _RESET_INVARIANTS if i in self.model.invariants}
        departs = next((i for i, (a, b) in enumerate(zip(out, expected, strict=False)) if a != b), None)
        if not pauses:
            resumed = any(s in self.model.host_states for s, _ in visits)
            where = "it was suspended and resumed, so the KV it read back from the host tier" if resumed else "the KV"
            return f"it was never recompute-paused or replayed, so no RESET rule applies: {where} was wrong"
        told = f"it was recompute-paused after {', '.join(map(str, pauses))} generated token(s) and replayed"
        if departs is None:
            return (
                f"{told}; it stopped after {len(out)} of the reference's {len(expected)} tokens: see RESET-BUDGET "
                f"({statement.get('RESET-BUDGET', '')})"
            )
        if departs in pauses:
            return (
                f"{told}; its output departs at token {departs}, the first after a replay: see RESET-PROMPT "
                f"({statement.get('RESET-PROMPT', '')})"
            )
        return (
            f"{told}; its output departs at token {departs}, later than any replay: see RESET-CLEARED "
            f"({statement.get('RESET-CLEARED', '')})"
        )

    def check_blocks(self, states: dict[Hashable, str], usage: Mapping[str, int]) -> None:
        """CONS-GPU, CONS-HOST, RES-STATE and NO-HOST-NO-SUSPEND on one observation."""
        model, block_size = self.model, self.probed.block_size
        for tier, inv, resident in (("gpu", "CONS-GPU", model.gpu_states), ("host", "CONS-HOST", model.host_states)):
            cap, free, held, fenced = (int(usage[f"{tier}_{k}"]) for k in ("capacity", "free", "held", "fenced"))
            if min(cap, free, held, fenced) < 0 or free + held + fenced != cap:
                raise model.violation(
                    inv, f"{tier} tier: free {free} + held {held} + fenced {fenced} != capacity {cap}"
                )
            holders = [rid for rid, s in states.items() if s in resident]
            bound = sum(ceil_div(self.submitted[rid].num_tokens, block_size) for rid in holders)
            if held > bound:
                raise model.violation(
                    "RES-STATE",
                    f"{tier} tier holds {held} blocks, but the {len(holders)} "
                    f"request(s) in {tier}-resident states can hold at most {bound}; blocks "
                    f"are leaked by requests in other states (states {states})",
                )
        if int(usage["host_capacity"]) == 0:
            suspended = sorted((repr(rid) for rid, s in states.items() if s in model.host_states))
            if suspended:
                raise model.violation(
                    "NO-HOST-NO-SUSPEND", f"the host tier is gone, yet requests {suspended} are in host-resident states"
                )


def conformance_machine(
    adapter_factory: Callable[[], SchedulerAdapter], *, name: str | None = None, **config: Any
) -> type[ConformanceMachine]:
    """`ConformanceMachine.bind(adapter_factory, name=name, **config)`: kept for existing callers."""
    return ConformanceMachine.bind(adapter_factory, name=name, **config)
