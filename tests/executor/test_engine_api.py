"""The engine's API: validation, cancel, streaming, host-tier fallback, leaks, statistics."""

from __future__ import annotations

import pytest
import torch

from executor import Engine, EngineConfig, HostTierFallbackWarning, InvalidTokenId, LlamaModel, SamplingParams
from executor.checks import leaked_blocks, mismatches, random_workload, submit_all
from kvstate.config import ConfigError, RequestRejected, SchedulerConfig
from kvstate.scheduler import UnknownRequestId


def test_token_ids_outside_the_vocabulary_are_refused(make_engine):
    engine = make_engine(gpu_blocks=8)
    with pytest.raises(InvalidTokenId, match="vocabulary has 512 ids") as info:
        engine.add_request([1, 2, 512], 4)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RequestRejected)
    with pytest.raises(InvalidTokenId, match="stop_token_ids"):
        engine.add_request([1, 2], 4, stop_token_ids=[9999])
    assert not engine.scheduler.has_unfinished


def test_scheduler_validation_is_delegated(make_engine):
    engine = make_engine(gpu_blocks=2, block_size=4)
    with pytest.raises(RequestRejected, match="can never fit"):
        engine.add_request([1, 2, 3], 6)
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request([], 2)
    with pytest.raises(RequestRejected, match="max_new_tokens"):
        engine.add_request([1], 0)
    rid = engine.add_request(torch.tensor([1, 2]), 2, request_id="x")
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request([1], 1, request_id="x")
    assert rid == "x"


def test_config_errors_are_clear(tiny_model):
    with pytest.raises(ConfigError, match="gpu_blocks"):
        Engine(EngineConfig(device="cpu", scheduler=SchedulerConfig(gpu_blocks=0)), model=tiny_model)
    with pytest.raises(ValueError, match="dtype"):
        Engine(EngineConfig(device="cpu", dtype="int8"), model=tiny_model)
    with pytest.raises(ValueError, match="shared model"):
        Engine(EngineConfig(device="cpu", dtype="float32"), model=tiny_model)


def test_no_leak_after_run(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=8, block_size=4)
    submit_all(engine, random_workload(10, 8, (4, 30), (4, 20)))
    engine.run()
    assert len(engine.scheduler.finished) == 10 and not engine.scheduler.has_unfinished
    assert leaked_blocks(engine) == 0
    assert engine.cache.num_copies > 0  # pressure reached the copy path


def test_host_tier_allocation_failure_falls_back_to_gpu_only(tiny_model):
    with pytest.warns(HostTierFallbackWarning, match="GPU-only"):
        sizes = SchedulerConfig(gpu_blocks=16, host_blocks=8, block_size=4)
        engine = Engine(
            EngineConfig(device="cpu", scheduler=sizes, check_invariants=True, simulate_host_alloc_failure=True),
            model=tiny_model,
        )
    with engine:
        assert engine.cache.host_cache is None and not engine.scheduler.pool.has_host_tier
        assert engine.scheduler.host_tier_fallback and engine.stats().host_tier_fallback
        submit_all(engine, random_workload(12, 2, (4, 30), (4, 24)))
        stats = engine.step()
        assert stats.host_tier_fallback
        outputs = engine.run()
        assert engine.totals.suspensions == 0 and engine.totals.recompute_pauses > 0
        assert engine.stats().host_tier_fallback
        assert not mismatches(engine, outputs)
        assert leaked_blocks(engine) == 0


def test_cancel_mid_run(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4)
    ids = submit_all(engine, random_workload(12, 1, (4, 30), (8, 24)))
    cancelled = {}
    for _ in range(200):
        engine.step()
        for state in ("running", "suspended", "recompute_paused", "replaying", "waiting"):
            if state in cancelled:
                continue
            victim = next((r for r in engine.scheduler.requests.values() if r.state == state), None)
            if victim is not None and (state == "waiting" or victim.generated):
                engine.cancel(victim.request_id)
                cancelled[state] = victim.request_id
        if len(cancelled) >= 3:
            break
    assert {"running", "waiting"} <= set(cancelled)
    outputs = engine.run()
    finished = engine.scheduler.finished
    for rid in cancelled.values():
        assert finished[rid].done_reason == "cancelled"
        full = engine.reference_outputs([rid])[rid]
        assert outputs[rid] == full[: len(outputs[rid])] and len(outputs[rid]) < len(full)
    assert sum(r.done_reason == "finished" for r in finished.values()) == len(ids) - len(cancelled)
    assert not mismatches(engine, outputs)
    assert leaked_blocks(engine) == 0
    with pytest.raises(UnknownRequestId, match="already finished"):
        engine.cancel(next(iter(cancelled.values())))


