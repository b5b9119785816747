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
    from kvstate.config import SchedulerConfig

    model = LlamaModel.from_seed(seed=4)
    save_hf_llama(model, tmp_path)
    config = EngineConfig(checkpoint=str(tmp_path), device="cpu", scheduler=SchedulerConfig(gpu_blocks=8))
    with Engine(config) as engine:
        rid = engine.add_request([1, 2, 3], 5)
        out = engine.run()[rid]
    logits = model.forward_dense([1, 2, 3, *out[:-1]])
    assert out == logits[2:].argmax(-1).tolist()


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
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
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = [int(t) for t in torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(model.forward_dense(tokens), expected, rtol=1e-4, atol=1e-4)
    c = model.config
    cache = PagedKVCache(
        12,
        num_layers=c.num_layers,
        block_size=4,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=torch.float32,
        device="cpu",
    )
    table = tuple(range(11, 1, -1))
    prefix = model.forward_paged(PagedBatch.build([SeqChunk(tuple(tokens[:30]), 0, table)], 4), cache)
    torch.testing.assert_close(prefix[0], expected[29], rtol=1e-4, atol=1e-4)
    for pos in range(30, 37):
        out = model.forward_paged(PagedBatch.build([SeqChunk((tokens[pos],), pos, table)], 4), cache)
        torch.testing.assert_close(out[0], expected[pos], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", [64, 100, 576, 960])
def test_rms_norm_is_transformers_bit_for_bit_on_the_cpu(width):
    """Our RMSNorm in float32 (a sum divided by the width on the CPU, where torch's mean is that) gives
    transformers' `LlamaRMSNorm` float for float, at widths that are powers of two and that are not (in float64
    transformers normalizes in float32, we in float64)."""
    dtype = torch.float32
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from executor.model import RMSNorm

    generator = torch.Generator().manual_seed(width)
    weight = 1 + 0.1 * torch.randn(width, generator=generator, dtype=torch.float64)
    ours, theirs = RMSNorm(width, 1e-6).to(dtype), modeling.LlamaRMSNorm(width, eps=1e-6).to(dtype)
    for norm in (ours, theirs):
        norm.weight.data.copy_(weight)
    for scale in (1e-3, 1.0, 300.0):
        x = scale * torch.randn(37, width, generator=generator, dtype=torch.float64).to(dtype)
        with torch.no_grad():
            assert torch.equal(ours(x), theirs(x)), scale


@pytest.mark.parametrize("tied", [False, True])
def test_load_a_checkpoint_written_by_transformers(tmp_path, tied):
    """A checkpoint saved by `transformers` itself (its file layout and config keys) loads and agrees."""
    transformers = pytest.importorskip("transformers")
    c = ModelConfig(tie_word_embeddings=tied)
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
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


# ------------------------------------------------------------------------ hostile checkpoints
def saved(tmp_path, **config_changes) -> tuple:
    """A saved tiny checkpoint in tmp_path/ckpt, with `config_changes` written into its config.json."""
    path = tmp_path / "ckpt"
    save_hf_llama(LlamaModel.from_seed(), path)
    config = json.loads((path / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    return path, config


def refused(path, *needles: str) -> CheckpointError:
    """`load_hf_llama(path)` raises a CheckpointError (a ValueError and a KVStateError) containing `needles`."""
    from kvstate.errors import KVStateError

    with pytest.raises(CheckpointError) as info:
        load_hf_llama(path)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, KVStateError)
    for needle in needles:
        assert needle in str(err), str(err)
    return err


@pytest.mark.parametrize(
    "text, needles",
    [
        ('{"vocab_size": 512,', ("config.json:1", "not a JSON object")),
        ("[1, 2]", ("config.json", "must be an object")),
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", ("config.json", "nested too deeply")),
        ('{"a": ' + "[" * 20 + "]" * 20 + "}", ("config.json", "nested deeper than 8")),
        ('{"rope_theta": NaN}', ("config.json", "NaN is not allowed")),
        ('{"rope_theta": 1e999}', ("config.json", "'rope_theta'", "not a finite number")),
        ('{"hidden_size": ' + "1" * 5000 + "}", ("config.json", "too many to read")),
    ],
)
def test_malformed_config_json_is_a_checkpoint_error(tmp_path, text, needles):
    path, _ = saved(tmp_path)
    (path / "config.json").write_text(text)
    refused(path, *needles)


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"num_attention_heads": None}, ("'num_attention_heads'", "must be an integer")),
        ({"hidden_size": "64"}, ("'hidden_size'", "must be an integer")),
        ({"hidden_size": 10**30}, ("'hidden_size'", "more than 19 digits")),
        ({"vocab_size": 10**12}, ("'vocab_size'", "between 1 and")),
        ({"num_hidden_layers": 0}, ("'num_hidden_layers'", "between 1 and")),
        ({"rope_theta": "nan"}, ("'rope_theta'", "must be a number")),
        ({"rms_norm_eps": -1e-6}, ("'rms_norm_eps'", "> 0")),
        ({"rms_norm_eps": 0}, ("'rms_norm_eps'", "> 0")),
        ({"tie_word_embeddings": "yes"}, ("'tie_word_embeddings'", "true or false")),
        ({"rope_parameters": "default"}, ("'rope_parameters'", "must be an object")),
        ({"num_key_value_heads": 3}, ("no model this engine can build", "num_kv_heads")),
    ],
)
def test_wrong_config_fields_are_refused_naming_the_field(tmp_path, changes, needles):
    path, _ = saved(tmp_path, **changes)
    err = refused(path, "config.json", *needles)
    assert err.path.endswith("config.json")


