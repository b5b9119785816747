"""The fused q/k/v and gate/up matrices: stored once, seen under Hugging Face's names, loaded back exactly; every
multiplied weight stored column-major whichever way the model was built or loaded."""

from __future__ import annotations

import pytest
import torch

from executor import LlamaModel, ModelConfig, load_hf_llama, save_hf_llama
from executor.gguf_llama import load_gguf_llama
from tests.executor.gguf_files import write_gguf


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


def _multiplied(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The weights a forward passes to `F.linear`: 2-D parameters, the embedding only when it is tied."""
    return {
        name: param
        for name, param in model.named_parameters()
        if param.dim() == 2 and (name != "embed_tokens.weight" or model.lm_head is None)
    }


@pytest.mark.parametrize("tied", [False, True])
def test_every_loader_stores_the_multiplied_weights_column_major(tmp_path, tied):
    """Seeded, cast, read back from a Hugging Face checkpoint or a GGUF file: each multiplied weight's transpose is
    contiguous, with Hugging Face's shape and the values written."""
    source = LlamaModel.from_seed(ModelConfig(tie_word_embeddings=tied), seed=3)
    built = {
        "seeded": source,
        "cast": LlamaModel.from_seed(source.config, seed=3).to(torch.float32),  # `to` casts in place
        "hf": load_hf_llama(save_hf_llama(source, tmp_path / "hf")),
        "gguf": load_gguf_llama(write_gguf(tmp_path / "m.gguf", source), dtype=torch.float32),
    }
    expected = {name: param.float() for name, param in LlamaModel.from_seed(source.config, seed=3).named_parameters()}
    for how, model in built.items():
        weights = _multiplied(model)
        assert len(weights) == 4 * model.config.num_layers + 1, how
        for name, weight in weights.items():
            assert weight.t().is_contiguous() and not weight.is_contiguous(), (how, name)
            assert weight.shape == expected[name].shape, (how, name)
        if how != "gguf":  # GGUF rows of q and k are stored permuted: test_gguf compares their values
            for name, weight in weights.items():
                assert torch.equal(weight.float(), expected[name]), (how, name)
