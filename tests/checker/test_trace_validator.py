"""The trace validator (`kvstate.checker.trace`, `kvstate validate`): real traces validate, and every kind of
corruption is rejected at exactly the corrupted line with the right rule and invariant id.

Traces come from the pure `Scheduler` + `SimExecutor` (traced by the torch-free `kvstate.trace.trace_record`, the
same record the engine writes) and from the real torch `executor.Engine`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from kvstate import Scheduler, SchedulerConfig, SimExecutor, load_spec
from kvstate.checker import trace as vt
from kvstate.checker.trace import TRACE_FIELDS, TraceError, validate_trace
from kvstate.checker.trace_effects import EFFECT_RULES, BlocksBefore
from kvstate.cli import main
from kvstate.semantics import EFFECTS, EffectHooks
from kvstate.spec import RESIDENCY_TIERS
from kvstate.trace import parse_line, trace_record

SPEC = load_spec()
EDGES = {(t.event, t.source, t.dest) for t in SPEC.transitions}
TERMINAL = set(SPEC.terminal_states)
HELD = set(SPEC.states_holding("host"))  # the states whose requests may hold host blocks (residency held)
EFFECT_OF = {(t.event, t.source, t.dest): t.effect for t in SPEC.transitions}
OFFLOAD, RESUME = EffectHooks.offload_held_blocks.__name__, EffectHooks.lock_and_onboard.__name__
HOLD = EffectHooks.hold_blocks.__name__


def effect(record: dict) -> str | None:
    """The effect the spec runs on the line's edge."""
    return EFFECT_OF[(record["event"], record["from"], record["to"])]


def allows(state: str, tier: str) -> bool:
    """Whether a request in `state` may hold blocks in `tier` (its residency's tiers)."""
    return tier in RESIDENCY_TIERS[SPEC.residency(state)]


def sim_trace(host_blocks: int, pipeline_stages: int = 1, seed: int = 0) -> list[dict]:
    """A pressured, seeded SimExecutor run with one cancel, traced in the TRACE.md format."""
    records: list[dict] = []

    def tracer(request, transition) -> None:
        records.append(trace_record(sched, request, transition))

    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=12, host_blocks=host_blocks, block_size=2, prefill_chunk_size=4, pipeline_stages=pipeline_stages
        ),
        on_transition=tracer,
    )
    rng = random.Random(seed)
    for i in range(10):
        prompt = rng.randint(2, 8)
        sched.submit([rng.randrange(1000) for _ in range(prompt)], rng.randint(2, 24 - prompt), request_id=f"r{i}")
    ex = SimExecutor(sched)
    for _ in range(5):
        ex.step()
    sched.cancel("r9")
    ex.run()
    assert not sched.has_unfinished
    return records


def dumps(records: list[dict]) -> list[str]:
    return [json.dumps(r, separators=(",", ":")) + "\n" for r in records]


@pytest.fixture(scope="module")
def pressured() -> list[dict]:
    """Host tier present: suspends, offloads, resumes (of requests held on the GPU, on the host, split across both),
    recompute-pauses, replays, a cancel."""
    records = sim_trace(host_blocks=6)
    events = {r["event"] for r in records}
    assert any(r["to"] in HELD for r in records) and {r["event"] for r in records if r["to"] in HELD} < events
    assert {OFFLOAD, RESUME, HOLD} <= {effect(r) for r in records}
    assert {"gpu", "host", "split"} <= set(resumed_from(records)), "resumes of every residency split"
    return records


def resumed_from(records: list[dict]) -> list[str]:
    """Where each resumed request's blocks were just before its resume: "gpu", "host" or "split"."""
    last: dict = {}
    where = []
    for r in records:
        gpu, host = last.get(r["request_id"], (0, 0))
        if effect(r) == RESUME:
            where.append("split" if gpu and host else "host" if host else "gpu")
        last[r["request_id"]] = (r["gpu_blocks"], r["host_blocks"])
    return where


# ---------------------------------------------------------------------------------------- valid traces


