"""Memory-tier faults: each maps to spec events, loses no block and no token, and the engine keeps serving.

Scheduler level (`Scheduler.fail_migration`, driven by the slot-level simulator, whose output changes when a
block is lost or stale) and engine level (`EngineConfig.faults`, a seeded `FaultPlan`, on the real executor with
invariants checked around every step). Every scenario also asserts that its fault really happened, so a
workload change cannot turn it into a fault-free test.
"""

from __future__ import annotations

import random
import warnings

import pytest

from executor import FAULT_KINDS, FaultInjector, FaultPlan, FaultPlanError, FaultSpec, HostTierFallbackWarning
from executor.checks import leaked_blocks, random_workload, submit_all
from kvstate import load_spec
from kvstate.config import SchedulerConfig
from kvstate.errors import PoolError
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan
from kvstate.scheduler import Scheduler, Step
from kvstate.sim import SimExecutor, reference_output

SPEC = load_spec()
EDGES = {(t.source, t.event, t.dest) for t in SPEC.transitions}


# ------------------------------------------------------------------------------------------ fault plans
def test_fault_plan_parses_the_cli_forms():
    plan = FaultPlan.parse(["copy_to_host:0.25", "host_loss@3,9", "corrupt_host"], seed=5)
    assert plan.spec("copy_to_host") == FaultSpec("copy_to_host", 0.25)
    assert plan.spec("host_loss").iterations == frozenset({3, 9})
    assert plan.spec("corrupt_host").rate > 0  # its default rate
    assert plan.spec("copy_to_gpu") is None
    assert FaultPlan.parse(str(plan).split(), seed=5) == plan  # str() writes the CLI forms back
    assert plan.fires("host_loss", 3) and plan.fires("host_loss", 9)


@pytest.mark.parametrize(
    "text, message",
    [
        ("melt_gpu", "unknown fault kind 'melt_gpu'"),
        ("copy_to_host:2", r"probability in \[0, 1\]"),
        ("copy_to_host:often", "is not a number"),
        ("host_loss@soon", "iterations must be integers"),
        ("host_loss@", "no iteration"),
    ],
)
def test_fault_plan_refuses_malformed_options(text, message):
    with pytest.raises(FaultPlanError, match=message) as info:
        FaultPlan.parse([text], seed=0)
    assert isinstance(info.value, ValueError)


def test_fault_plan_refuses_a_kind_twice_and_an_unseeded_plan():
    with pytest.raises(FaultPlanError, match="more than once"):
        FaultPlan.parse(["copy_to_gpu:0.1", "copy_to_gpu:0.2"], seed=0)
    with pytest.raises(FaultPlanError, match="seed must be an integer"):
        FaultPlan(None, ())  # type: ignore[arg-type]


def test_fault_decisions_depend_only_on_seed_kind_iteration_and_key():
    plan = FaultPlan.of(11, copy_to_host=0.3)
    questions = [(i, f"r{k}") for i in range(200) for k in range(3)]
    forward = [plan.fires("copy_to_host", i, key) for i, key in questions]
    backward = [plan.fires("copy_to_host", i, key) for i, key in reversed(questions)][::-1]
    assert forward == backward  # no hidden stream: order does not matter
    assert 0.2 < sum(forward) / len(forward) < 0.4  # the rate is honoured (600 draws)
    other = FaultPlan.of(12, copy_to_host=0.3)
    assert forward != [other.fires("copy_to_host", i, key) for i, key in questions]  # the seed matters
    assert not any(plan.fires("copy_to_gpu", i, key) for i, key in questions)  # kinds not in the plan never fire


def test_injector_counts_what_fired():
    injector = FaultInjector(FaultPlan.of(0, host_loss=[4, 6]))
    fired = [i for i in range(10) if injector.fire("host_loss", i)]
    assert fired == [4, 6] and injector.injected == {"host_loss": 2}
    assert injector.log == [(4, "host_loss", 0), (6, "host_loss", 0)]
    assert set(FAULT_KINDS) == {"host_alloc", "copy_to_host", "copy_to_gpu", "corrupt_host", "host_loss"}


# ------------------------------------------------------------------------------- Scheduler.fail_migration
def _pressured(seed: int, host_blocks: int = 6, **kw) -> tuple[Scheduler, SimExecutor]:
    sched = Scheduler(
        SchedulerConfig(
            gpu_blocks=12, host_blocks=host_blocks, block_size=2, prefill_chunk_size=6, max_num_tokens=16, **kw
        )
    )
    rng = random.Random(seed)
    for _ in range(10):
        p = rng.randint(2, 10)
        sched.submit([rng.randrange(1000) for _ in range(p)], rng.randint(2, 24 - p))
    return sched, SimExecutor(sched)


