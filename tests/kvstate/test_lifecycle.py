"""The lifecycle machine (`Lifecycle`) and its compiled table (`TransitionTable`) against the spec.

Every expectation is derived from `load_spec()`: the edges, the allowed events per state, the exclusive
guard groups. Guards are either injected (to force outcomes) or the real ones of `kvstate.semantics`
evaluated against small fake requests and pools.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvstate import EFFECTS, GUARDS, GuardRejected, IllegalTransition, Lifecycle, Transition, TransitionTable, load_spec
from kvstate.request import STATE_ATTRIBUTE

SPEC = load_spec()
STATES = tuple(s.name for s in SPEC.states)
EVENTS = tuple(e.name for e in SPEC.events)
GROUPS = tuple(tuple(sorted(g.guards)) for g in SPEC.exclusive_guards)
UNGROUPED = tuple(sorted(set(GUARDS) - {g for group in GROUPS for g in group}))


def edges_from(state: str, event: str) -> tuple[Transition, ...]:
    """The spec's edges for (state, event), in spec order."""
    return tuple(t for t in SPEC.transitions if t.source == state and t.event == event)


def allowed_from(state: str) -> tuple[str, ...]:
    """Events with an edge from `state`, in spec order."""
    return tuple(dict.fromkeys(t.event for t in SPEC.transitions if t.source == state))


def edge(source: str, event: str, guard: str | None) -> Transition:
    (found,) = (t for t in edges_from(source, event) if t.guard == guard)
    return found


def enabled(edges: tuple[Transition, ...], outcomes: dict[str, bool]) -> tuple[Transition, ...]:
    return tuple(t for t in edges if t.guard is None or outcomes[t.guard])


# ---------------------------------------------------------------------------------------------- fakes


class FakeRequest:
    """Just what guards read (kvstate.semantics.RequestView); compares by identity."""

    def __init__(
        self,
        request_id: object,
        *,
        prefill_tokens_left: int = 1,
        num_gpu_blocks: int = 0,
        num_host_blocks: int = 0,
        final_token_produced: bool = False,
        replay_complete: bool = False,
        mid_replay: bool = False,
        termination_reason: str | None = None,
        suspended_in_pass: int | None = None,
        kv_tokens: int = 0,
        copy_in_flight: bool = False,
        step_in_flight: bool = False,
    ) -> None:
        self.request_id = request_id
        self.copy_in_flight = copy_in_flight
        self.step_in_flight = step_in_flight
        self.suspended_in_pass = suspended_in_pass
        self.kv_tokens = kv_tokens
        self.prefill_tokens_left = prefill_tokens_left
        self.num_gpu_blocks = num_gpu_blocks
        self.num_host_blocks = num_host_blocks
        self.final_token_produced = final_token_produced
        self.replay_complete = replay_complete
        self.mid_replay = mid_replay
        self.termination_reason = termination_reason

    def __repr__(self) -> str:
        return f"FakeRequest({self.request_id!r})"


@dataclass(eq=True)
class EqualFieldsRequest:
    """A request type whose instances compare equal when their fields are equal (and are unhashable)."""

    request_id: object
    prefill_tokens_left: int = 1
    num_gpu_blocks: int = 0
    num_host_blocks: int = 0
    final_token_produced: bool = False
    replay_complete: bool = False
    mid_replay: bool = False
    termination_reason: str | None = None
    suspended_in_pass: int | None = None
    kv_tokens: int = 0
    copy_in_flight: bool = False
    step_in_flight: bool = False


@dataclass(frozen=True)
class FakePool:
    """Just what guards read (kvstate.semantics.PoolView)."""

    gpu_free_blocks: int = 0
    host_free_blocks: int = 0
    has_host_tier: bool = False
    pipeline_stages: int = 1
    block_size: int = 1  # one token per block: a first chunk of n tokens takes n blocks
    first_chunk_limit: int = 1 << 30  # no chunk size or token budget cuts a first chunk
    pass_number: int | None = None
    promotion_worth: int = 0
    offload_limit: int = 0
    resume_gate_open: bool = True


@dataclass(frozen=True)
class OraclePool(FakePool):
    """A pool that also carries the outcome every injected oracle guard returns."""

    outcomes: dict = field(default_factory=dict)