@pytest.mark.parametrize("host_blocks, stages", [(6, 1), (0, 1), (6, 2)])
def test_sim_traces_validate_and_counts_match(host_blocks, stages):
    records = sim_trace(host_blocks, stages)
    report = validate_trace(dumps(records))
    assert report.ok, report.divergence.describe()
    assert report.lines == len(records)
    assert dict(report.transitions) == {e: sum(r["event"] == e for r in records) for e in report.transitions}
    assert sum(report.transitions.values()) == len(records)
    assert report.requests == 10 and set(report.final_states.values()) <= TERMINAL


def test_declared_self_loops_are_accepted_and_undeclared_stutters_rejected():
    loops = [t for t in SPEC.transitions if t.source == t.dest]
    assert loops, "the spec declares deferred terminations as self-loops"
    assert OFFLOAD in {t.effect for t in loops}, "and the offload of held blocks"
    for loop in loops:
        path = [*_path_to(loop.source), loop, *_path_to_terminal(loop.source)]
        report = validate_trace(dumps(_walk(path)))
        assert report.ok, report.divergence.describe()
        assert report.transitions[loop.event] >= 1

    first = _walk(path)
    first[0]["to"] = first[0]["from"]  # e.g. admit waiting -> waiting: no such self-loop
    assert (first[0]["event"], first[0]["from"], first[0]["to"]) not in EDGES
    assert_rejected(first, 1, vt.STUTTER)


def test_the_validator_reports_only_invariant_ids_the_spec_declares():
    assert set(vt.INVARIANT_IDS) <= {inv.id for inv in SPEC.invariants}


def test_every_effect_of_the_semantics_has_a_block_rule():
    """A new effect makes this fail until the validator says what it does to a line's blocks (or that the
    residency of its destination says it all)."""
    assert set(EFFECT_RULES) == EFFECTS
    assert {t.effect for t in SPEC.transitions if t.effect} <= set(EFFECT_RULES)


def test_empty_trace_is_valid_and_blank_lines_are_skipped_but_keep_line_numbers(pressured):
    assert validate_trace([]).ok and validate_trace([]).lines == 0
    lines = dumps(pressured)
    lines.insert(1, "\n")
    bad = dict(pressured[1], generated=-1)
    lines[2] = json.dumps(bad) + "\n"
    report = validate_trace(lines)
    assert (report.divergence.line, report.divergence.rule, report.lines) == (3, vt.FORMAT, 2)  # 2 non-blank
    assert "'generated'" in report.divergence.message


# ------------------------------------------------------------------------------------------ corruptions


def assert_rejected(
    records_or_lines,
    line: int,
    rule: str,
    invariant: str | None = None,
    *,
    field: str | None = None,
    require_done: bool = True,
):
    lines = records_or_lines if isinstance(records_or_lines[0], str) else dumps(records_or_lines)
    report = validate_trace(lines, require_done=require_done)
    assert not report.ok, f"corruption at line {line} not detected"
    d = report.divergence
    assert (d.line, d.rule, d.invariant) == (line, rule, invariant), d.describe()
    if field is not None:
        assert repr(field) in d.message, d.message
    assert d.message and d.describe().startswith(f"line {line}:")
    return d


def first(records: list[dict], predicate: Callable[[dict], bool], start: int = 1) -> int:
    """Index of the first record at or after `start` satisfying predicate (start > 0: not the very first line)."""
    return next(i for i in range(start, len(records)) if predicate(records[i]))


def test_wrong_from_state_is_rejected_with_the_held_state(pressured):
    def has_alternative(r):
        return any(e == r["event"] and d == r["to"] and s != r["from"] for e, s, d in EDGES)

    i = first(pressured, has_alternative)
    held = pressured[i]["from"]
    other = next(s for e, s, d in sorted(EDGES) if e == pressured[i]["event"] and d == pressured[i]["to"] and s != held)
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["from"] = other
    d = assert_rejected(corrupted, i + 1, vt.FROM)
    assert d.expected == held and d.observed == (pressured[i]["event"], other, pressured[i]["to"])
    assert d.request_id == pressured[i]["request_id"]


