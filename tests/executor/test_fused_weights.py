"""The fused q/k/v and gate/up matrices: stored once, seen under Hugging Face's names, loaded back exactly."""

from __future__ import annotations

import pytest
import torch

from executor import LlamaModel, ModelConfig


@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_match_transformers(tied):
    transformers = pytest.importorskip("transformers")
    c = ModelConfig(tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            tie_word_embeddings=tied,
        )
    )
    expected = {
        name.removeprefix("model."): tuple(t.shape)
        for name, t in hf.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    ours = {name: tuple(t.shape) for name, t in LlamaModel.from_seed(c).hf_state_dict().items()}
    assert ours == expected


def test_parts_are_views_of_the_one_stored_matrix():
    model = LlamaModel.from_seed(seed=1)
    stored = model.state_dict()
    assert not any(
        name.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".gate_proj.weight", ".up_proj.weight"))
        for name in stored
    )
    parts = model.hf_state_dict()
    for layer in range(model.config.num_layers):
        qkv = stored[f"layers.{layer}.self_attn.qkv_proj.weight"]
        q, k, v = (parts[f"layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv")
        assert q.data_ptr() == qkv.data_ptr() and torch.equal(torch.cat((q, k, v)), qkv)
        gate_up = stored[f"layers.{layer}.mlp.gate_up_proj.weight"]
        gate, up = parts[f"layers.{layer}.mlp.gate_proj.weight"], parts[f"layers.{layer}.mlp.up_proj.weight"]
        assert gate.data_ptr() == gate_up.data_ptr() and torch.equal(torch.cat((gate, up)), gate_up)


def test_load_hf_state_dict_round_trips_and_casts():
    source = LlamaModel.from_seed(seed=2)
    target = LlamaModel(source.config).to(torch.float32)
    target.load_hf_state_dict({name: t.clone() for name, t in source.hf_state_dict().items()})
    for name, tensor in source.state_dict().items():
        assert target.state_dict()[name].dtype == torch.float32
        assert torch.equal(target.state_dict()[name], tensor.to(torch.float32)), name
    with pytest.raises(RuntimeError, match="Missing key"):
        target.load_hf_state_dict({n: t for n, t in source.hf_state_dict().items() if "k_proj" not in n})