def _step_failing(ex: SimExecutor, fails) -> list:
    """`SimExecutor.step`, but every plan for which `fails(plan)` is true is reported failed instead of copied
    (its destination slots are scribbled on first, as a copy that failed half-way would leave them), and the step
    carries on with the amended output."""
    sched = ex.scheduler
    step = Step.begin(sched)
    sched.check_invariants(step.output)
    as_scheduled = step.scheduled.to_dict()
    failed = []
    for plan in step.to_issue():
        if not fails(plan):
            step.issued(plan, ex.copy(plan))
            continue
        dest = ex.host if plan.direction == TO_HOST else ex.gpu
        for _, dst in plan.pairs[: len(plan.pairs) // 2]:
            dest[dst] = [-1] * len(dest[dst])  # garbage: must never be read
        before, out = sched.get(plan.request_id).state, step.output
        step.issued(plan, None)  # the copy failed: Scheduler.fail_migration, then the amended output
        failure, amended = step.failures[-1], step.output
        request = failure.request
        assert failure.plan == plan and request is sched.get(plan.request_id) and amended == out.amended(failure)
        assert failure.event == ("lose_host_copy" if plan.direction == TO_HOST else "recompute_pause")
        edge = (before, failure.event, request.state)
        assert edge in EDGES, f"fail_migration took {edge}, which is not a spec edge"
        assert plan not in amended.migrations and plan.plan_id not in sched.pool.in_flight
        assert request in amended.recompute_paused and request not in amended.suspended + amended.resumed
        assert plan in out.migrations and request not in out.recompute_paused  # the amended output is unchanged
        sched.check_invariants(amended)  # OUT-DISJOINT, OUT-STATE, conservation, residency
        failed.append(plan)
    assert step.scheduled.to_dict() == as_scheduled  # schedule()'s output is never mutated
    for plan, _ in step.to_wait():
        step.waited(plan)
    step.complete_migrations()
    step.finish(ex.compute(step.output))
    sched.check_invariants()
    return failed


def _finish_and_check(sched: Scheduler, ex: SimExecutor) -> None:
    ex.run(5_000)
    assert not sched.has_unfinished
    for request in sched.finished.values():
        assert request.generated == reference_output(request.prompt, request.max_new_tokens)
    usage = sched.pool.usage()
    assert usage["gpu_free"] == usage["gpu_capacity"] and usage["host_free"] == usage["host_capacity"]
    assert not sched.pool.in_flight


@pytest.mark.parametrize("direction", [TO_HOST, TO_GPU])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_failed_copy_is_rolled_back_to_a_replay_and_loses_nothing(direction, seed):
    sched, ex = _pressured(seed)
    failed, generated_before = [], {}
    for _ in range(400):
        if not sched.has_unfinished:
            break
        generated_before = {r.request_id: list(r.generated) for r in sched.requests.values()}
        for plan in _step_failing(ex, lambda p: p.direction == direction):
            request = sched.get(plan.request_id)
            failed.append(plan)
            assert request.state == "recompute_paused" and request.num_gpu_blocks == request.num_host_blocks == 0
            # GEN-APPEND and RESET-PROMPT: its tokens are kept and become part of the replay prompt
            assert (
                request.generated[: len(generated_before[request.request_id])] == generated_before[request.request_id]
            )
            assert request.prefill_tokens == request.prompt + tuple(request.generated)
    assert failed, f"no {direction} migration happened, the workload needs more pressure"
    _finish_and_check(sched, ex)


def _schedule_until(sched: Scheduler, ex: SimExecutor, direction: str):
    """Step until a pass plans a `direction` migration; returns that (uncompleted) output and plan."""
    for _ in range(300):
        out = sched.schedule()
        plan = next((p for p in out.migrations if p.direction == direction), None)
        if plan is not None:
            return out, plan
        sampled = ex.compute(out)
        sched.complete_migrations(out)
        sched.complete_step(out, sampled)
    raise AssertionError(f"no {direction} migration was planned")


def _snapshot(sched: Scheduler):
    return (
        {r.request_id: (r.state, tuple(r.generated)) for r in sched.requests.values()},
        sched.pool.usage(),
        sorted(sched.pool.in_flight),
    )


def test_fail_migration_refuses_what_it_cannot_undo_and_changes_nothing():
    sched, ex = _pressured(0)
    out, plan = _schedule_until(sched, ex, TO_HOST)
    amended = out.amended(sched.fail_migration(out, plan))
    before = _snapshot(sched)
    for output in (out, amended):  # the output it was planned in, and the amended one carried on with
        with pytest.raises(PoolError, match="not an in-flight migration of this output"):
            sched.fail_migration(output, plan)  # reported twice
    stranger = MigrationPlan(10_000, plan.request_id, TO_HOST, plan.pairs)
    with pytest.raises(PoolError, match="not an in-flight migration of this output"):
        sched.fail_migration(amended, stranger)  # not a plan of this output
    assert _snapshot(sched) == before
    sched.check_invariants(amended)


def test_a_step_completes_migrations_only_once_every_plan_is_waited_on_or_failed():
    sched, ex = _pressured(0)
    for _ in range(300):
        step = Step.begin(sched)
        if step.output.migrations:
            break
        step.finish(ex.compute(step.output))
    else:
        raise AssertionError("no migration was planned")
    plans = step.to_issue()
    with pytest.raises(PoolError, match=f"{len(plans)} migration plans .* are not yet issued or waited on"):
        step.complete_migrations()
    assert sorted(sched.pool.in_flight) == sorted(p.plan_id for p in plans)  # nothing was told
    for plan in plans:
        step.issued(plan, ex.copy(plan))
    with pytest.raises(PoolError, match="not yet issued or waited on"):
        step.complete_migrations()  # issued, not waited on (a failed plan needs no wait: _step_failing)
    assert [p for p, _ in step.to_wait()] == plans and step.to_issue() == []
    for plan, _ in step.to_wait():
        step.waited(plan)
    step.complete_migrations()
    assert not sched.pool.in_flight
    step.finish(ex.compute(step.output))
    sched.check_invariants()


def test_fail_migration_refuses_a_request_that_ended_since_the_pass():
    sched, ex = _pressured(1)
    out, plan = _schedule_until(sched, ex, TO_GPU)
    sched.cancel(plan.request_id)
    before = _snapshot(sched)
    with pytest.raises(PoolError, match="only an offload or resume whose request still waits for the copy can fail"):
        sched.fail_migration(out, plan)
    assert _snapshot(sched) == before
    sched.complete_migrations(out)  # the copy still completes normally and frees its fenced blocks
    sched.check_invariants()


def test_fail_migration_with_two_pipeline_stages_waits_for_consensus():
    sched, ex = _pressured(3, pipeline_stages=2)
    seen = []
    for _ in range(400):
        if not sched.has_unfinished:
            break
        sched.reach_consensus()
        for plan in _step_failing(ex, lambda p: p.direction == TO_GPU):
            seen.append(sched.get(plan.request_id).state)
    assert "awaiting_consensus" in seen
    _finish_and_check(sched, ex)


# ------------------------------------------------------------------------------------ engine: each fault
def _run_faulty(make_engine, faults: FaultPlan, *, count: int = 14, seed: int = 1, **config):
    settings = {"gpu_blocks": 16, "host_blocks": 8, "block_size": 4, "faults": faults, **config}
    engine = make_engine(**settings)
    submit_all(engine, random_workload(count, seed, (4, 30), (4, 24)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostTierFallbackWarning)
        outputs = engine.run()
    return engine, outputs


def _assert_served(engine, outputs):
    """Every request finished, equal to its unpressured reference, and every block is free again."""
    assert not engine.scheduler.has_unfinished
    assert all(r.done_reason == "finished" for r in engine.scheduler.finished.values())
    references = engine.batched_reference_outputs()
    differ = [rid for rid in references if outputs[rid] != references[rid]]
    assert not differ, f"outputs of {differ} differ from their references"
    assert leaked_blocks(engine) == 0, engine.scheduler.pool.usage()


def test_failed_copies_to_host_become_lost_host_copies(make_engine):
    engine, outputs = _run_faulty(make_engine, FaultPlan.of(1, copy_to_host=0.4))
    injected = engine.totals.faults["copy_to_host"]
    assert injected > 0 and engine.totals.failed_copies == injected
    assert engine.totals.events["lose_host_copy"] == injected
    _assert_served(engine, outputs)


def test_failed_copies_to_gpu_become_recompute_pauses(make_engine):
    clean, _ = _run_faulty(make_engine, FaultPlan.of(1), seed=2)
    engine, outputs = _run_faulty(make_engine, FaultPlan.of(1, copy_to_gpu=0.4), seed=2)
    injected = engine.totals.faults["copy_to_gpu"]
    assert injected > 0 and engine.totals.failed_copies == injected
    assert engine.totals.events["lose_host_copy"] == 0
    assert engine.totals.recompute_pauses > clean.totals.recompute_pauses
    _assert_served(engine, outputs)


def test_corruption_is_detected_by_checksums_and_replayed(make_engine):
    engine, outputs = _run_faulty(make_engine, FaultPlan.of(2, corrupt_host=0.5), verify_host_checksums=True)
    assert engine.totals.faults["corrupt_host"] > 0
    assert engine.totals.checksum_mismatches > 0
    _assert_served(engine, outputs)


def test_without_checksums_the_same_corruption_garbles_outputs(make_engine):
    """The control of the test above: the injected corruption does matter."""
    engine, outputs = _run_faulty(make_engine, FaultPlan.of(2, corrupt_host=0.5), verify_host_checksums=False)
    assert engine.totals.faults["corrupt_host"] > 0 and engine.totals.checksum_mismatches == 0
    references = engine.batched_reference_outputs()
    assert any(outputs[rid] != references[rid] for rid in references)


def test_checksums_without_corruption_never_fire(make_engine):
    engine, outputs = _run_faulty(make_engine, FaultPlan.of(2), verify_host_checksums=True)
    assert engine.totals.suspensions > 0 and engine.totals.events["resume"] > 0
    assert engine.totals.checksum_mismatches == 0
    _assert_served(engine, outputs)


def test_host_tier_allocation_fault_falls_back_to_gpu_only(make_engine):
    with pytest.warns(HostTierFallbackWarning, match="GPU-only"):
        engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4, faults=FaultPlan.of(0, host_alloc=1.0))
    assert engine.totals.faults["host_alloc"] == 1 and engine.cache.host_cache is None
    assert engine.stats().host_tier_fallback and not engine.scheduler.pool.has_host_tier
    submit_all(engine, random_workload(12, 2, (4, 30), (4, 24)))
    outputs = engine.run()
    assert engine.totals.suspensions == 0 and engine.totals.recompute_pauses > 0
    _assert_served(engine, outputs)


def _first_iteration_with_offloaded(make_engine) -> int:
    probe = make_engine(gpu_blocks=16, host_blocks=8, block_size=4)
    submit_all(probe, random_workload(14, 1, (4, 30), (4, 24)))
    while probe.scheduler.has_unfinished:
        probe.step()
        if sum(1 for r in probe.scheduler.suspended if r.num_host_blocks) >= 2:
            return probe.scheduler.iteration
    raise AssertionError("the workload never had two suspended requests with host blocks at once")


def test_losing_the_host_tier_mid_run_replays_every_suspended_request_with_host_blocks(make_engine):
    k = _first_iteration_with_offloaded(make_engine)
    engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4, faults=FaultPlan.of(0, host_loss=[k + 1]))
    submit_all(engine, random_workload(14, 1, (4, 30), (4, 24)))
    for _ in range(k):
        engine.step()
    offloaded = [r.request_id for r in engine.scheduler.suspended if r.num_host_blocks]
    assert len(offloaded) >= 2  # deterministic: the same state as the probe
    with pytest.warns(
        HostTierFallbackWarning, match=f"{len(offloaded)} suspended requests with host blocks will be replayed"
    ):
        engine.step()
    assert engine.totals.faults["host_loss"] == 1 and engine.totals.host_tier_losses == 1
    assert engine.totals.events["lose_host_copy"] == len(offloaded)
    assert engine.cache.host_cache is None and not engine.scheduler.pool.has_host_tier
    assert engine.stats().host_tier_fallback
    suspensions, offloads = engine.totals.suspensions, engine.totals.events["offload"]
    outputs = engine.run()
    assert engine.totals.suspensions == suspensions  # GPU-only from then on (SUSPEND-ROOM: no host tier)
    assert engine.totals.events["offload"] == offloads  # NO-HOST-NO-OFFLOAD
    _assert_served(engine, outputs)


