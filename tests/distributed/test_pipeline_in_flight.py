"""Several micro-batches in flight on 2 and 3 gloo ranks: rank 0 schedules the next micro-batch while later stages
compute earlier ones, so a request recompute-paused while its decode step is in flight can receive its final token
while it awaits consensus. The workload (no host tier: every victim is recompute-paused; stop tokens: a request can
end before its budget, so its final step is not protected by VICTIM-NOT-FINAL) makes that happen; the tests count it
and check that such requests end `done`/finished with the reference output, never replayed, their blocks released
once, every rank's trace valid. Lockstep (`micro_batches=1`) stays selectable and gives the same outputs.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from executor import Engine, EngineConfig, ModelConfig
from executor.checks import random_workload
from executor.pipeline import PipelineConfig, PipelineRequest, run_pipeline
from kvstate import SchedulerConfig

from .conftest import check_trace

SMALL_DEMO = ["--gpu-blocks", "12", "--block-size", "4"]  # a GPU tier of 12 blocks of 4 tokens: small, so pressured

pytestmark = pytest.mark.distributed
TIMEOUT_S = 60.0
PENDING = "awaiting_consensus"
GPU_BLOCKS, BLOCK_SIZE = 12, 4
STOP_SHARE = 0.1  # each request stops at any of this share of the vocabulary (seeded per request)
SEED = 4  # with these settings, 1 (2 stages) and 2 (3 stages) requests finish while awaiting consensus (seed 5 gave
# 1 and 5 before policy P1 made a requester with no eligible victim wait instead of pausing itself)


def engine_config(stages: int) -> EngineConfig:
    scheduler = SchedulerConfig(
        gpu_blocks=GPU_BLOCKS, host_blocks=0, block_size=BLOCK_SIZE, prefill_chunk_size=16, max_num_tokens=64
    )
    return EngineConfig(
        scheduler=scheduler, device="cpu", check_invariants=True, model=ModelConfig(num_layers=max(2, stages))
    )


def stop_workload(count: int = 24, seed: int = SEED) -> list[PipelineRequest]:
    rng = random.Random(seed)
    vocab = ModelConfig().vocab_size
    return [
        PipelineRequest(prompt, new, tuple(rng.sample(range(vocab), int(vocab * STOP_SHARE))), request_id=rid)
        for rid, (prompt, new) in enumerate(
            random_workload(count, seed, (4, 30), (8, 24), max_tokens=GPU_BLOCKS * BLOCK_SIZE)
        )
    ]


def references(engine: EngineConfig, work: list[PipelineRequest]) -> dict:
    with Engine(replace(engine, check_invariants=False)) as oracle:
        return {
            r.request_id: oracle.reference(
                r.prompt, r.max_new_tokens, stop_token_ids=r.stop_token_ids, request_id=r.request_id
            )
            for r in work
        }


def run(stages: int, micro_batches: int | None = None):
    engine, work = engine_config(stages), stop_workload()
    config = PipelineConfig(engine=engine, timeout_s=TIMEOUT_S, max_iterations=3000, micro_batches=micro_batches)
    return work, engine, run_pipeline(config, work, world_size=stages)


@pytest.fixture(scope="module", params=[2, 3], ids=["2_stages", "3_stages"])
def in_flight(request):
    return request.param, *run(request.param)


def finished_during_consensus(trace) -> list:
    return [
        line["request_id"]
        for line in trace
        if (line["event"], line["from"], line["to"]) == ("finish", PENDING, PENDING)
    ]


def test_requests_finish_while_awaiting_consensus_and_are_terminated_not_replayed(in_flight):
    stages, work, engine, result = in_flight
    driver = result.driver
    assert driver.micro_batches == stages and [r.micro_batches for r in result.ranks] == [stages] * stages
    during = finished_during_consensus(driver.trace)
    print(
        f"{stages} stages, {stages} micro-batches in flight: {len(during)} request(s) finished during consensus "
        f"{during}; {driver.totals['events'].get('recompute_pause', 0)} recompute-pauses"
    )
    assert during, "the workload must make a request receive its final token while it awaits consensus"
    refs = references(engine, work)
    for rid in during:
        lines = [
            (line["event"], line["from"], line["to"], line["gpu_blocks"])
            for line in driver.trace
            if line["request_id"] == rid
        ]
        at = [edge[:3] for edge in lines].index(("finish", PENDING, PENDING))
        assert lines[at - 1][:3] in {("recompute_pause", "running", PENDING), ("cancel", PENDING, PENDING)}
        assert lines[at - 1][3] > 0 and lines[at][3] > 0  # it kept its GPU blocks until consensus
        assert [edge[:3] for edge in lines[at + 1 :]] == [("consensus", PENDING, "done")]  # never replayed after
        assert lines[-1][3] == 0  # consensus released its blocks, and nothing later touches them
        assert driver.done_reasons[rid] == "finished" and result.outputs[rid] == refs[rid]
        for rank in result.ranks:  # every rank released the pause once, agreed, to done
            records = [p for p in rank.pauses if p["request_id"] == rid]
            assert records[-1]["outcome"] == "done" and records[-1]["agreed"] <= records[-1]["released"]
            assert all(p["released"] is not None for p in records)
    assert driver.leaked_blocks == 0


def test_every_output_equals_the_reference_and_every_rank_trace_is_valid(in_flight):
    _, work, engine, result = in_flight
    refs = references(engine, work)
    assert set(result.driver.done_reasons.values()) == {"finished"}
    assert result.outputs == refs
    for rank in result.ranks:
        final = check_trace(list(rank.trace))
        assert set(final) == set(refs) and set(final.values()) == {"done"}
        assert rank.trace == result.driver.trace
    assert len({r.iterations for r in result.ranks}) == 1


def test_lockstep_stays_selectable_and_gives_the_same_outputs(in_flight):
    stages, _, _, result = in_flight
    if stages != 2:
        pytest.skip("one lockstep run is enough")
    _, _, lockstep = run(2, micro_batches=1)
    assert lockstep.driver.micro_batches == 1
    assert lockstep.outputs == result.outputs
    assert not finished_during_consensus(lockstep.driver.trace)  # nothing is in flight when a pause is decided
    assert lockstep.driver.leaked_blocks == 0


def test_the_demo_prints_in_flight_and_lockstep_throughput_side_by_side(tmp_path, capsys):
    from kvstate.cli import main

    code = main(
        [
            "demo",
            *SMALL_DEMO,
            "--pp",
            "2",
            "--requests",
            "6",
            "--host-blocks",
            "4",
            "--device",
            "cpu",
            "--trace",
            str(tmp_path / "t.ndjson"),
            "--compare-lockstep",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    found = re.search(r"2 micro-batches in flight ([\d,]+) tokens/s vs lockstep ([\d,]+) tokens/s: ([\d.]+)x", out)
    assert found, out
    flight, lockstep = (int(found[i].replace(",", "")) for i in (1, 2))
    assert float(found[3]) == pytest.approx(flight / lockstep, rel=0.1)
