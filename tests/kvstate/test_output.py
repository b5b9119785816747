"""The scheduler output: serialization as request ids (JSON and pickle), the recompute_paused default, and the
checks of its lists (OUT-DISJOINT, OUT-STATE). Outputs come from real pressured passes so that every list that
matters, the recompute_paused one above all, is non-empty."""

from __future__ import annotations

import json
import pickle

import pytest

from kvstate.config import SchedulerConfig
from kvstate.errors import InvariantViolation, UnknownRequestId
from kvstate.output import SchedulerOutput, check_output
from kvstate.roles import LIST_NAMES
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor


def pressured_pass(host_blocks: int, id_kind: type = str) -> tuple[Scheduler, SchedulerOutput]:
    """GPU 15 blocks of 1 token, chunks of 6. Pass 2 preempts the two tail requests so the first can continue:
    with a 6-block host tier it suspends one and recompute-pauses the other (with a copy plan); without one it
    recompute-pauses both and schedules a context chunk."""
    sched = Scheduler(
        SchedulerConfig(gpu_blocks=15, host_blocks=host_blocks, block_size=1, prefill_chunk_size=6, max_num_tokens=14)
    )
    names = ["p", "x", "y"] if id_kind is str else [10, 11, 12]
    sched.submit(list(range(1, 14)), 1, request_id=names[0])
    sched.submit(list(range(21, 29)), 2, request_id=names[1])
    sched.submit([31, 32, 33, 34, 35], 2, request_id=names[2])
    ex = SimExecutor(sched)
    ex.step()
    out = sched.schedule()
    sched.check_invariants(out)
    assert out.recompute_paused, "the scenario must produce a recompute-paused request"
    if host_blocks:
        assert out.suspended and out.migrations
    else:
        assert out.context and out.chunk_tokens
    return sched, out


def ids_of(out: SchedulerOutput) -> dict:
    return {name: [r.request_id for r in requests] for name, requests in out.lists()}


@pytest.mark.parametrize("host_blocks", [6, 0])
@pytest.mark.parametrize("id_kind", [str, int])
def test_json_round_trip_keeps_every_list_migrations_and_chunks(host_blocks: int, id_kind: type) -> None:
    sched, out = pressured_pass(host_blocks, id_kind)
    wire = json.dumps(out.to_dict())  # JSON-safe without a default hook
    back = SchedulerOutput.from_dict(json.loads(wire), sched.requests)
    assert back == out
    assert ids_of(back) == ids_of(out)
    for name, requests in out.lists():  # the receiver's own request objects, by identity
        assert all(a is b for a, b in zip(getattr(back, name), requests, strict=True))
    assert back.migrations == out.migrations
    assert back.chunk_tokens == out.chunk_tokens
    assert back.num_fitting_requests == out.num_fitting_requests
    assert [r.request_id for r in back.recompute_paused] == [r.request_id for r in out.recompute_paused] != []


@pytest.mark.parametrize("host_blocks", [6, 0])
def test_pickle_round_trip_keeps_recompute_paused_and_migrations(host_blocks: int) -> None:
    _, out = pressured_pass(host_blocks)
    back = pickle.loads(pickle.dumps(out))
    assert back == out
    assert [r.request_id for r in back.recompute_paused] == [r.request_id for r in out.recompute_paused] != []
    assert [r.state for r in back.recompute_paused] == [r.state for r in out.recompute_paused]
    assert back.migrations == out.migrations
    if host_blocks:
        assert back.migrations[0].runs() == out.migrations[0].runs()


def test_construction_without_recompute_paused_defaults_to_empty() -> None:
    sched, _out = pressured_pass(0)
    p = sched.get("p")
    by_keyword = SchedulerOutput(context=[p], chunk_tokens={"p": 1})
    assert by_keyword.recompute_paused == []
    # the positional signature that predates the field still works
    positional = SchedulerOutput([p], [], [], [], [], [], {"p": 1}, 1)
    assert positional.recompute_paused == [] and positional.num_fitting_requests == 1
    assert positional.to_dict()["recompute_paused"] == []
    # the default is a fresh list per output, never shared
    by_keyword.recompute_paused.append(p)
    assert SchedulerOutput().recompute_paused == []


def test_from_dict_of_a_dict_lacking_recompute_paused_loads() -> None:
    sched, out = pressured_pass(6)
    d = json.loads(json.dumps(out.to_dict()))
    del d["recompute_paused"]
    back = SchedulerOutput.from_dict(d, sched.requests)
    assert back.recompute_paused == []
    assert ids_of(back)["suspended"] == ids_of(out)["suspended"] != []
    assert back.migrations == out.migrations


