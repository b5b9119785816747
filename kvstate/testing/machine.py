"""`ConformanceMachine`: the Hypothesis state machine that drives a scheduler through its adapter and checks it
against the spec; `conformance_machine` binds one to an adapter in one call.

Its rules submit valid requests (one, or a burst of 2-4) and invalid ones, step (a few iterations, or until some
request reaches a given state), cancel a request in any state, make the host tier disappear and reappear, and drain;
after every rule (and after every step inside a rule) it checks, with ids taken from the spec:

* every observed state is a spec state, every change between two observations of a request follows a path of
  spec edges whose every guard its observed counters leave possible (SPEC-EDGE; several events may fire in one
  step: `kvstate.testing.observed_edges`), each event a reported pass lists is an edge from the request's state
  just before it, and terminal states are absorbing;
* GEN-APPEND (outputs only grow), OUT-EQUIV (every output is a prefix of the unpressured reference output,
  and equals it once the request is done without having been cancelled);
* CONS-GPU / CONS-HOST (free + held + fenced = capacity), RES-STATE (blocks held in a tier never exceed what
  the requests in states whose residency allows that tier can hold: a suspended request may hold GPU blocks, host
  blocks only a held state's requests; leaked blocks are caught), NO-HOST-NO-OFFLOAD (no host blocks without a
  host tier);
* LIVE-REFUSE (an invalid or never-fitting submission is refused with a `ValueError` and changes nothing);
* the adapter's own `check_invariants()`;
* for an adapter that reports its passes, every pass against the policy it declares (`kvstate.policy.check_pass`);
  for one that does not, the pass inferred from each step's state changes against the declared policy's victim and
  admission rules (`kvstate.policy.check_observable`), where the observation decides its victim exclusions;
* LIVE-DONE at teardown (and in the `drain` rule): with arrivals stopped, every request reaches a terminal
  state within `liveness_base + liveness_per_token * tokens` steps, and no block is held afterwards.

Failures print Hypothesis' replayable step list, with rule arguments as plain values (`Submission(...)`, state
names, ints, booleans): the printed lines run as plain Python given the machine class and `Submission`.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar, cast

from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.errors import StopTest
from hypothesis.stateful import Bundle, MultipleResults, RuleBasedStateMachine, invariant, multiple, precondition, rule

from kvstate import roles
from kvstate.declared import ObservedPass
from kvstate.errors import InvariantViolation
from kvstate.policy import check_pass
from kvstate.pool import ceil_div
from kvstate.testing.adapter import USAGE_KEYS, PassReporting, SchedulerAdapter, adapter_snapshot
from kvstate.testing.binding import MachineBinding, MachineConfig
from kvstate.testing.errors import AdapterContractError, LifecycleViolation
from kvstate.testing.inferred_passes import AdmissionBook, InferredViolation, Observation, infer_step
from kvstate.testing.observed_edges import ObservedRequest, admitted_path, refuted_edges, unlisted_sources
from kvstate.testing.shrink_progress import ShrinkProgress
from kvstate.testing.spec_model import RESET_INVARIANTS, SpecModel
from kvstate.testing.strategies import Submission, from_binding

__all__ = ["STEPS_PER_EXAMPLE", "ConformanceMachine", "conformance_machine", "machine_settings"]


# rules per example where the loaded profile keeps Hypothesis' own default: a step rule runs up to
# `max_steps_per_rule` iterations, so fewer, larger rules reach the same states, and a failure shrinks faster
STEPS_PER_EXAMPLE = 20
_HYPOTHESIS_STEP_COUNT = settings.get_profile("default").stateful_step_count


def machine_settings() -> settings:
    """The loaded profile without a per-example deadline (a scheduler step may be slow), and with
    `STEPS_PER_EXAMPLE` rules per example unless the profile sets its own count."""
    current = settings.default
    steps = current.stateful_step_count if current is not None else _HYPOTHESIS_STEP_COUNT
    if steps == _HYPOTHESIS_STEP_COUNT:
        steps = STEPS_PER_EXAMPLE
    return settings(deadline=None, stateful_step_count=steps)


def _note(text: str) -> None:
    """`hypothesis.note`, except outside a test (a printed step list replayed as plain Python)."""
    if currently_in_test_context():
        note(text)


def _guarded(method: Callable) -> Callable:
    """Mark the machine unhealthy while `method` runs; it stays so if `method` raises (see `teardown`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self.rules_run += method.__name__ != "conforms"
        self.healthy = False
        result = method(self, *args, **kwargs)
        self.healthy = True
        return result

    return run


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
    _progress: ClassVar[ShrinkProgress]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "binding" not in own and ("adapter_factory" in own or "config" in own) and cls.adapter_factory:
            cls.binding = MachineBinding.probe(cls.adapter_factory, cls.config)
        if cls.binding is not None:
            cls.TestCase.settings = machine_settings()

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
            "__module__": __package__,  # kvstate.testing, where it is imported from (types.new_class would say "types")
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
        self.rules_run = 0
        self.book = AdmissionBook()  # admissions and preemptions seen, for inferred passes
        self.visits: dict[Hashable, list[tuple[str, int]]] = {}  # each request's states, with its output length then
        self.healthy = True

    @property
    def model(self) -> SpecModel:
        return self.probed.model

    # ------------------------------------------------------------------------------------------- rules
    @rule(target=requests, request=from_binding("valid"))
    @_guarded
    def submit(self, request: Submission) -> Hashable:
        return self._submit(request)

    @rule(target=requests, batch=st.lists(from_binding("valid"), min_size=2, max_size=4))
    @_guarded
    def submit_many(self, batch: list[Submission]) -> MultipleResults:
        """Several arrivals between two steps: what builds memory pressure."""
        return multiple(*(self._submit(request) for request in batch))

    @rule(request=from_binding("invalid"))
    @_guarded
    def submit_invalid(self, request: Submission) -> None:
        before = adapter_snapshot(self.adapter)
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
        if adapter_snapshot(self.adapter) != before:
            raise self.model.violation(
                "LIVE-REFUSE",
                f"refusing {request} changed request states, outputs or block usage; a refusal must change nothing",
            )

    @rule(iterations=from_binding("steps"))
    @_guarded
    def step(self, iterations: int) -> None:
        for _ in range(iterations):
            self._step()

    @rule(in_state=from_binding("live_states"))
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
    @rule(in_state=from_binding("any_state"), nth=st.integers(0, 7))
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
        ended: BaseException | None = sys.exc_info()[1]
        try:
            self._teardown()
        except BaseException as err:
            ended = err
            raise
        finally:
            if currently_in_test_context() and not isinstance(ended, StopTest):
                failed = None if ended is None else f"{getattr(ended, 'invariant_id', type(ended).__name__)}"
                type(self).progress().example_ended(failed, self.rules_run)

    @classmethod
    def progress(cls) -> ShrinkProgress:
        """The shrink progress of this machine class (`kvstate.testing.shrink_progress`)."""
        if "_progress" not in vars(cls):
            cls._progress = ShrinkProgress(cls.__name__)
        return cls._progress

    def _teardown(self) -> None:
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
        fenced = int(self.adapter.block_usage()["gpu_fenced"]) if self.probed.inferred_spec is not None else 0
        before = Observation(self.last_states, self.last_outputs, fenced)
        self.adapter.step()
        self.steps_taken += 1
        self.check_passes()
        self.observe()
        self.check_inferred_pass(before)

    def check_inferred_pass(self, before: Observation) -> None:
        """The pass inferred from the step's state changes, against the declared policy's victim and admission rules
        (an adapter without `take_passes`; `kvstate.testing.inferred_passes`)."""
        policy_spec = self.probed.inferred_spec
        if policy_spec is None:
            return
        requests = {rid: (len(s.prompt), self.expected[rid]) for rid, s in self.submitted.items()}
        after = Observation(self.last_states, self.last_outputs)
        has_host = int(self.adapter.block_usage()["host_capacity"]) > 0
        try:
            infer_step(policy_spec, before, after, requests, self.book, has_host)
        except InferredViolation as err:
            detail = str(err.error).removeprefix(f"invariant {err.error.invariant_id} violated: ")
            raise self.model.violation(
                err.error.invariant_id,
                f"{detail} (inferred from step {self.steps_taken}'s state changes, the adapter reporting no passes: "
                f"each of the {err.readings} readings of the step (which requester took each victim, in which "
                f"order, serving by arrival or by admission) breaks {self.probed.policy_name}; this reading: "
                f"{err.reading.record.decisions}, the requests just before it: {self.snapshot_of(err.reading)})",
            ) from err.error

    def check_passes(self) -> None:
        """Every pass the step ran, against the declared policy (`kvstate.policy.check_pass`)."""
        policy_spec = self.probed.policy_spec
        if policy_spec is None:
            return
        for observed in cast("PassReporting", self.adapter).take_passes():  # bound with a policy: it has them
            self.check_listed_edges(observed)
            try:
                check_pass(policy_spec, observed.before, observed.record, observed.output)
            except InvariantViolation as err:
                detail = str(err).removeprefix(f"invariant {err.invariant_id} violated: ")
                raise self.model.violation(
                    err.invariant_id,
                    f"{detail} (pass {self.passes_checked}; policy: {self.probed.policy_name}; the requests just "
                    f"before it: {self.snapshot_of(observed)})",
                ) from err
            self.passes_checked += 1

    @staticmethod
    def snapshot_of(observed: ObservedPass, rid: Hashable | None = None) -> str:
        """The requests of `observed`'s snapshot (or request `rid` alone) as one line: id, state, admission, tokens."""
        shown = [r for r in observed.before.requests if rid is None or r.request_id == rid]
        return (
            ", ".join(
                f"{r.request_id!r}: {r.state}, admission {r.admission}, {r.num_output_tokens} generated, "
                f"{r.gpu_blocks} GPU blocks{', about to finish' if r.about_to_finish else ''}"
                for r in shown
            )
            or "none"
        )

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

    # ------------------------------------------------------------------------------------------- checks
    def observe(self) -> None:
        """Read the adapter's states, outputs and block usage, check them all, and keep them as the latest."""
        states = dict(self.adapter.states())
        outputs = {rid: list(out) for rid, out in self.adapter.outputs().items()}
        usage = self.adapter.block_usage()
        self.check_ids(states, outputs, usage)
        for rid, state in states.items():
            old = self.last_states.get(rid)
            if old != state:
                self.check_state(rid, old, state, self.observed_request(rid, outputs[rid]))
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

    def observed_request(self, rid: Hashable, out: list[int]) -> ObservedRequest:
        """What request `rid`'s counters decide since its last observation, given its output `out` now."""
        submission = self.submitted[rid]
        final = len(out) >= submission.max_new_tokens or bool(out and out[-1] in submission.stop_token_ids)
        before = len(self.last_outputs.get(rid, ()))
        replaying = self.last_states.get(rid) in self.model.replay_states
        return ObservedRequest(rid, len(out) - before, final, generated_before=before, replaying_before=replaying)

    def check_state(self, rid: Hashable, old: str | None, new: str, observed: ObservedRequest | None = None) -> None:
        """`new` is a spec state that a path of spec edges leads to from `old` (terminal states absorb), each edge's
        guard left possible by the counters `observed` (SPEC-EDGE)."""
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
            if observed is not None and admitted_path(model.spec, old, new, observed) is None:
                raise LifecycleViolation(
                    f"request {rid!r} went from {old!r} to {new!r} between two observations, but every path of spec "
                    f"edges between them has an edge whose guard its observed counters refute: "
                    f"{'; '.join(refuted_edges(model.spec, old, observed))}{self.spec_edge_statement()}"
                )

    def spec_edge_statement(self) -> str:
        statement = self.model.invariants.get("SPEC-EDGE")
        return f". [SPEC-EDGE: {statement.statement}]" if statement is not None else ""

    def check_listed_edges(self, observed: ObservedPass) -> None:
        """SPEC-EDGE, exactly, for a reported pass: every request its output lists as having taken an event was, just
        before the pass, in a source state of an event that feeds that list."""
        spec = self.model.spec
        before = {r.request_id: r.state for r in observed.before.requests}
        for list_name in spec.list_states:
            for listed in getattr(observed.output, list_name, ()):
                state = before.get(listed.request_id)
                if state is None or unlisted_sources(spec, list_name, state) is not None:
                    continue
                events = sorted(e.name for e in spec.events if e.feeds == list_name)
                sources = sorted({t.source for t in spec.transitions if t.event in events})
                raise LifecycleViolation(
                    f"pass {self.passes_checked} listed request {listed.request_id!r} in {list_name!r} (event "
                    f"{' or '.join(events) or 'none'}), but it was {state!r} just before the pass, and that list is "
                    f"entered only from {sources} (snapshot: {self.snapshot_of(observed, listed.request_id)})"
                    f"{self.spec_edge_statement()}"
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
        statement = {i: self.model.invariants[i].statement for i in RESET_INVARIANTS if i in self.model.invariants}
        departs = next((i for i, (a, b) in enumerate(zip(out, expected, strict=False)) if a != b), None)
        if not pauses:
            resumed = any(s in self.model.held_states for s, _ in visits)
            kept = "it was suspended and resumed, so the KV it held (on the GPU, or offloaded and read back)"
            where = kept if resumed else "the KV"
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
        """NO-HOST-NO-OFFLOAD, CONS-GPU, CONS-HOST and RES-STATE on one observation."""
        model, block_size = self.model, self.probed.block_size
        if int(usage["host_capacity"]) == 0 and (int(usage["host_held"]) or int(usage["host_fenced"])):
            raise model.violation(
                "NO-HOST-NO-OFFLOAD",
                f"the host tier is gone (host_capacity 0), yet {usage['host_held']} host blocks are held and "
                f"{usage['host_fenced']} fenced; without a host tier held blocks stay on the GPU, and a tier that "
                "goes away first drops the host copies",
            )
        for tier, inv in (("gpu", "CONS-GPU"), ("host", "CONS-HOST")):
            cap, free, held, fenced = (int(usage[f"{tier}_{k}"]) for k in ("capacity", "free", "held", "fenced"))
            if min(cap, free, held, fenced) < 0 or free + held + fenced != cap:
                raise model.violation(
                    inv, f"{tier} tier: free {free} + held {held} + fenced {fenced} != capacity {cap}"
                )
            holders = [rid for rid, s in states.items() if s in model.holding[tier]]
            bound = sum(ceil_div(self.submitted[rid].num_tokens, block_size) for rid in holders)
            if held > bound:
                raise model.violation(
                    "RES-STATE",
                    f"{tier} tier holds {held} blocks, but the {len(holders)} request(s) in states whose "
                    f"residency allows that tier ({', '.join(sorted(model.holding[tier]))}) can hold at most "
                    f"{bound}; blocks are leaked by requests in other states (states {states})",
                )


def conformance_machine(
    adapter_factory: Callable[[], SchedulerAdapter], *, name: str | None = None, **config: Any
) -> type[ConformanceMachine]:
    """`ConformanceMachine.bind(adapter_factory, name=name, **config)`: kept for existing callers."""
    return ConformanceMachine.bind(adapter_factory, name=name, **config)