def test_a_missing_required_field_and_a_directory_config_are_refused(tmp_path):
    path, config = saved(tmp_path)
    del config["num_attention_heads"]
    (path / "config.json").write_text(json.dumps(config))
    refused(path, "'num_attention_heads'", "is missing")
    (path / "config.json").unlink()
    (path / "config.json").mkdir()
    refused(path, "config.json", "cannot read")


def test_a_huge_config_allocates_nothing_before_the_shapes_are_checked(tmp_path):
    path, _ = saved(tmp_path, vocab_size=1 << 22, hidden_size=1 << 14)  # a 64 Gi-element embedding if allocated
    refused(path, "lm_head.weight has shape (512, 64), config implies (4194304, 16384)")


def sharded(tmp_path) -> tuple:
    """The tiny checkpoint split into two shards with an index; returns (dir, index dict)."""
    import safetensors.torch as st

    path, _ = saved(tmp_path)
    tensors = st.load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, members in shards.items():
        st.save_file({n: tensors[n] for n in members}, str(path / shard))
        weight_map.update(dict.fromkeys(members, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path, index


def write_index(path, index, **renamed) -> None:
    weight_map = {n: renamed.get(s, s) for n, s in index["weight_map"].items()}
    (path / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))


def test_a_sharded_checkpoint_loads(tmp_path):
    path, _ = sharded(tmp_path)
    assert load_hf_llama(path).config == LlamaModel.from_seed().config


@pytest.mark.parametrize(
    "name_of",
    [
        lambda outside: "../outside/stolen.safetensors",
        lambda outside: str(outside / "stolen.safetensors"),  # absolute
        lambda outside: "sub/../../outside/stolen.safetensors",
    ],
)
def test_shard_names_leading_out_of_the_checkpoint_are_refused(tmp_path, name_of):
    path, index = sharded(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (path / "model-00002-of-00002.safetensors").rename(outside / "stolen.safetensors")
    write_index(path, index, **{"model-00002-of-00002.safetensors": name_of(outside)})
    refused(path, "model.safetensors.index.json", "outside the checkpoint directory")


def test_a_symlinked_shard_escaping_the_directory_is_refused(tmp_path):
    path, _index = sharded(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    (path / "model-00002-of-00002.safetensors").rename(outside)
    (path / "model-00002-of-00002.safetensors").symlink_to(outside)
    refused(path, "leads outside the checkpoint directory")


def test_missing_and_truncated_shards_and_bad_indexes_are_refused(tmp_path):
    path, _index = sharded(tmp_path)
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    refused(path, str(shard), "truncated or not safetensors")
    shard.unlink()
    refused(path, "'model-00002-of-00002.safetensors' is missing")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    refused(path, "'weight_map'", "must be an object")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 3}}))
    refused(path, "'weight_map.a'", "non-empty string")


def rewrite_tensors(path, change) -> None:
    import safetensors.torch as st

    file = path / "model.safetensors"
    tensors = st.load_file(str(file))
    st.save_file({name: change(name, t) for name, t in tensors.items()}, str(file))


def test_int8_weights_are_refused(tmp_path):
    path, _ = saved(tmp_path)
    rewrite_tensors(path, lambda name, t: t.to(torch.int8) if name.endswith("q_proj.weight") else t)
    refused(path, "dtype torch.int8", "quantized")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(tmp_path, value):
    path, _ = saved(tmp_path)
    rewrite_tensors(path, lambda name, t: torch.full_like(t, value) if "layers.0.mlp" in name else t)
    refused(path, "NaN or infinite", "model.safetensors")


def test_an_oversized_config_and_an_escaping_single_file_checkpoint_are_refused(tmp_path):
    path, config = saved(tmp_path)
    (path / "config.json").write_text(json.dumps(config) + " " * (2 << 20))
    refused(path, "config.json", "larger than 1048576 bytes")
    (path / "config.json").write_text(json.dumps(config))
    outside = tmp_path / "elsewhere.safetensors"
    (path / "model.safetensors").rename(outside)
    (path / "model.safetensors").symlink_to(outside)
    refused(path, "leads outside the checkpoint directory")


@pytest.mark.parametrize("tied", [False, True])
def test_the_shapes_checked_from_the_config_are_the_models(tied):
    """`expected_shapes` (what headers are checked against before any data is read) is `hf_state_dict`'s layout."""
    from executor.hf import expected_shapes

    config = ModelConfig(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)
    model = LlamaModel.from_seed(config, seed=0)
    assert expected_shapes(config) == {name: tuple(t.shape) for name, t in model.hf_state_dict().items()}
