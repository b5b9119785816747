"""In-process pieces of the pipeline (no process group): layer split, stage composition, consensus book,
mirrors, host-tier agreement, and the loop at world size 1."""

from __future__ import annotations

import json

import pytest
import torch

from executor import LlamaModel, ModelConfig, PagedBatch, SeqChunk
from executor.pipeline import (
    ConsensusBook,
    MirrorBook,
    MirrorDiverged,
    PipelineConfig,
    PipelineConfigError,
    StageCache,
    StageModel,
    agree_host_tier,
    run_rank,
    stage_layers,
)
from executor.pipeline.comm import Comm
from executor.pipeline.config import as_requests
from kvstate.errors import InvariantViolation

from .conftest import SPEC, check_trace, pressured, references, workload

pytestmark = pytest.mark.distributed


def test_stage_layers_cover_every_layer_once_in_order():
    for layers in range(1, 7):
        for stages in range(1, layers + 1):
            slices = [stage_layers(layers, stages, s) for s in range(stages)]
            assert [i for r in slices for i in r] == list(range(layers))
            assert all(len(r) >= 1 for r in slices) and max(map(len, slices)) - min(map(len, slices)) <= 1
    with pytest.raises(PipelineConfigError):
        stage_layers(2, 3, 0)
    with pytest.raises(PipelineConfigError, match="every stage needs at least one"):
        PipelineConfig().check_world(3)


def test_two_stage_slices_compose_to_the_full_model():
    config = ModelConfig(num_layers=3)
    full = LlamaModel.from_seed(config, 7)
    stages = [StageModel(full, s, 2) for s in range(2)]
    caches = [StageCache(st.make_cache(4, 4, torch.device("cpu")), st.layer_range.start) for st in stages]
    tokens = (3, 14, 15, 92, 65, 35)
    batch = PagedBatch.build([SeqChunk(tokens, 0, (0, 1), True)], 4)
    hidden = stages[0].forward_stage(batch, caches[0], None)
    logits = stages[1].forward_stage(batch, caches[1], hidden)
    assert list(stages[0].layer_range) == [0, 1] and list(stages[1].layer_range) == [2]
    torch.testing.assert_close(logits[0], full.forward_dense(tokens)[-1], rtol=1e-10, atol=1e-10)
    with pytest.raises(IndexError, match="not held by this stage"):
        caches[1].layer_keys(0)


def test_consensus_needs_every_rank_and_refuses_an_early_release():
    fast, slow = ConsensusBook(0), ConsensusBook(1, delay=2)
    for book in (fast, slow):
        book.announce("a", 5, [3, 4])
        book.retire(5)
    assert fast.acks(6) == ["a"] and slow.acks(6) == []
    assert fast.agree([fast.acks(6), slow.acks(6)], 6) == set()
    with pytest.raises(InvariantViolation, match="before every stage acknowledged"):
        fast.release("a", 6, "recompute_paused")
    with pytest.raises(InvariantViolation, match="PP-HOLD"):
        fast.check_untouched([("b", [1, 4])], 6)  # another request writes a held block
    with pytest.raises(InvariantViolation, match="in the batch"):
        fast.check_untouched([("a", [3])], 6)
    for book in (fast, slow):
        book.retire(7)
    assert fast.agree([fast.acks(8), slow.acks(8)], 8) == {"a"}
    record = fast.release("a", 8, "done")
    assert (record.paused, record.acked, record.agreed, record.released) == (5, 6, 8, 8)
    fast.check_untouched([("b", [3, 4])], 8)  # released: its blocks may be reused


def test_mirror_takes_only_spec_edges_from_its_current_state():
    mirrors = MirrorBook(SPEC)
    mirrors.add({"request_id": 1, "prompt": (1, 2), "max_new_tokens": 3, "stop_token_ids": ()})
    line = {"request_id": 1, "event": "admit", "from": "waiting", "to": "running", "done_reason": None}
    mirrors.apply(line)
    with pytest.raises(MirrorDiverged, match="is running here"):
        mirrors.apply(line)
    with pytest.raises(MirrorDiverged, match="not an edge"):
        mirrors.apply({**line, "event": "replay", "from": "running"})
    with pytest.raises(MirrorDiverged, match="never received"):
        mirrors.apply({**line, "request_id": 2})


def test_host_tier_failure_falls_back_to_gpu_only():
    comm = Comm(0, 1, torch.device("cpu"))
    stage = StageModel(LlamaModel.from_seed(ModelConfig(), 0), 0, 1)
    cache = stage.make_cache(4, 4, torch.device("cpu"))
    decision = agree_host_tier(cache, 8, comm, simulate_failure=True)
    assert decision.fallback and decision.failed_ranks == (0,) and decision.host_blocks == 0
    assert cache.host_cache is None and "simulated failure" in decision.local_error
    ok = agree_host_tier(stage.make_cache(4, 4, torch.device("cpu")), 8, comm)
    assert not ok.fallback and ok.host_blocks == 8


def test_one_stage_loop_matches_the_oracle_and_traces_spec_edges(tmp_path):
    config = pressured(trace_path=tmp_path / "t.ndjson")
    work = workload(8, seed=3)
    result = run_rank(0, 1, PipelineConfig(engine=config), as_requests(work))
    assert result.outputs == references(config, work)
    assert result.totals["events"]["recompute_pause"] and "consensus" not in result.totals["events"]
    lines = [json.loads(x) for x in (tmp_path / "t.ndjson").read_text().splitlines()]
    assert lines == list(result.trace)
    assert set(check_trace(lines).values()) == {"done"} and result.leaked_blocks == 0