def test_edge_not_in_spec_is_rejected(pressured):
    i = len(pressured) // 2
    r = pressured[i]
    wrong = next(e.name for e in SPEC.events if (e.name, r["from"], r["to"]) not in EDGES)
    corrupted = [dict(x) for x in pressured]
    corrupted[i]["event"] = wrong
    d = assert_rejected(corrupted, i + 1, vt.EDGE)
    assert d.observed == (wrong, r["from"], r["to"])


def test_an_offload_without_host_tier_is_rejected(pressured):
    i = first(pressured, lambda r: effect(r) == OFFLOAD, 0)
    assert not any(r["host_blocks"] for r in pressured[:i]), "the run's first host blocks"
    corrupted = [dict(r) for r in pressured]
    corrupted[i].update(host_capacity=0, host_free=0)
    assert_rejected(corrupted, i + 1, vt.NO_HOST, "NO-HOST-NO-OFFLOAD", field="host_capacity")


def test_host_tier_gone_while_a_request_holds_host_blocks_is_rejected(pressured):
    i = first(pressured, lambda r: r["host_blocks"] > 0)
    holder = pressured[i]["request_id"]
    j = first(pressured, lambda r: r["request_id"] != holder, i + 1)
    last = {r["request_id"]: r["host_blocks"] for r in pressured[:j]}
    assert last[holder] > 0, "still holding host blocks at j"
    corrupted = [dict(r) for r in pressured]
    corrupted[j].update(host_capacity=0, host_free=0, host_fenced=0)
    d = assert_rejected(corrupted, j + 1, vt.NO_HOST, "NO-HOST-NO-OFFLOAD")
    named = [rid for rid, host in last.items() if host and repr(rid) in d.message]
    assert named, d.message


def test_suspension_without_a_host_tier_is_valid():
    """Suspension is lazy: without a host tier a suspended request keeps its blocks on the GPU, held, and resumes
    with no copy (the lifecycle allows it; the shipped policy's SUSPEND-ROOM rule does not do it)."""
    suspend = next(t for t in SPEC.transitions if t.effect == HOLD)
    resume = next(t for t in SPEC.transitions if t.effect == RESUME and t.source == suspend.dest)
    path = [*_path_to(suspend.source), suspend, resume, *_path_to_terminal(resume.dest)]
    lines = [dict(r, host_capacity=0, host_free=0) for r in _walk(path)]
    assert lines[1]["to"] == suspend.dest and lines[1]["gpu_blocks"] == 1
    report = validate_trace(dumps(lines))
    assert report.ok, report.divergence.describe()


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_blocks_outside_the_state_residency_are_rejected(pressured, tier):
    i = first(pressured, lambda r: not allows(r["to"], tier))
    corrupted = [dict(r) for r in pressured]
    corrupted[i][f"{tier}_blocks"] = 1
    assert_rejected(corrupted, i + 1, vt.RESIDENCY, "RES-STATE", field=f"{tier}_blocks")


def blocks_before(records: list[dict], i: int) -> tuple[int, int]:
    """The (GPU, host) blocks of line i's request as of its previous line."""
    rid = records[i]["request_id"]
    return next(((r["gpu_blocks"], r["host_blocks"]) for r in reversed(records[:i]) if r["request_id"] == rid), (0, 0))


def test_a_suspend_that_copies_its_blocks_down_is_rejected(pressured):
    """The eager suspend line of the old spec (every block on the host at once) breaks the lazy hold."""
    i = first(pressured, lambda r: effect(r) == HOLD and r["host_free"] >= r["gpu_blocks"] > 0)
    n = pressured[i]["gpu_blocks"]
    corrupted = [dict(r) for r in pressured]
    corrupted[i].update(gpu_blocks=0, host_blocks=n, gpu_fenced=corrupted[i]["gpu_fenced"] + n)
    corrupted[i]["host_free"] -= n
    d = assert_rejected(corrupted, i + 1, vt.EFFECT, field="host_blocks")
    assert "'hold_blocks'" in d.message and "moves no block" in d.message


OFFLOAD_CORRUPTIONS = {  # what an offload line claims instead: (field the validator names, invariant)
    "moved nothing": ("gpu_blocks", None),
    "lost a block on the way": ("host_blocks", None),
    "left a source unfenced": ("gpu_fenced", "FENCE"),
}


