"""Hugging Face-format Llama checkpoints: a directory with ``config.json`` and ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``). `safetensors` is imported only when a checkpoint is read or written.

Invariant kept: `load_hf_llama(save_hf_llama(model, d))` has exactly the parameters of `model` (names map by
dropping or adding the ``model.`` prefix; ``lm_head.weight`` is absent when embeddings are tied).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor.model import LlamaModel, ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, uses an unsupported feature, or does not match its config."""


def _import_safetensors():
    try:
        import safetensors.torch as st
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise CheckpointError("reading or writing checkpoints needs the 'safetensors' package: "
                              "pip install safetensors") from err
    return st


def config_from_hf(hf: dict) -> ModelConfig:
    """Our `ModelConfig` from a Hugging Face ``LlamaConfig`` dict (config.json)."""
    if hf.get("rope_scaling") not in (None, {}):
        raise CheckpointError(f"rope_scaling {hf['rope_scaling']!r} is not supported; only plain RoPE checkpoints load")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("attention_bias / mlp_bias checkpoints are not supported (this model has no biases)")
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"rope type {rope['rope_type']!r} is not supported; only plain RoPE checkpoints load")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(config: ModelConfig) -> dict:
    """A Hugging Face ``LlamaConfig`` dict for `config`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
    }


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = _import_safetensors()
    single = path / "model.safetensors"
    if single.exists():
        return st.load_file(str(single))
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(st.load_file(str(path / shard)))
        return tensors
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json; "
                          "save the model with safetensors")


def load_hf_llama(path: str | Path, *, dtype: torch.dtype = torch.float64,
                  device: str | torch.device = "cpu") -> LlamaModel:
    """Load a local Hugging Face Llama checkpoint directory into a `LlamaModel` (no downloads)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: config.json not found; pass a Hugging Face checkpoint directory")
    config = config_from_hf(json.loads(config_file.read_text()))
    tensors = _read_tensors(path)
    state = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name in [n for n in state if n.endswith("rotary_emb.inv_freq")]:
        del state[name]
    model = LlamaModel(config).to(dtype=dtype)  # load_state_dict casts each tensor once, into `dtype`
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint does not match its config: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, config implies "
                                  f"{tuple(expected[name].shape)}")
    model.load_state_dict(state)
    return model.to(device=device).eval()


def save_hf_llama(model: LlamaModel, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a Hugging Face Llama checkpoint directory (config.json + model.safetensors)."""
    st = _import_safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    tensors = {}
    for name, tensor in model.state_dict().items():
        key = name if name == "lm_head.weight" else f"model.{name}"
        tensors[key] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    st.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