ORACLE_GUARDS = {name: (lambda request, pool, name=name: pool.outcomes[name]) for name in GUARDS}


def _recorder(effect: str):
    def hook(self, request, transition) -> None:
        self.calls.append((effect, request, transition, getattr(request, STATE_ATTRIBUTE)))

    hook.__name__ = effect
    return hook


class RecordingHooks:
    """Implements every effect in EFFECTS; records (effect, request, transition, state at call time)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, Transition, str]] = []


for _effect in EFFECTS:
    setattr(RecordingHooks, _effect, _recorder(_effect))


IMPLEMENTATIONS = {"machine": Lifecycle, "table": TransitionTable}


def request_in(state: str, request_id: object = "req", **fields) -> FakeRequest:
    request = FakeRequest(request_id, **fields)
    setattr(request, STATE_ATTRIBUTE, state)  # placing a request in an arbitrary state: tests only
    return request


def forced_outcomes() -> list[dict[str, bool]]:
    """Every guard true, except that in each exclusive group exactly one guard is true (all combinations)."""
    assignments = []
    for chosen in itertools.product(*GROUPS):
        outcomes = dict.fromkeys(GUARDS, True)
        for group, winner in zip(GROUPS, chosen, strict=True):
            outcomes.update({g: g == winner for g in group})
        assignments.append(outcomes)
    return assignments


# ------------------------------------------------------------------------------------------ exhaustive


def test_recording_hooks_implement_every_effect() -> None:
    hooks = RecordingHooks()
    assert EFFECTS and all(callable(getattr(hooks, name, None)) for name in EFFECTS)


@pytest.mark.parametrize(
    "outcomes", forced_outcomes(), ids=lambda o: "+".join(g for grp in GROUPS for g in grp if o[g])
)
def test_machine_allows_exactly_the_spec_edges(outcomes: dict[str, bool]) -> None:
    lifecycle = Lifecycle(SPEC, guards={name: (lambda r, p, v=value: v) for name, value in outcomes.items()})
    pool = FakePool()
    for state, event in itertools.product(STATES, EVENTS):
        request_id = f"req-{state}-{event}"
        request = request_in(state, request_id)
        before = dict(vars(request))
        hooks = RecordingHooks()
        edges = edges_from(state, event)
        if edges:
            (expected,) = enabled(edges, outcomes)  # exclusivity by construction: exactly one edge enabled
            taken = lifecycle.fire(request, event, pool, hooks)
            assert taken == expected, (state, event)
            assert getattr(request, STATE_ATTRIBUTE) == expected.dest
            expected_calls = [(expected.effect, request, expected, expected.dest)] if expected.effect else []
            assert hooks.calls == expected_calls, (state, event)
        else:
            with pytest.raises(IllegalTransition) as info:
                lifecycle.fire(request, event, pool, hooks)
            err = info.value
            assert type(err) is IllegalTransition, "no edge at all is not a guard rejection"
            assert vars(request) == before, "a refused event changes nothing"
            assert hooks.calls == []
            allowed = allowed_from(state)
            assert (err.request_id, err.state, err.event, err.allowed) == (request_id, state, event, allowed)
            message = str(err)
            assert repr(request_id) in message
            assert repr(state) in message and repr(event) in message
            assert all(name in message for name in allowed)


def test_forced_outcomes_take_every_spec_edge() -> None:
    """Across the forced assignments above, every edge of the spec is taken at least once."""
    taken = set()
    for outcomes in forced_outcomes():
        for t in SPEC.transitions:
            if (t.guard is None or outcomes[t.guard]) and enabled(edges_from(t.source, t.event), outcomes)[0] == t:
                taken.add(t)
    assert taken == set(SPEC.transitions)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
def test_event_the_spec_does_not_define_is_illegal(impl) -> None:
    lifecycle = impl(SPEC)
    request = FakeRequest("req-bogus")
    lifecycle.start(request)
    with pytest.raises(IllegalTransition) as info:
        lifecycle.fire(request, "teleport", FakePool())
    assert "defines no such event" in str(info.value)
    assert getattr(request, STATE_ATTRIBUTE) == SPEC.initial


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
def test_start_puts_the_request_in_the_initial_state(impl) -> None:
    request = FakeRequest("req-new")
    impl(SPEC).start(request)
    assert getattr(request, STATE_ATTRIBUTE) == SPEC.initial


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
def test_allowed_events_follow_the_spec(impl) -> None:
    lifecycle = impl(SPEC)
    for state in STATES:
        assert lifecycle.allowed_events(state) == allowed_from(state)
    for terminal in SPEC.terminal_states:
        assert lifecycle.allowed_events(terminal) == ()


# ------------------------------------------------------------------------------------- machine vs table

MACHINE = Lifecycle(SPEC, guards=ORACLE_GUARDS)
TABLE = TransitionTable(SPEC, guards=ORACLE_GUARDS)


def _outcome(impl, state: str, event: str, pool: OraclePool):
    request = request_in(state, "req-hyp")
    hooks = RecordingHooks()
    try:
        taken = impl.fire(request, event, pool, hooks)
    except IllegalTransition as err:  # GuardRejected included
        return ("refused", type(err), str(err), err.allowed), getattr(request, STATE_ATTRIBUTE), hooks.calls, request
    return ("taken", taken), getattr(request, STATE_ATTRIBUTE), hooks.calls, request


@given(
    state=st.sampled_from(STATES),
    event=st.sampled_from(EVENTS),
    outcomes=st.fixed_dictionaries({name: st.booleans() for name in sorted(GUARDS)}),
)
def test_machine_and_table_agree(state: str, event: str, outcomes: dict[str, bool]) -> None:
    assume(all(sum(outcomes[g] for g in group) <= 1 for group in GROUPS))  # the spec's exclusivity
    pool = OraclePool(outcomes=outcomes)
    m_result, m_state, m_calls, m_request = _outcome(MACHINE, state, event, pool)
    t_result, t_state, t_calls, t_request = _outcome(TABLE, state, event, pool)

    assert m_result == t_result
    assert m_state == t_state
    # same hook, once, with the same transition, after the state change (requests differ by identity)
    assert [(c[0], c[2], c[3]) for c in m_calls] == [(c[0], c[2], c[3]) for c in t_calls]
    assert all(c[1] is m_request for c in m_calls) and all(c[1] is t_request for c in t_calls)

    # and both agree with the spec
    edges = edges_from(state, event)
    candidates = enabled(edges, outcomes)
    if not edges:
        assert m_result[:2] == ("refused", IllegalTransition) and m_state == state
    elif not candidates:
        assert m_result[:2] == ("refused", GuardRejected) and m_state == state
    else:
        expected = candidates[0]
        assert len(candidates) == 1
        assert m_result == ("taken", expected)
        assert m_state == expected.dest
        assert m_calls == ([(expected.effect, m_request, expected, expected.dest)] if expected.effect else [])
    if m_result[0] == "refused":
        assert m_calls == []


# ------------------------------------------------------------------------------------- guard rejection


def _rejectable_pairs() -> list[tuple[str, str]]:
    """(state, event) pairs whose every edge is guarded: those a guard can refuse."""
    pairs = dict.fromkeys((t.source, t.event) for t in SPEC.transitions)
    return [p for p in pairs if all(t.guard is not None for t in edges_from(*p))]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
@pytest.mark.parametrize(("state", "event"), _rejectable_pairs(), ids=lambda v: v)
def test_failing_guards_reject_and_change_nothing(impl, state: str, event: str) -> None:
    edges = edges_from(state, event)
    outcomes = dict.fromkeys(GUARDS, True)
    outcomes.update({t.guard: False for t in edges})
    lifecycle = impl(SPEC, guards=ORACLE_GUARDS)
    request = request_in(state, f"req-{state}-{event}")
    before = dict(vars(request))
    hooks = RecordingHooks()
    with pytest.raises(GuardRejected) as info:
        lifecycle.fire(request, event, OraclePool(outcomes=outcomes), hooks)
    assert vars(request) == before
    assert hooks.calls == []
    message = str(info.value)
    assert repr(f"req-{state}-{event}") in message and repr(state) in message and repr(event) in message
    assert all(t.guard in message for t in edges), "the refusal names every guard that failed"
    assert info.value.allowed == allowed_from(state)


def test_some_pairs_are_rejectable() -> None:
    assert _rejectable_pairs()


# ------------------------------------------------------------------------------------- the real guards

# (state, event, request fields, pool, guard of the edge expected, or None for GuardRejected)
REAL_GUARD_CASES = {
    "admit-fits": (
        "waiting",
        "admit",
        {"prefill_tokens_left": 4},
        FakePool(gpu_free_blocks=4),
        "gpu_room_for_first_chunk",
    ),
    "admit-short-one": ("waiting", "admit", {"prefill_tokens_left": 4}, FakePool(gpu_free_blocks=3), None),
    # suspension copies nothing and checks nothing about the host tier: it holds the blocks where they are
    "suspend-with-host-room": (
        "running",
        "suspend",
        {"num_gpu_blocks": 5},
        FakePool(host_free_blocks=5, has_host_tier=True),
        "no_copy_in_flight",
    ),
    "suspend-with-a-host-tier-too-small": (
        "running",
        "suspend",
        {"num_gpu_blocks": 5},
        FakePool(host_free_blocks=4, has_host_tier=True),
        "no_copy_in_flight",
    ),
    "suspend-without-a-host-tier": (
        "running",
        "suspend",
        {"num_gpu_blocks": 5},
        FakePool(host_free_blocks=100, has_host_tier=False),
        "no_copy_in_flight",
    ),
    "offload-for-an-allocation": (
        "suspended",
        "offload",
        {"num_gpu_blocks": 3},
        FakePool(host_free_blocks=1, has_host_tier=True, offload_limit=2),
        "host_room_for_held_blocks",
    ),
    "offload-with-the-host-tier-full": (
        "suspended",
        "offload",
        {"num_gpu_blocks": 3},
        FakePool(host_free_blocks=0, has_host_tier=True, offload_limit=2),
        None,
    ),
    "offload-without-a-host-tier": (
        "suspended",
        "offload",
        {"num_gpu_blocks": 3},
        FakePool(host_free_blocks=100, has_host_tier=False, offload_limit=2),
        None,
    ),
    "offload-that-no-allocation-needs": (
        "suspended",
        "offload",
        {"num_gpu_blocks": 3},
        FakePool(host_free_blocks=4, has_host_tier=True, offload_limit=0),
        None,
    ),
    "offload-of-nothing-held": (
        "suspended",
        "offload",
        {"num_gpu_blocks": 0, "num_host_blocks": 3},
        FakePool(host_free_blocks=4, has_host_tier=True, offload_limit=2),
        None,
    ),
    "offload-while-its-copy-is-in-flight": (
        "suspended",
        "offload",
        {"num_gpu_blocks": 3, "copy_in_flight": True},
        FakePool(host_free_blocks=4, has_host_tier=True, offload_limit=2),
        None,
    ),
    "suspend-while-its-copy-is-in-flight": (
        "running",
        "suspend",
        {"num_gpu_blocks": 5, "copy_in_flight": True},
        FakePool(host_free_blocks=5, has_host_tier=True),
        None,
    ),
    "resume-while-its-copy-is-in-flight": (
        "suspended",
        "resume",
        {"num_host_blocks": 6, "copy_in_flight": True},
        FakePool(gpu_free_blocks=6, has_host_tier=True),
        None,
    ),
    "resume-gpu-room": (
        "suspended",
        "resume",
        {"num_host_blocks": 6},
        FakePool(gpu_free_blocks=6, has_host_tier=True),
        "gpu_room_for_offloaded_blocks",
    ),
    "resume-held-on-the-gpu-needs-no-room": (
        "suspended",
        "resume",
        {"num_gpu_blocks": 6, "num_host_blocks": 0},
        FakePool(gpu_free_blocks=0, has_host_tier=False),
        "gpu_room_for_offloaded_blocks",
    ),
    "resume-mid-replay-replays": (
        "suspended",
        "resume",
        {"num_gpu_blocks": 2, "num_host_blocks": 1, "mid_replay": True},
        FakePool(gpu_free_blocks=1, has_host_tier=True),
        "gpu_room_for_offloaded_replay",
    ),
    "resume-mid-replay-gpu-short-one": (
        "suspended",
        "resume",
        {"num_host_blocks": 3, "mid_replay": True},
        FakePool(gpu_free_blocks=2, has_host_tier=True),
        None,
    ),
    "suspend-replaying": (
        "replaying",
        "suspend",
        {"num_gpu_blocks": 3},
        FakePool(has_host_tier=False),
        "no_copy_in_flight",
    ),
    "resume-refused-by-the-utilization-gate": (
        "suspended",
        "resume",
        {"num_gpu_blocks": 2, "num_host_blocks": 1},
        FakePool(gpu_free_blocks=6, has_host_tier=True, resume_gate_open=False),
        None,
    ),
    "resume-gpu-short-one": (
        "suspended",
        "resume",
        {"num_host_blocks": 6},
        FakePool(gpu_free_blocks=5, host_free_blocks=100, has_host_tier=True),
        None,
    ),
    "pause-single-stage": ("running", "recompute_pause", {}, FakePool(pipeline_stages=1), "single_stage"),
    "pause-multi-stage": ("running", "recompute_pause", {}, FakePool(pipeline_stages=4), "multi_stage"),
    "pause-replaying-multi-stage": ("replaying", "recompute_pause", {}, FakePool(pipeline_stages=2), "multi_stage"),
    "promote-with-host-tier": (
        "suspended",
        "recompute_pause",
        {"num_host_blocks": 3, "suspended_in_pass": 7, "kv_tokens": 3},
        FakePool(has_host_tier=True, pass_number=7, promotion_worth=4),
        "promotion_gate",
    ),
    "promote-without-host-tier": (
        "suspended",
        "recompute_pause",
        {"num_host_blocks": 3, "suspended_in_pass": 7},
        FakePool(has_host_tier=False, gpu_free_blocks=100, pass_number=7, promotion_worth=4),
        None,
    ),
    # a request suspended in an earlier pass may always be promoted: it frees its blocks on whichever tier they sit
    "promote-suspended-in-an-earlier-pass": (
        "suspended",
        "recompute_pause",
        {"suspended_in_pass": 6, "kv_tokens": 3},
        FakePool(has_host_tier=True, pass_number=7, promotion_worth=4),
        "promotion_gate",
    ),
    "promote-suspended-in-an-earlier-pass-without-a-host-tier": (
        "suspended",
        "recompute_pause",
        {"suspended_in_pass": 6, "kv_tokens": 3},
        FakePool(has_host_tier=False, pass_number=7, promotion_worth=4),
        "promotion_gate",
    ),
    "promote-between-passes": (
        "suspended",
        "recompute_pause",
        {"suspended_in_pass": 7, "kv_tokens": 3},
        FakePool(has_host_tier=True, pass_number=None, promotion_worth=4),
        None,
    ),
    "promote-worth-as-much-as-the-victim": (
        "suspended",
        "recompute_pause",
        {"suspended_in_pass": 7, "kv_tokens": 4},
        FakePool(has_host_tier=True, pass_number=7, promotion_worth=4),
        None,
    ),
    "replay-fits": (
        "recompute_paused",
        "replay",
        {"prefill_tokens_left": 2},
        FakePool(gpu_free_blocks=2),
        "gpu_room_for_first_chunk",
    ),
    "replay-short-one": (
        "recompute_paused",
        "replay",
        {"prefill_tokens_left": 2},
        FakePool(gpu_free_blocks=1),
        None,
    ),
    "catch-up-done": ("replaying", "catch_up", {"replay_complete": True}, FakePool(), "replay_complete"),
    "catch-up-not-yet": ("replaying", "catch_up", {"replay_complete": False}, FakePool(gpu_free_blocks=100), None),
    "finish-final-token": ("running", "finish", {"final_token_produced": True}, FakePool(), "final_token_produced"),
    "finish-too-early": ("running", "finish", {"final_token_produced": False}, FakePool(gpu_free_blocks=100), None),
    "consensus-replays": (
        "awaiting_consensus",
        "consensus",
        {"termination_reason": None},
        FakePool(pipeline_stages=2),
        "replay_still_wanted",
    ),
    "consensus-terminates": (
        "awaiting_consensus",
        "consensus",
        {"termination_reason": "cancelled"},
        FakePool(pipeline_stages=2),
        "termination_requested",
    ),
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", list(REAL_GUARD_CASES.values()), ids=list(REAL_GUARD_CASES))
def test_real_guards(impl, case) -> None:
    state, event, fields, pool, guard = case
    lifecycle = impl(SPEC)  # the real guards of kvstate.semantics
    request = request_in(state, f"req-{state}-{event}", **fields)
    before = dict(vars(request))
    hooks = RecordingHooks()
    if guard is None:
        with pytest.raises(GuardRejected):
            lifecycle.fire(request, event, pool, hooks)
        assert vars(request) == before
        assert hooks.calls == []
    else:
        expected = edge(state, event, guard)
        assert lifecycle.fire(request, event, pool, hooks) == expected
        assert getattr(request, STATE_ATTRIBUTE) == expected.dest
        assert [(c[0], c[2]) for c in hooks.calls] == ([(expected.effect, expected)] if expected.effect else [])


@given(
    fields=st.fixed_dictionaries(
        {
            "prefill_tokens_left": st.integers(0, 8),
            "num_gpu_blocks": st.integers(0, 8),
            "num_host_blocks": st.integers(0, 8),
            "final_token_produced": st.booleans(),
            "replay_complete": st.booleans(),
            "mid_replay": st.booleans(),
            "termination_reason": st.sampled_from([None, "finished", "cancelled", "aborted"]),
        }
    ),
    pool=st.builds(
        FakePool,
        gpu_free_blocks=st.integers(0, 8),
        host_free_blocks=st.integers(0, 8),
        has_host_tier=st.booleans(),
        pipeline_stages=st.integers(1, 4),
        offload_limit=st.integers(0, 8),
    ),
)
def test_real_exclusive_guards_are_exclusive(fields: dict, pool: FakePool) -> None:
    """What the spec declares exclusive is exclusive in the real semantics: at most one guard of a group holds."""
    request = FakeRequest("req-x", **fields)
    for group in GROUPS:
        assert sum(bool(GUARDS[g](request, pool)) for g in group) <= 1, group
    # no offload without a host tier, whatever the room
    if not pool.has_host_tier:
        assert not GUARDS[_only_guard("suspended", "offload")](request, pool)


def _only_guard(state: str, event: str) -> str:
    (t,) = edges_from(state, event)
    return t.guard


# ------------------------------------------------------------------------------ identity, no registered models


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
@pytest.mark.parametrize("request_type", [FakeRequest, EqualFieldsRequest], ids=["identity", "equal-fields"])
def test_requests_with_equal_fields_stay_independent(impl, request_type) -> None:
    lifecycle = impl(SPEC)
    pool = FakePool(gpu_free_blocks=10)
    first, second = request_type("same-id"), request_type("same-id")
    lifecycle.start(first)
    lifecycle.start(second)
    admitted = lifecycle.fire(first, "admit", pool)
    assert getattr(first, STATE_ATTRIBUTE) == admitted.dest
    assert getattr(second, STATE_ATTRIBUTE) == SPEC.initial
    (cancel_edge,) = edges_from(SPEC.initial, "cancel")
    lifecycle.fire(second, "cancel", pool)
    assert getattr(second, STATE_ATTRIBUTE) == cancel_edge.dest
    assert getattr(first, STATE_ATTRIBUTE) == admitted.dest


def test_machine_never_registers_models() -> None:
    lifecycle = Lifecycle(SPEC)
    pool = FakePool(gpu_free_blocks=100, host_free_blocks=100, has_host_tier=True, pipeline_stages=1)
    requests = [
        FakeRequest(f"req-{i}", num_gpu_blocks=2, num_host_blocks=2, replay_complete=True, final_token_produced=True)
        for i in range(300)
    ]
    # a path through admit, suspend, resume, recompute-pause, replay, catch-up and finish
    path = ("admit", "suspend", "resume", "recompute_pause", "replay", "catch_up", "finish")
    for request in requests:
        lifecycle.start(request)
        attributes = set(vars(request))
        for event in path:
            lifecycle.fire(request, event, pool)
        assert set(vars(request)) == attributes, "the machine added attributes (add_model?) to a request"
        assert getattr(request, STATE_ATTRIBUTE) in SPEC.terminal_states
    assert len(lifecycle.machine.models) == 0


@pytest.mark.parametrize("kind", ["machine", "compiled"])
def test_without_a_spec_every_lifecycle_shares_the_packaged_one_parsed_once(kind: str) -> None:
    from kvstate.lifecycle import make_lifecycle
    from kvstate.spec import default_spec

    first, second = make_lifecycle(kind), make_lifecycle(kind)
    assert first.spec is second.spec is default_spec()
    assert first.spec == SPEC  # the same content as a fresh parse of the packaged file
    custom = make_lifecycle(kind, SPEC)
    assert custom.spec is SPEC  # a spec passed in is used as given


# ------------------------------------------------------------------------------ the machine's own classes


class _Model:
    """A bare model for a plain `transitions.Machine` beside the lifecycle's."""


