"""Two gloo ranks on the CPU: outputs equal the single-process oracle under memory pressure (with and without a
host tier), nothing resets before every stage acknowledged, a cancel during pending consensus terminates, one
rank's host-tier failure makes every rank fall back, and every rank's trace follows the spec.

Each scenario is one `run_pipeline` call (module-scoped: two process starts are the expensive part), bounded by
`timeout_s` so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from executor.pipeline import PipelineConfig, run_pipeline

from .conftest import check_trace, pressured, references, workload

pytestmark = pytest.mark.distributed
TIMEOUT_S = 30.0
MAX_ITERATIONS = 1000  # a livelock fails fast with PipelineFailed instead of running into the timeout


def _run(engine, **pipeline):
    work = workload()
    config = PipelineConfig(engine=engine, timeout_s=TIMEOUT_S, max_iterations=MAX_ITERATIONS, **pipeline)
    return work, engine, run_pipeline(config, work, world_size=2)


@pytest.fixture(scope="module")
def with_host(tmp_path_factory):
    """Host tier present; rank 1 acknowledges 1 iteration late; the first paused request is cancelled."""
    trace = tmp_path_factory.mktemp("with_host") / "trace.ndjson"
    return _run(pressured(trace_path=trace), ack_delay=((1, 1),), cancel_awaiting=1)


@pytest.fixture(scope="module")
def no_host():
    """No host tier (every eviction a recompute-pause); rank 0 acknowledges 1 iteration late."""
    return _run(pressured(host_blocks=0), ack_delay=((0, 1),), cancel_awaiting=1)


@pytest.fixture(scope="module")
def rank1_host_fails():
    """A host tier is asked for, but rank 1 cannot allocate it."""
    return _run(pressured(host_blocks=6), fail_host_tier_on_ranks={1})


SCENARIOS = ["with_host", "no_host", "rank1_host_fails"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_outputs_equal_the_single_process_oracle(scenario, request):
    work, engine, result = request.getfixturevalue(scenario)
    driver = result.driver
    refs = references(engine, work)
    finished = {rid for rid, reason in driver.done_reasons.items() if reason == "finished"}
    assert len(finished) >= len(work) - 1 and set(driver.done_reasons) == set(range(len(work)))
    assert {rid: result.outputs[rid] for rid in finished} == {rid: refs[rid] for rid in finished}
    assert driver.totals["events"]["recompute_pause"] > 0, "the workload must exercise recompute-pause"
    assert driver.leaked_blocks == 0
    assert [r.layers for r in result.ranks] == [(0,), (1,)]
    assert len({r.iterations for r in result.ranks}) == 1


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_trace_follows_the_spec_and_matches_rank_0(scenario, request):
    work, _, result = request.getfixturevalue(scenario)
    for rank in result.ranks:
        final = check_trace(list(rank.trace))
        assert sorted(final) == list(range(len(work))) and set(final.values()) == {"done"}
    assert result.ranks[1].trace == result.ranks[0].trace


def test_trace_files_are_written_per_rank(with_host):
    _, engine, result = with_host
    for rank in result.ranks:
        path = engine.trace_path if rank.rank == 0 else engine.trace_path.with_name("trace.rank1.ndjson")
        assert [json.loads(line) for line in path.read_text().splitlines()] == list(rank.trace)


@pytest.mark.parametrize("scenario,delay", [("with_host", 1), ("no_host", 1), ("rank1_host_fails", 0)])
def test_no_reset_before_every_stage_acknowledged(scenario, delay, request):
    _, _, result = request.getfixturevalue(scenario)
    for rank in result.ranks:
        assert rank.pauses, "some recompute-pause must go through consensus"
        for pause in rank.pauses:
            assert pause["blocks"], pause  # it kept its GPU blocks while awaiting consensus
            assert pause["paused"] + delay < pause["agreed"] <= pause["released"], pause
            assert pause["acked"] <= pause["agreed"], pause
    # the same pauses, agreed and released at the same iterations, on both ranks
    assert [(p["request_id"], p["agreed"], p["released"]) for p in result.ranks[0].pauses] == [
        (p["request_id"], p["agreed"], p["released"]) for p in result.ranks[1].pauses
    ]
    # in the trace: after recompute_pause -> awaiting_consensus, only deferred self-loops until consensus,
    # which comes at least `delay` iterations later and releases the blocks
    for rank in result.ranks:
        pending: dict = {}
        for line in rank.trace:
            rid = line["request_id"]
            if line["to"] == "awaiting_consensus" and line["event"] == "recompute_pause":
                assert line["gpu_blocks"] > 0, line
                pending[rid] = line
            elif rid in pending:
                if line["event"] == "consensus":
                    assert line["iteration"] - pending.pop(rid)["iteration"] >= delay, line
                    assert line["gpu_blocks"] == 0, line
                else:
                    assert line["from"] == line["to"] == "awaiting_consensus", line
        assert not pending


@pytest.mark.parametrize("scenario", ["with_host", "no_host"])
def test_cancel_while_awaiting_consensus_terminates_instead_of_replaying(scenario, request):
    _, _, result = request.getfixturevalue(scenario)
    driver = result.driver
    cancelled = [rid for rid, reason in driver.done_reasons.items() if reason == "cancelled"]
    assert len(cancelled) == 1
    lines = [(line["event"], line["from"], line["to"]) for line in driver.trace if line["request_id"] == cancelled[0]]
    at = lines.index(("cancel", "awaiting_consensus", "awaiting_consensus"))
    assert lines[at - 1] == ("recompute_pause", "running", "awaiting_consensus") or lines[at - 1] == (
        "recompute_pause",
        "replaying",
        "awaiting_consensus",
    )
    assert lines[at + 1 :] == [("consensus", "awaiting_consensus", "done")]
    assert [p["outcome"] for p in driver.pauses if p["request_id"] == cancelled[0]][-1] == "done"


def test_one_rank_host_tier_failure_makes_every_rank_fall_back(rank1_host_fails, with_host):
    _, _, result = rank1_host_fails
    assert [r.host_tier["local_ok"] for r in result.ranks] == [True, False]
    for rank in result.ranks:
        assert rank.host_tier["fallback"] and rank.host_tier["host_blocks"] == 0
        assert rank.host_tier["failed_ranks"] == [1]
        assert all(line["host_capacity"] == 0 for line in rank.trace)
        assert "suspend" not in {line["event"] for line in rank.trace}
    _, _, healthy = with_host
    for rank in healthy.ranks:
        assert not rank.host_tier["fallback"] and rank.host_tier["host_blocks"] == 6
    assert healthy.driver.totals["events"]["suspend"] > 0


def test_a_failing_rank_fails_the_run_instead_of_hanging():
    config = PipelineConfig(engine=pressured(), timeout_s=TIMEOUT_S, max_iterations=3)
    with pytest.raises(mp.ProcessRaisedException, match="max_iterations"):
        run_pipeline(config, workload(4), world_size=2)


@pytest.mark.parametrize(("host_blocks", "delay"), [(0, 2), (6, 4)])
def test_a_stage_acknowledging_late_does_not_livelock(host_blocks, delay):
    """Regression: with rank 1 acknowledging late, pauses awaiting consensus made the scheduler preempt again and
    again without progress (these two cases livelocked); the blocks they hold now count as room on its way."""
    work, engine, result = _run(pressured(host_blocks=host_blocks), ack_delay=((1, delay),))
    refs = references(engine, work)
    assert set(result.driver.done_reasons.values()) == {"finished"}
    assert result.outputs == {rid: refs[rid] for rid in range(len(work))}
