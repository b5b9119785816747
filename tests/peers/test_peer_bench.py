"""Smoke test of `kvstate bench --peers` with the peers installed: vLLM's real scheduler and transformers'
`generate` measured beside ours at tiny sizes (never wall times: structure, equal work, equal outputs)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.peers
pytest.importorskip("vllm", reason="vLLM is an optional peer: run scripts/install-peers to install it")
pytest.importorskip("transformers", reason="transformers is the engine's peer: pip install '.[test]'")

from kvstate.cli import main  # noqa: E402


def test_bench_peers_measures_vllm_and_generate_beside_ours(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    path = tmp_path / "peers.json"
    command = ["bench", "--peers", "--only", "vllm", "--only", "transformers", "--quick", "--sizes", "24,48"]
    assert main([*command, "--batches", "1,2", "--json", str(path)]) == 0  # the two groups named, nothing else
    doc = json.loads(path.read_text())
    vllm, decode, decode_step, serving = doc["sections"]
    assert (decode_step["name"], serving["name"]) == ("decode_step", "serving")  # the transformers group's others
    assert vllm["name"] == "vllm" and vllm["data"]["peer"] == "vLLM 0.33.0" and vllm["data"]["missing"] is None
    figures = vllm["data"]["figures"]
    assert set(figures) == {
        f"{n} {w}"
        for n in (24, 48)
        for w in (
            "steady ours machine",
            "steady vllm",
            "pressure ours machine",
            "pressure ours compiled",
            "pressure vllm",
        )
    }
    for size in (24, 48):
        steady_ours, steady_vllm = figures[f"{size} steady ours machine"], figures[f"{size} steady vllm"]
        assert steady_ours["scheduled_per_step"] == steady_vllm["scheduled_per_step"] == size  # everyone decodes
        assert steady_ours["preempted_per_step"] == steady_vllm["preempted_per_step"] == 0
        for who in ("ours machine", "ours compiled", "vllm"):  # the GPU tier holds fewer than all of them
            assert figures[f"{size} pressure {who}"]["scheduled_per_step"] < size
    assert len(vllm["rows"]) == 2 * 2 * 3  # (schedule(), step) x sizes x (steady, pressure machine, compiled)
    for row in vllm["rows"]:
        assert row["value"] > 0 and row["baseline"] > 0 and row["ratio"] > 0
        assert row["baseline_name"].startswith("vLLM 0.33.0 ")
    assert decode["data"]["missing"] is None
    assert {b: d["outputs_equal"] for b, d in decode["data"]["per_batch"].items()} == {"1": 1, "2": 2}
    assert all(row["ratio"] > 0 and row["baseline_name"].startswith("transformers ") for row in decode["rows"])


def test_the_adapters_max_model_len_is_the_request_limit_below_the_gpu_tier() -> None:
    from kvstate.adapters.vllm import VLLMAdapter

    adapter = VLLMAdapter(gpu_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=12)
    assert adapter.gpu_token_capacity == 12 and adapter.block_usage()["gpu_capacity"] == 8
    with pytest.raises(ValueError, match="exceeds vLLM's max_model_len=12"):
        adapter.submit([1] * 10, 3, ())
    adapter.submit([1] * 10, 2, ())
    with pytest.raises(ValueError, match="max_model_len=33 must be between 1 and"):
        VLLMAdapter(gpu_blocks=8, block_size=4, max_model_len=33)