def test_from_dict_naming_an_unknown_id_raises_unknown_request() -> None:
    sched, out = pressured_pass(6)
    d = out.to_dict()
    missing = d["recompute_paused"][0]
    active = {rid: r for rid, r in sched.requests.items() if rid != missing}
    with pytest.raises(UnknownRequestId) as info:
        SchedulerOutput.from_dict(d, active)
    assert repr(missing) in str(info.value) and "recompute_paused" in str(info.value)
    assert isinstance(info.value, KeyError)


def test_every_list_is_serialized_even_when_empty() -> None:
    d = SchedulerOutput().to_dict()
    assert set(LIST_NAMES) <= set(d) and "recompute_paused" in d
    assert all(d[name] == [] for name in LIST_NAMES)
    assert SchedulerOutput.from_dict(d, {}) == SchedulerOutput()


def test_real_outputs_pass_check_output() -> None:
    for host_blocks in (6, 0):
        _, out = pressured_pass(host_blocks)
        check_output(out)


def test_check_output_detects_a_request_listed_twice() -> None:
    sched, _ = pressured_pass(0)
    p = sched.get("p")
    assert p.state == "running"
    twice = SchedulerOutput(context=[p], generation=[p])
    with pytest.raises(InvariantViolation) as info:
        check_output(twice)
    assert info.value.invariant_id == "OUT-DISJOINT" and "'p'" in str(info.value)


def test_check_output_detects_a_paused_request_also_listed_as_suspended() -> None:
    _sched, out = pressured_pass(6)
    y = out.recompute_paused[0]
    bad = SchedulerOutput(suspended=[y], recompute_paused=[y])
    with pytest.raises(InvariantViolation) as info:
        check_output(bad)
    assert info.value.invariant_id == "OUT-DISJOINT"


def test_check_output_detects_a_request_in_the_wrong_state_for_its_list() -> None:
    _sched, out = pressured_pass(6)
    x = out.suspended[0]
    assert x.state == "suspended"
    with pytest.raises(InvariantViolation) as info:
        check_output(SchedulerOutput(generation=[x]))
    assert info.value.invariant_id == "OUT-STATE"


# ------------------------------------------------------------------ from_dict on untrusted data
def wire(host_blocks: int = 6) -> tuple[Scheduler, dict]:
    sched, out = pressured_pass(host_blocks)
    return sched, json.loads(json.dumps(out.to_dict()))


def refused(d: object, sched: Scheduler, *needles: str) -> None:
    from kvstate.output import MalformedOutput

    with pytest.raises(MalformedOutput) as info:
        SchedulerOutput.from_dict(d, sched.requests)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_from_dict_refuses_an_id_in_several_lists() -> None:
    sched, d = wire()
    rid = d["suspended"][0]
    d["context"].append(rid)
    d["chunk_tokens"].append([rid, 1])
    refused(d, sched, "OUT-DISJOINT", repr(rid))


@pytest.mark.parametrize("n", [-1, 0, "3", 2.5, True, None])
def test_from_dict_refuses_chunk_counts_that_are_not_positive_integers(n) -> None:
    sched, d = wire(0)
    d["chunk_tokens"][0][1] = n
    refused(d, sched, "'chunk_tokens'", ">= 1")


def test_from_dict_refuses_chunks_for_unscheduled_requests_and_scheduled_requests_without_one() -> None:
    sched, d = wire(0)
    rid = d["recompute_paused"][0]
    d["chunk_tokens"].append([rid, 2])
    refused(d, sched, "not in context, replay or generation")
    sched, d = wire(0)
    d["chunk_tokens"] = []
    refused(d, sched, "no 'chunk_tokens' entry")


@pytest.mark.parametrize(
    "change, needles",
    [
        (lambda m: m.update(direction="sideways"), ("'sideways'", "'to_host' or 'to_gpu'")),
        (lambda m: m["pairs"][0].__setitem__(0, -1), ("a block id", ">= 0")),
        (lambda m: m.update(pairs=[[1, 2, 3]]), ("[source block, destination block]",)),
        (lambda m: m.update(pairs="12"), ("'pairs' must be a list",)),
        (lambda m: m.pop("pairs"), ("lacks 'pairs'",)),
        (lambda m: m.update(plan_id=-3), ("'plan_id'", ">= 0")),
    ],
)
def test_from_dict_refuses_malformed_migrations(change, needles) -> None:
    sched, d = wire(6)
    assert d["migrations"]
    change(d["migrations"][0])
    refused(d, sched, *needles)


def test_from_dict_refuses_a_migration_of_an_unknown_request_and_repeated_plan_ids() -> None:
    sched, d = wire(6)
    d["migrations"][0]["request_id"] = "nobody"
    with pytest.raises(UnknownRequestId, match="nobody"):
        SchedulerOutput.from_dict(d, sched.requests)
    sched, d = wire(6)
    d["migrations"].append(dict(d["migrations"][0]))
    refused(d, sched, "repeats a plan id")