def test_lose_host_tier_by_hand_between_steps(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4)
    submit_all(engine, random_workload(14, 1, (4, 30), (4, 24)))
    while not engine.scheduler.suspended:
        engine.step()
    expected = sorted(map(str, (r.request_id for r in engine.scheduler.suspended if r.num_host_blocks)))
    with pytest.warns(HostTierFallbackWarning):
        lost = engine.lose_host_tier("operator removed the host tier")
    assert sorted(map(str, lost)) == expected
    assert engine.lose_host_tier() == []  # already gone: nothing more to lose
    _assert_served(engine, engine.run())


def test_a_lost_host_tier_leaves_requests_held_on_the_gpu_suspended(make_engine):
    """Only a host copy can be lost: a suspended request whose blocks are all still on the GPU stays suspended
    when the host tier goes, and resumes later without a copy."""
    engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4, verify_host_checksums=True)
    submit_all(engine, random_workload(14, 1, (4, 30), (4, 24)))
    while not any(r.num_host_blocks == 0 for r in engine.scheduler.suspended):
        assert engine.scheduler.has_unfinished, "the workload never held a suspended request wholly on the GPU"
        engine.step()
    on_gpu = {r.request_id: r.num_gpu_blocks for r in engine.scheduler.suspended if not r.num_host_blocks}
    offloaded = {r.request_id for r in engine.scheduler.suspended if r.num_host_blocks}
    relocked, without = engine.totals.blocks_relocked, engine.totals.resumed_without_copy
    with pytest.warns(HostTierFallbackWarning):
        lost = engine.lose_host_tier("operator removed the host tier")
    assert set(lost) == offloaded and not engine._host_tier.checksums
    suspended = engine.scheduler.spec.role("offloaded")
    assert all(engine.scheduler.get(rid).state == suspended for rid in on_gpu)
    assert all(engine.scheduler.pool.gpu_blocks(rid) and not engine.scheduler.pool.host_blocks(rid) for rid in on_gpu)
    _assert_served(engine, engine.run())
    assert engine.totals.resumed_without_copy >= without + len(on_gpu)
    assert engine.totals.blocks_relocked >= relocked + sum(on_gpu.values())