@pytest.mark.parametrize("guard_holds", [True, False])
def test_callbacks_added_to_the_machine_run_as_a_plain_transitions_machine_runs_them(guard_holds: bool) -> None:
    """The lifecycle's machine classes skip only empty callback lists: every kind of callback a caller adds runs in
    the order, and with the outcome, of the library's own `Machine` on the same states and edge."""
    from transitions import Machine

    (admit, *_) = edges_from(SPEC.initial, "admit")
    guards = {name: (lambda r, p: guard_holds) for name in GUARDS}
    lifecycle = Lifecycle(SPEC, guards=guards)
    plain = Machine(
        model=None,
        states=[{"name": s.name, "final": s.terminal} for s in SPEC.states],
        initial=SPEC.initial,
        auto_transitions=False,
        send_event=True,
        model_attribute=STATE_ATTRIBUTE,
    )
    plain.add_transition("admit", admit.source, admit.dest, conditions=[lambda event_data: guard_holds])
    logs: dict[str, list[str]] = {}
    for name, machine in (("lifecycle", lifecycle.machine), ("plain", plain)):
        log = logs[name] = []

        def note(stage: str, log: list[str] = log):
            return lambda event_data: log.append(stage)

        for stage in ("prepare_event", "before_state_change", "after_state_change", "finalize_event", "on_final"):
            setattr(machine, stage, [note(stage)])
        for stage in ("prepare", "before", "after"):
            machine.events["admit"].add_callback(stage, note(stage))
        machine.get_state(admit.source).add_callback("exit", note("exit"))
        machine.get_state(admit.dest).add_callback("enter", note("enter"))
    request, model = request_in(SPEC.initial), _Model()
    setattr(model, STATE_ATTRIBUTE, SPEC.initial)
    fired = lifecycle.try_fire(request, "admit", FakePool())
    plain_fired = plain.events["admit"].trigger(model)
    assert (fired is not None) == plain_fired == guard_holds
    assert getattr(request, STATE_ATTRIBUTE) == getattr(model, STATE_ATTRIBUTE)
    assert logs["lifecycle"] == logs["plain"]
    assert ("enter" in logs["plain"]) == guard_holds