@pytest.mark.parametrize("corruption", OFFLOAD_CORRUPTIONS)
def test_an_offload_that_does_not_move_its_blocks_is_rejected(pressured, corruption):
    field, invariant = OFFLOAD_CORRUPTIONS[corruption]
    i = first(pressured, lambda r: effect(r) == OFFLOAD)
    gpu, host = blocks_before(pressured, i)
    line = dict(pressured[i])
    moved = gpu - line["gpu_blocks"]
    if corruption == "moved nothing":
        line.update(gpu_blocks=gpu, host_blocks=host, host_free=line["host_free"] + moved)
    elif corruption == "lost a block on the way":
        line.update(host_blocks=line["host_blocks"] - 1, host_free=line["host_free"] + 1)
    else:
        line.update(gpu_fenced=moved - 1, gpu_free=line["gpu_free"] + line["gpu_fenced"] - moved + 1)
    corrupted = [*pressured[:i], line, *pressured[i + 1 :]]
    d = assert_rejected(corrupted, i + 1, vt.EFFECT, invariant, field=field)
    assert "'offload_held_blocks'" in d.message


RESUME_CORRUPTIONS = {  # where the resumed request's blocks were before, and what its resume line claims
    "copied its GPU-resident blocks too": ("gpu_blocks", "RESUME-COPY"),
    "lost its GPU-resident blocks": ("gpu_blocks", "RESUME-COPY"),
    "left its host sources unfenced": ("host_fenced", "FENCE"),
}


@pytest.mark.parametrize("corruption", RESUME_CORRUPTIONS)
def test_a_resume_that_copies_other_than_its_host_blocks_is_rejected(pressured, corruption):
    field, invariant = RESUME_CORRUPTIONS[corruption]
    tier = 1 if corruption == "left its host sources unfenced" else 0  # the tier it must have held blocks in
    i = next(i for i, r in enumerate(pressured) if effect(r) == RESUME and blocks_before(pressured, i)[tier])
    gpu, host = blocks_before(pressured, i)
    line = dict(pressured[i])
    if corruption == "copied its GPU-resident blocks too":
        line.update(gpu_blocks=line["gpu_blocks"] + gpu, gpu_free=max(0, line["gpu_free"] - gpu))
    elif corruption == "lost its GPU-resident blocks":
        line.update(gpu_blocks=host, gpu_free=line["gpu_free"] + gpu)
    else:
        line.update(host_fenced=host - 1, host_free=line["host_free"] + line["host_fenced"] - host + 1)
    corrupted = [*pressured[:i], line, *pressured[i + 1 :]]
    d = assert_rejected(corrupted, i + 1, vt.EFFECT, invariant, field=field)
    assert "'lock_and_onboard'" in d.message