def test_every_fault_at_once_with_cancellations(make_engine):
    faults = FaultPlan.of(7, copy_to_host=0.2, copy_to_gpu=0.2, corrupt_host=0.3, host_loss=[60])
    engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4, faults=faults, verify_host_checksums=True)
    ids = submit_all(engine, random_workload(16, 3, (4, 30), (4, 24)))
    rng = random.Random(3)
    cancelled = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostTierFallbackWarning)
        while engine.scheduler.has_unfinished:
            engine.step()
            active = sorted(engine.scheduler.requests, key=str)
            if active and rng.random() < 0.05:
                victim = rng.choice(active)
                engine.cancel(victim)
                cancelled.add(victim)
    finished = engine.scheduler.finished
    assert set(finished) == set(ids)
    assert {rid for rid, r in finished.items() if r.done_reason == "cancelled"} == cancelled
    assert sum(engine.totals.faults.values()) >= 3 and len(engine.totals.faults) >= 2
    references = engine.batched_reference_outputs()
    for rid, request in finished.items():
        if request.done_reason == "finished":
            assert request.generated == references[rid]
        else:
            assert request.generated == references[rid][: len(request.generated)]
    assert leaked_blocks(engine) == 0


def test_a_faulty_run_leaves_a_trace_of_spec_edges_only(make_engine, tmp_path):
    """Every transition the faults cause is a spec edge, each request's chain is unbroken, and it ends done."""
    from kvstate.trace import read_trace

    path = tmp_path / "faults.ndjson"
    faults = FaultPlan.of(4, copy_to_host=0.3, copy_to_gpu=0.3, corrupt_host=0.3, host_loss=[80])
    engine, outputs = _run_faulty(make_engine, faults, trace_path=path, verify_host_checksums=True)
    engine.close()
    last: dict = {}
    events = set()
    for line in read_trace(path):
        assert (line["from"], line["event"], line["to"]) in EDGES, line
        assert last.get(line["request_id"], SPEC.initial) == line["from"], line
        last[line["request_id"]] = line["to"]
        events.add(line["event"])
    assert set(last.values()) == set(SPEC.terminal_states) and set(last) == set(outputs)
    assert {"lose_host_copy", "recompute_pause", "resume", "suspend"} <= events
    _assert_served(engine, outputs)


def test_demo_with_injected_faults_still_passes(capsys, tmp_path):
    from kvstate.cli import main

    argv = [
        "demo",
        "--device",
        "cpu",
        "--requests",
        "16",
        "--seed",
        "2",
        "--trace",
        str(tmp_path / "t.ndjson"),
        "--inject",
        "copy_to_host:0.3",
        "--inject",
        "copy_to_gpu:0.3",
        "--inject",
        "corrupt_host:0.5",
    ]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "OUTPUT EQUIVALENCE: PASS" in out and "faults injected" in out and "copy_to_host" in out