def test_the_machine_finds_states_as_a_plain_transitions_machine_does() -> None:
    """The lifecycle's machine looks a state up by its name as the library's `Machine.get_state` does: the same
    state for every name of the spec, and `ValueError` for a name it lacks."""
    from transitions import Machine

    lifecycle = Lifecycle(SPEC)
    plain = Machine(model=None, states=[s.name for s in SPEC.states], initial=SPEC.initial, auto_transitions=False)
    for state in SPEC.states:
        assert lifecycle.machine.get_state(state.name).name == plain.get_state(state.name).name == state.name
        assert lifecycle.machine.get_state(state.name) is lifecycle.machine.states[state.name]
    for machine in (lifecycle.machine, plain):
        with pytest.raises(ValueError, match="not a registered state"):
            machine.get_state("no-such-state")


def test_the_machine_keeps_its_callback_lists_and_queue_flag_as_the_library_does() -> None:
    """The machine's callback lists are the library's properties: a callable set alone is read back as a list of
    it, as a plain `transitions.Machine` reads it; `has_queue` says what the machine was built with."""
    from transitions import Machine

    lifecycle = Lifecycle(SPEC)
    plain = Machine(model=None, states=[s.name for s in SPEC.states], initial=SPEC.initial, auto_transitions=False)
    assert lifecycle.machine.has_queue is plain.has_queue is False
    queued = type(lifecycle.machine)(model=None, states=["a"], initial="a", queued=True)
    assert queued.has_queue is Machine(model=None, states=["a"], initial="a", queued=True).has_queue is True

    def callback(event_data: object) -> None:
        """A callback that is never run here."""

    for name in ("prepare_event", "before_state_change", "after_state_change", "finalize_event", "on_exception"):
        for machine in (lifecycle.machine, plain):
            assert getattr(machine, name) == []
            setattr(machine, name, callback)
            assert getattr(machine, name) == [callback]