def test_the_effect_rules_hold_on_the_trace_format_example():
    """spec/TRACE.md's example lines (a suspend, an offload, a resume of one request) follow the effect rules."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "spec" / "TRACE.md").read_text(encoding="utf-8")
    block = text.split("```json\n", 1)[1].split("```", 1)[0]
    lines = [parse_line(raw, n) for n, raw in enumerate(block.splitlines(), 1)]
    assert [effect(r) for r in lines] == [HOLD, OFFLOAD, RESUME]
    gpu, host = lines[0]["gpu_blocks"], 0
    for r in lines[1:]:
        rule = EFFECT_RULES[effect(r)]
        assert rule is not None and rule(BlocksBefore(gpu, host, exact=True), r) is None, r
        gpu, host = r["gpu_blocks"], r["host_blocks"]


@pytest.mark.parametrize("tier, invariant", [("gpu", "CONS-GPU"), ("host", "CONS-HOST")])
def test_more_blocks_than_capacity_is_rejected(pressured, tier, invariant):
    i = first(pressured, lambda r: r[f"{tier}_blocks"] > 0)
    corrupted = [dict(r) for r in pressured]
    corrupted[i][f"{tier}_free"] = corrupted[i][f"{tier}_capacity"]
    assert_rejected(corrupted, i + 1, vt.CONSERVATION, invariant)


def test_generated_decreasing_is_rejected(pressured):
    seen: dict = {}
    at = None  # the first line of a request that had already generated a token on an earlier line
    for i, r in enumerate(pressured):
        if seen.get(r["request_id"], 0) > 0:
            at = i
            break
        seen[r["request_id"]] = r["generated"]
    assert at is not None, "the trace must have a request with a line after its first token"
    corrupted = [dict(r) for r in pressured]
    corrupted[at]["generated"] = seen[pressured[at]["request_id"]] - 1
    assert_rejected(corrupted, at + 1, vt.GENERATED, "GEN-APPEND")


def test_iteration_going_backwards_is_rejected(pressured):
    i = next(i for i in range(1, len(pressured)) if pressured[i - 1]["iteration"] >= 1)
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["iteration"] = pressured[i - 1]["iteration"] - 1
    assert_rejected(corrupted, i + 1, vt.ITERATION)


def test_gpu_capacity_changing_within_a_run_is_rejected(pressured):
    i = len(pressured) // 2
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["gpu_capacity"] += 1
    assert_rejected(corrupted, i + 1, vt.CAPACITY)


def test_malformed_json_and_non_objects_are_rejected(pressured):
    lines = dumps(pressured)
    i = len(lines) // 3
    lines[i] = lines[i][: len(lines[i]) // 2] + "\n"
    d = assert_rejected(lines, i + 1, vt.FORMAT)
    assert d.request_id is None and d.observed is None
    lines = dumps(pressured)
    lines[i] = "[1, 2]\n"
    assert_rejected(lines, i + 1, vt.FORMAT)
    lines = dumps(pressured)
    lines[i] = b"\xff\xfe{}\n"
    assert_rejected(lines, i + 1, vt.FORMAT)


@pytest.mark.parametrize("field", ["iteration", "request_id", "from", "host_fenced", "done_reason"])
def test_missing_field_is_rejected_naming_the_field(pressured, field):
    i = len(pressured) // 2
    corrupted = [dict(r) for r in pressured]
    del corrupted[i][field]
    assert_rejected(corrupted, i + 1, vt.FORMAT, field=field)


@pytest.mark.parametrize(
    "field, value",
    [
        ("gpu_blocks", "3"),
        ("gpu_free", -1),
        ("generated", True),
        ("gpu_capacity", 0),
        ("request_id", [1]),
        ("done_reason", 0),
    ],
)
def test_wrong_field_type_is_rejected_naming_the_field(pressured, field, value):
    i = len(pressured) // 2
    corrupted = [dict(r) for r in pressured]
    corrupted[i][field] = value
    assert_rejected(corrupted, i + 1, vt.FORMAT, field=field)


def test_extra_and_reordered_fields_are_rejected(pressured):
    i = 2
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["note"] = "x"
    assert_rejected(corrupted, i + 1, vt.FORMAT, field="note")
    corrupted = [dict(r) for r in pressured]
    corrupted[i] = dict(reversed(list(corrupted[i].items())))
    assert_rejected(corrupted, i + 1, vt.FORMAT, field=TRACE_FIELDS[-1])


def test_done_reason_mismatch_is_rejected(pressured):
    i = first(pressured, lambda r: r["to"] in TERMINAL)
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["done_reason"] = None
    assert_rejected(corrupted, i + 1, vt.DONE_REASON)

    j = first(pressured, lambda r: r["to"] not in TERMINAL)
    corrupted = [dict(r) for r in pressured]
    corrupted[j]["done_reason"] = pressured[i]["done_reason"]
    assert_rejected(corrupted, j + 1, vt.DONE_REASON)

    reasons = {e.done_reason for e in SPEC.events if e.done_reason}
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["done_reason"] = sorted(reasons - {pressured[i]["done_reason"]})[0]
    assert_rejected(corrupted, i + 1, vt.DONE_REASON)


def test_line_after_a_terminal_state_is_rejected(pressured):
    i = first(pressured, lambda r: r["to"] in TERMINAL)
    corrupted = [dict(r) for r in pressured] + [dict(pressured[i], iteration=pressured[-1]["iteration"])]
    d = assert_rejected(corrupted, len(corrupted), vt.FROM)
    assert d.expected in TERMINAL and f"line {i + 1}" in d.message


def test_truncated_run_is_rejected_at_the_request_last_line_unless_partial_traces_are_allowed(pressured):
    last = pressured[-1]
    assert last["to"] in TERMINAL
    previous = max(i for i, r in enumerate(pressured[:-1]) if r["request_id"] == last["request_id"])
    truncated = pressured[:-1]
    d = assert_rejected(truncated, previous + 1, vt.TERMINAL)
    assert d.request_id == last["request_id"] and d.expected == last["from"]
    report = validate_trace(dumps(truncated), require_done=False)
    assert report.ok and report.final_states[last["request_id"]] == last["from"]


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_exit_codes_and_output(pressured, tmp_path, capsys):
    good = tmp_path / "good.ndjson"
    good.write_text("".join(dumps(pressured)), encoding="utf-8")
    assert main(["validate", str(good)]) == 0
    out = capsys.readouterr().out
    assert "VALID" in out and f"{len(pressured)} lines" in out and "suspend" in out

    i = first(pressured, lambda r: not allows(r["to"], "gpu"))
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["gpu_blocks"] = 2
    bad = tmp_path / "bad.ndjson"
    bad.write_text("".join(dumps(corrupted)), encoding="utf-8")
    assert main(["validate", str(bad), "--spec", str(SPEC.source)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and f"line {i + 1}:" in out and "RES-STATE" in out
    assert repr(pressured[i]["request_id"]) in out and f"state {pressured[i]['from']!r}" in out

    truncated = tmp_path / "truncated.ndjson"
    truncated.write_text("".join(dumps(pressured[:-1])), encoding="utf-8")
    assert main(["validate", str(truncated)]) == 1
    capsys.readouterr()
    assert main(["validate", str(truncated), "--no-require-done"]) == 0
    capsys.readouterr()

    assert main(["validate", str(tmp_path / "missing.ndjson")]) == 2
    err = capsys.readouterr().err
    assert "cannot read trace file" in err and "missing.ndjson" in err
    assert main(["validate", str(good), "--spec", str(tmp_path / "nospec.toml")]) == 2
    with pytest.raises(TraceError):
        validate_trace(tmp_path)  # a directory


# --------------------------------------------------------------------------------------- real executor


def test_a_trace_written_by_the_torch_engine_validates(tmp_path):
    torch = pytest.importorskip("torch")
    from executor import Engine, EngineConfig, LlamaModel, ModelConfig
    from executor.checks import random_workload, submit_all

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaModel.from_seed(ModelConfig(), 0, dtype=torch.float64, device="cpu")
        path = tmp_path / "engine.ndjson"
        with Engine(
            EngineConfig(
                device="cpu", scheduler=SchedulerConfig(gpu_blocks=16, host_blocks=6, block_size=4), trace_path=path
            ),
            model=model,
        ) as engine:
            submit_all(engine, random_workload(10, 3, (4, 30), (8, 24)))
            for _ in range(5):
                engine.step()
            engine.cancel(next(iter(engine.scheduler.requests)))
            engine.run()
    finally:
        torch.set_num_threads(threads)
    report = validate_trace(path)
    assert report.ok, report.divergence.describe()
    assert report.lines == engine.trace.lines == sum(engine.totals.events.values())
    assert dict(report.transitions) == {e: n for e, n in engine.totals.events.items() if n}
    assert sorted(report.final_states, key=repr) == sorted(engine.scheduler.finished, key=repr)
    assert main(["validate", str(path)]) == 0


# -------------------------------------------------------------------------------------------- helpers


def _path_to(state: str) -> list:
    """The shortest list of spec transitions from the initial state to `state` (BFS over the spec)."""
    frontier, seen = [(SPEC.initial, [])], {SPEC.initial}
    while frontier:
        here, path = frontier.pop(0)
        if here == state:
            return path
        for t in SPEC.transitions:
            if t.source == here and t.dest not in seen:
                seen.add(t.dest)
                frontier.append((t.dest, [*path, t]))
    raise AssertionError(f"{state} unreachable")


def _path_to_terminal(state: str) -> list:
    t = next(t for t in SPEC.transitions if t.source == state and t.dest in TERMINAL)
    return [t]


def _walk(path: list, request_id: int = 7) -> list[dict]:
    """Trace lines for one request taking `path`, its blocks as each edge's effect leaves them (one GPU block once
    admitted; an offload moves it to the host tier, a resume brings it back); copies complete before the next line."""
    records, generated, gpu, host = [], 0, 0, 0
    for n, t in enumerate(path):
        residency = SPEC.residency(t.dest)
        generated += residency == "gpu"
        gpu_fenced = host_fenced = 0
        if t.effect == OFFLOAD:
            gpu, host, gpu_fenced = gpu - 1, host + 1, 1
        elif t.effect == RESUME:
            gpu, host, host_fenced = gpu + host, 0, host
        elif not allows(t.dest, "gpu"):
            gpu = 0
        elif not gpu:
            gpu = 1  # a first chunk's block
        if not allows(t.dest, "host"):
            host = 0
        records.append(
            {
                "iteration": n,
                "request_id": request_id,
                "event": t.event,
                "from": t.source,
                "to": t.dest,
                "gpu_blocks": gpu,
                "host_blocks": host,
                "gpu_free": 4 - gpu - gpu_fenced,
                "host_free": 4 - host - host_fenced,
                "gpu_fenced": gpu_fenced,
                "host_fenced": host_fenced,
                "gpu_capacity": 4,
                "host_capacity": 4,
                "generated": generated,
                "computed_tokens": 0,
                "done_reason": (t.done_reason or "finished") if t.dest in TERMINAL else None,
            }
        )
    return records


# --------------------------------------------------------------------------------------- exact conservation


def held_by_all(records: list[dict], tier: str) -> list[int]:
    """Per line: the blocks of `tier` every request holds as of its last line (this line included)."""
    last: dict = {}
    totals = []
    for r in records:
        last[r["request_id"]] = r[f"{tier}_blocks"]
        totals.append(sum(last.values()))
    return totals


def per_line_bound_holds(r: dict, tier: str) -> bool:
    """The old check, which saw only the line's own request."""
    return r[f"{tier}_free"] + r[f"{tier}_fenced"] + r[f"{tier}_blocks"] <= r[f"{tier}_capacity"]