def test_from_dict_refuses_strings_where_lists_belong_and_non_mappings() -> None:
    sched, d = wire(6)
    d["suspended"] = "xy"  # would be iterated per character
    refused(d, sched, "'suspended' must be a list", "str")
    refused(["context"], sched, "must be a mapping", "list")
    sched, d = wire(6)
    d["context"] = [[1]]
    refused(d, sched, "request ids are integers or strings")
    sched, d = wire(6)
    d["num_fitting_requests"] = -2
    refused(d, sched, "'num_fitting_requests'", ">= 0")


# ------------------------------------------------------------------ from_dict bounds
CAPACITIES = {"gpu": 15, "host": 6}  # the pools of `pressured_pass`


def refused_within(d: dict, sched: Scheduler, *needles: str) -> None:
    from kvstate.output import MalformedOutput

    with pytest.raises(MalformedOutput) as info:
        SchedulerOutput.from_dict(d, sched.requests, capacities=CAPACITIES)
    message = str(info.value)
    assert len(message) < 400 and all(needle in message for needle in needles), message


def test_from_dict_within_capacities_loads_what_the_scheduler_wrote() -> None:
    sched, d = wire(6)
    assert d["migrations"]
    assert SchedulerOutput.from_dict(d, sched.requests, capacities=CAPACITIES).to_dict() == d


@pytest.mark.parametrize("n", [10**30, "longest + 1"])
def test_from_dict_refuses_a_chunk_longer_than_its_request_can_be(n) -> None:
    sched, d = wire(0)
    rid = d["chunk_tokens"][0][0]
    request = sched.requests[rid]
    longest = len(request.prompt) + request.max_new_tokens
    d["chunk_tokens"][0][1] = longest + 1 if n == "longest + 1" else n
    refused_within(d, sched, f"more than {longest}", "prompt + max_new_tokens")


def test_from_dict_refuses_block_ids_past_the_capacity_and_destinations_written_twice() -> None:
    sched, d = wire(6)
    plan = d["migrations"][0]
    source_tier, dest_tier = ("gpu", "host") if plan["direction"] == "to_host" else ("host", "gpu")
    plan["pairs"][0][0] = 10**9
    refused_within(d, sched, "a block id is 1000000000", f"the last block of the {source_tier} tier")
    sched, d = wire(6)
    pairs = d["migrations"][0]["pairs"]
    assert len(pairs) >= 2
    pairs[1][1] = pairs[0][1]
    refused_within(d, sched, f"copies into {dest_tier} block {pairs[0][1]}", "written once")


def test_from_dict_refuses_more_fitting_requests_than_it_schedules() -> None:
    sched, d = wire(6)
    d["num_fitting_requests"] = 10**30
    refused_within(d, sched, "'num_fitting_requests' is", f"more than {len(d['chunk_tokens'])}")


@pytest.mark.parametrize("direction", ["to_host", "to_gpu"])
def test_from_dict_refuses_a_second_migration_of_one_request(direction) -> None:
    """One copy per request: a request with two plans in one output (either direction) is refused."""
    sched, d = wire(6)
    first = d["migrations"][0]
    d["migrations"].append(dict(first, plan_id=first["plan_id"] + 1, direction=direction, pairs=[[5, 5]]))
    refused_within(d, sched, "'migrations'", f"both copy request {first['request_id']!r}", "one copy per request")


@pytest.mark.parametrize("capacities", [CAPACITIES, None], ids=["capacities", "no-capacities"])
def test_from_dict_counts_the_pairs_of_a_plan_before_reading_them(capacities) -> None:
    """A million pairs are refused from their count: no pair is read (a pair that is not a pair goes unseen)."""
    from kvstate.output import MAX_MIGRATION_PAIRS, MalformedOutput

    sched, d = wire(6)
    plan = d["migrations"][0]
    plan["pairs"] = [None] * 10**6
    tier = "host" if plan["direction"] == "to_host" else "gpu"
    limit = f"capacity of {CAPACITIES[tier]} blocks" if capacities else f"MAX_MIGRATION_PAIRS = {MAX_MIGRATION_PAIRS}"
    with pytest.raises(MalformedOutput) as info:
        SchedulerOutput.from_dict(d, sched.requests, capacities=capacities)
    message = str(info.value)
    assert all(n in message for n in ("'pairs' holds 1000000 copies", f"the {tier} tier", limit)), message


def test_from_dict_refuses_more_plans_than_active_requests() -> None:
    sched, d = wire(6)
    first = d["migrations"][0]
    d["migrations"] = [dict(first, plan_id=i) for i in range(len(sched.requests) + 1)]
    refused_within(d, sched, f"holds {len(sched.requests) + 1} plans", "at most one copy in flight")