def test_stream_yields_exactly_the_final_outputs(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4, prefill_chunk_size=6)
    submit_all(engine, random_workload(10, 9, (4, 30), (4, 20)), SamplingParams(temperature=0.9, top_k=40))
    streamed: dict = {}
    for rid, token in engine.stream():
        streamed.setdefault(rid, []).append(token)
    assert streamed == engine.outputs()
    assert engine.totals.suspensions + engine.totals.recompute_pauses > 0
    assert not mismatches(engine)


def test_stream_consumer_may_cancel(make_engine):
    engine = make_engine(gpu_blocks=32, block_size=4)
    a = engine.add_request([1, 2, 3], 20)
    b = engine.add_request([4, 5, 6], 20)
    streamed: dict = {}
    for rid, token in engine.stream():
        streamed.setdefault(rid, []).append(token)
        if rid == a and len(streamed[a]) == 3:
            engine.cancel(a)
    assert streamed == engine.outputs()
    assert len(streamed[a]) == 3 and len(streamed[b]) == 20


def test_stop_tokens_end_requests_like_the_reference(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=4, block_size=4)
    work = random_workload(8, 12, (4, 20), (10, 20))
    for prompt, new in work:
        full = engine.reference(prompt, new)
        engine.add_request(prompt, new, stop_token_ids=[full[len(full) // 2]])
    outputs = engine.run()
    assert any(len(out) < new for out, (_, new) in zip(outputs.values(), work, strict=True))
    assert not mismatches(engine, outputs)


def test_step_statistics(make_engine):
    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4)
    submit_all(engine, random_workload(12, 1, (4, 30), (4, 24)))
    generated = migrated = 0
    while engine.scheduler.has_unfinished:
        stats = engine.step()
        generated += stats.generated_tokens
        migrated += stats.bytes_migrated
        assert stats.gpu_capacity == 16 and stats.host_capacity == 6
    assert generated == sum(len(o) for o in engine.outputs().values()) == engine.totals.generated_tokens
    assert migrated == engine.totals.bytes_migrated > 0
    assert engine.stats().requests_per_state["done"] == 12


def test_the_statistics_type_a_step_returns_is_exported_by_executor(make_engine):
    import executor

    engine = make_engine(gpu_blocks=16, host_blocks=6, block_size=4)
    submit_all(engine, random_workload(2, 1, (4, 8), (2, 4)))
    assert "IterationStats" in executor.__all__
    assert type(engine.step()) is executor.IterationStats is type(engine.stats())


def test_reference_ignores_pressure_settings(tiny_model):
    big = Engine(EngineConfig(device="cpu", scheduler=SchedulerConfig(gpu_blocks=64, block_size=16)), model=tiny_model)
    small = Engine(
        EngineConfig(
            device="cpu", scheduler=SchedulerConfig(gpu_blocks=5, host_blocks=2, block_size=2, prefill_chunk_size=3)
        ),
        model=tiny_model,
    )
    prompt = list(range(40, 50))
    assert big.reference(prompt, 7) == small.reference(prompt, 7)
    assert len(big.reference(prompt, 7)) == 7


def test_default_engine_builds_its_own_seeded_model():
    with (
        Engine(EngineConfig(device="cpu", scheduler=SchedulerConfig(gpu_blocks=8), weights_seed=1)) as a,
        Engine(EngineConfig(device="cpu", scheduler=SchedulerConfig(gpu_blocks=8), weights_seed=1)) as b,
    ):
        assert a.model.dtype == torch.float64
        assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
        assert a.model is not b.model
    assert isinstance(a.model, LlamaModel)


@pytest.mark.parametrize(
    ("request_id", "needle"),
    [("\ud800", "not Unicode text"), ("x" * 65_000, "65000 characters"), (10**19, "more than 19 digits")],
    ids=["lone-surrogate", "long-string", "long-integer"],
)
def test_an_id_no_trace_could_carry_is_refused_at_submission(make_engine, request_id, needle):
    """The engine refuses an id its trace (UTF-8, bounded lines) could not carry, rather than a report failing
    on it later."""
    engine = make_engine(gpu_blocks=8)
    with pytest.raises(RequestRejected, match=needle) as info:
        engine.add_request([1, 2], 2, request_id=request_id)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    assert not engine.scheduler.has_unfinished