def test_host_conservation_is_exact_on_real_traces(pressured):
    totals = held_by_all(pressured, "host")
    assert all(
        r["host_free"] + r["host_fenced"] + h == r["host_capacity"] for r, h in zip(pressured, totals, strict=True)
    )
    assert max(totals) > 0 and any(h > r["host_blocks"] for r, h in zip(pressured, totals, strict=True)), (
        "the trace must have lines where other requests hold host blocks"
    )


@pytest.mark.parametrize("delta", [-1, +1])
def test_a_host_block_count_off_by_one_is_rejected_at_its_line(pressured, delta):
    """An offload line claiming one block more or less in the host tier, its GPU side agreeing (so that its effect
    looks whole): only the host law over all requests sees it."""
    totals = held_by_all(pressured, "host")

    def fits(i: int, r: dict) -> bool:
        """Line i is an offload that, corrupted, still moves >= 1 block, keeps its GPU count >= 0 and passes the old
        per-line host bound (other requests hold at least `delta` host blocks)."""
        moved = blocks_before(pressured, i)[0] - r["gpu_blocks"]
        return (
            effect(r) == OFFLOAD
            and moved + delta >= 1
            and r["gpu_blocks"] - delta >= 0
            and totals[i] - r["host_blocks"] >= delta
        )

    i = next(i for i, r in enumerate(pressured) if r["host_blocks"] > 0 and fits(i, r))
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["host_blocks"] += delta
    corrupted[i]["gpu_blocks"] -= delta
    corrupted[i]["gpu_fenced"] += delta
    assert per_line_bound_holds(corrupted[i], "host"), "the old per-line bound would have missed it"
    d = assert_rejected(corrupted, i + 1, vt.CONSERVATION, "CONS-HOST")
    assert f"capacity {pressured[i]['host_capacity']}" in d.message and "!=" in d.message


