"""Hugging Face compatibility: our checkpoints round-trip, and `transformers` computes the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from executor import CheckpointError, LlamaModel, ModelConfig, load_hf_llama, save_hf_llama

pytest.importorskip("safetensors")


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip(tmp_path, tied):
    model = LlamaModel.from_seed(ModelConfig(tie_word_embeddings=tied), seed=3)
    save_hf_llama(model, tmp_path)
    loaded = load_hf_llama(tmp_path)
    assert loaded.config == model.config
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    torch.testing.assert_close(loaded.forward_dense([5, 6, 7]), model.forward_dense([5, 6, 7]), rtol=0, atol=0)


def test_engine_loads_a_checkpoint(tmp_path):
    from executor import Engine, EngineConfig

    model = LlamaModel.from_seed(seed=4)
    save_hf_llama(model, tmp_path)
    with Engine(EngineConfig(checkpoint=str(tmp_path), device="cpu", gpu_blocks=8)) as engine:
        rid = engine.add_request([1, 2, 3], 5)
        out = engine.run()[rid]
    logits = model.forward_dense([1, 2, 3] + out[:-1])
    assert out == logits[2:].argmax(-1).tolist()


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_llama(tmp_path)
    model = LlamaModel.from_seed()
    save_hf_llama(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 2}}))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_hf_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="missing"):
        load_hf_llama(tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_agrees(tmp_path, tied):
    """`transformers.LlamaForCausalLM` loaded from our checkpoint gives the logits of our dense and paged paths."""
    transformers = pytest.importorskip("transformers")
    from executor import PagedBatch, PagedKVCache, SeqChunk

    model = LlamaModel.from_seed(ModelConfig(tie_word_embeddings=tied), seed=2, dtype=torch.float32)
    save_hf_llama(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    tokens = [int(t) for t in torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(model.forward_dense(tokens), expected, rtol=1e-4, atol=1e-4)
    c = model.config
    cache = PagedKVCache(12, num_layers=c.num_layers, block_size=4, num_kv_heads=c.num_kv_heads,
                         head_dim=c.head_dim, dtype=torch.float32, device="cpu")
    table = tuple(range(11, 1, -1))
    prefix = model.forward_paged(PagedBatch.build([SeqChunk(tuple(tokens[:30]), 0, table)], 4), cache)
    torch.testing.assert_close(prefix[0], expected[29], rtol=1e-4, atol=1e-4)
    for pos in range(30, 37):
        out = model.forward_paged(PagedBatch.build([SeqChunk((tokens[pos],), pos, table)], 4), cache)
        torch.testing.assert_close(out[0], expected[pos], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_load_a_checkpoint_written_by_transformers(tmp_path, tied):
    """A checkpoint saved by `transformers` itself (its file layout and config keys) loads and agrees."""
    transformers = pytest.importorskip("transformers")
    c = ModelConfig(tie_word_embeddings=tied)
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # O(1) logits, so the tolerance below is tight relative to them
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape))
            else:
                param.copy_(torch.randn(param.shape) / param.shape[1] ** 0.5)
    hf.save_pretrained(str(tmp_path))
    ours = load_hf_llama(tmp_path, dtype=torch.float32)
    assert ours.config == c
    tokens = list(range(3, 40, 2))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(ours.forward_dense(tokens), expected, rtol=1e-4, atol=1e-4)