@pytest.mark.parametrize("field, delta", [("host_fenced", +1), ("host_free", -1)])
def test_a_host_count_off_by_one_on_another_request_line_is_rejected(pressured, field, delta):
    """On a line whose own request holds no host block, while others do: a block counted twice, or leaked."""
    totals = held_by_all(pressured, "host")
    i = next(i for i, r in enumerate(pressured) if r["host_blocks"] == 0 and totals[i] > 0 and r[field] + delta >= 0)
    corrupted = [dict(r) for r in pressured]
    corrupted[i][field] += delta
    assert per_line_bound_holds(corrupted[i], "host"), "the old per-line bound would have missed it"
    assert_rejected(corrupted, i + 1, vt.CONSERVATION, "CONS-HOST")


def test_gpu_blocks_counted_over_all_requests_catch_what_the_per_line_bound_missed(pressured):
    totals = held_by_all(pressured, "gpu")
    slack = [r["gpu_capacity"] - r["gpu_free"] - r["gpu_fenced"] - t for r, t in zip(pressured, totals, strict=True)]
    assert min(slack) >= 0  # the GPU law holds on the real trace, with last-seen counts as lower bounds
    i = next(
        i
        for i, r in enumerate(pressured)
        if r["gpu_free"] + r["gpu_fenced"] + r["gpu_blocks"] + slack[i] + 1 <= r["gpu_capacity"]
    )
    corrupted = [dict(r) for r in pressured]
    corrupted[i]["gpu_free"] += slack[i] + 1  # one more free block than there can be
    assert per_line_bound_holds(corrupted[i], "gpu"), "the old per-line bound would have missed it"
    assert_rejected(corrupted, i + 1, vt.CONSERVATION, "CONS-GPU")


# ----------------------------------------------------------------------------------- reused ids, torn lines
def test_an_id_reused_after_its_request_ended_starts_a_new_request(pressured):
    from tests.conftest import two_line_trace

    ended = two_line_trace(SPEC, "a")
    again = [dict(r, iteration=r["iteration"] + 10, generated=0) for r in two_line_trace(SPEC, "a")]
    report = validate_trace(dumps(ended + again))
    assert report.ok, report.divergence.describe()
    assert report.requests == 2 and report.final_states == {"a": ended[-1]["to"]}
    # a line that does not start from the initial state is still refused for a request that ended
    assert_rejected([*ended, dict(ended[-1], iteration=9)], 3, vt.FROM)


def torn(lines: list[str], keep: int) -> str:
    """`lines` with the last one cut after `keep` characters (no newline): a writer stopped mid-write."""
    return "".join(lines[:-1]) + lines[-1][:keep]


def test_a_torn_last_line_is_reported_and_every_line_before_it_validated(pressured, tmp_path, capsys):
    lines = dumps(pressured)
    path = tmp_path / "torn.ndjson"
    path.write_text(torn(lines, len(lines[-1]) // 2), encoding="utf-8")
    report = validate_trace(path, require_done=False)
    assert report.ok and report.torn_line == len(lines) and report.lines == len(lines) - 1
    assert main(["validate", "--no-require-done", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"line {len(lines)}, the last, is torn" in out and f"VALID {path}: {len(lines) - 1} lines" in out
    report = validate_trace(path)  # the torn line would have ended a request: now reported as not done
    assert report.torn_line == len(lines) and report.divergence.rule == vt.TERMINAL
    assert main(["validate", str(path)]) == 1 and "is torn" in capsys.readouterr().out


def test_a_cut_line_that_is_not_the_last_is_unusable(pressured, tmp_path):
    lines = dumps(pressured)
    path = tmp_path / "cut.ndjson"
    path.write_text("".join(lines[:3]) + lines[3][:20] + "\n" + "".join(lines[4:]), encoding="utf-8")
    report = validate_trace(path)
    assert report.torn_line is None and report.divergence.rule == vt.FORMAT and report.divergence.line == 4
    whole_last = tmp_path / "whole.ndjson"  # a whole last line without its newline is just a line
    whole_last.write_text(torn(lines, len(lines[-1]) - 1), encoding="utf-8")
    assert validate_trace(whole_last).ok and validate_trace(whole_last).torn_line is None
