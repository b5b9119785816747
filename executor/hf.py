"""Hugging Face-format Llama checkpoints: a directory with ``config.json`` and ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``). `safetensors` is imported only when a checkpoint is read or written.

Invariants kept:
* `load_hf_llama(save_hf_llama(model, d))` has exactly the parameters of `model` (names map by dropping or adding
  the ``model.`` prefix, and through `LlamaModel.hf_state_dict`/`load_hf_state_dict`, which split and concatenate
  the fused q/k/v and gate/up matrices; ``lm_head.weight`` is absent when embeddings are tied);
* a checkpoint is untrusted input: ``config.json`` and the shard index are read bounded and typed
  (`kvstate.untrusted`), every file read lies inside the checkpoint directory (shard names with ``..``, absolute
  paths and symlinks leading out are refused), tensors are floating point and finite, and the model's shapes are
  checked against the config before any memory is allocated for it. Every refusal is a `CheckpointError` naming
  the file and the field or tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from executor.model import LlamaModel, ModelConfig
from kvstate.untrusted import Fields, Limits, UntrustedFileError, read_json, shown

CONFIG_LIMITS = Limits(max_bytes=1 << 20, max_depth=8)
INDEX_LIMITS = Limits(max_bytes=64 << 20, max_depth=4)  # the index names every tensor
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# generous ceilings (the largest public Llamas are far below them); the tensors' shapes are checked exactly
_SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24,
}


class CheckpointError(UntrustedFileError):
    """A checkpoint directory is missing a file, uses an unsupported feature, holds a malformed or hostile file,
    or does not match its config; `path`, `field` locate the problem."""


def _import_safetensors():
    try:
        import safetensors.torch as st
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise CheckpointError(
            "reading or writing checkpoints needs the 'safetensors' package: pip install safetensors"
        ) from err
    return st


def config_from_hf(hf: Mapping, *, path: str | Path | None = None) -> ModelConfig:
    """Our `ModelConfig` from a Hugging Face ``LlamaConfig`` dict (config.json, read from `path`), field by field."""
    f = Fields.of(hf, "config.json", path=path, error=CheckpointError)
    if f.get("rope_scaling", None) not in (None, {}):
        raise f.fail(
            "rope_scaling", f"{shown(f.data['rope_scaling'])} is not supported; only plain RoPE checkpoints load"
        )
    for key in ("attention_bias", "mlp_bias"):
        if f.boolean(key, default=False):
            raise f.fail(key, "is true: checkpoints with biases are not supported (this model has none)")
    rope = Fields.of(
        f.get("rope_parameters", None) or {},
        "field 'rope_parameters'",
        path=path,
        where="rope_parameters",
        error=CheckpointError,
    )
    if rope.string("rope_type", default="default") != "default":
        raise rope.fail(
            "rope_type", f"{shown(rope.data['rope_type'])} is not supported; only plain RoPE checkpoints load"
        )

    def size(key: str, default: int | None = None) -> int:
        value = f.get(key, None)
        if value is None and default is not None:
            return default
        return f.integer(key, minimum=1, maximum=_SIZE_LIMITS[key])

    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    theta = (
        f.number("rope_theta", positive=True)
        if "rope_theta" in f.data
        else rope.number("rope_theta", positive=True, default=10000.0)
    )
    try:
        return ModelConfig(
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim", hidden // heads),
            max_position_embeddings=size("max_position_embeddings", 4096),
            rope_theta=theta,
            rms_norm_eps=f.number("rms_norm_eps", positive=True, default=1e-6),
            tie_word_embeddings=f.boolean("tie_word_embeddings", default=False),
        )
    except ValueError as err:
        raise CheckpointError(
            f"the config describes no model this engine can build: {err}; fix config.json", path=path
        ) from err


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
    if (path / "model.safetensors").exists():
        return _read_shard(st, path, "model.safetensors", path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if not index.exists():
        raise CheckpointError(
            "no model.safetensors or model.safetensors.index.json; save the model with safetensors", path=path
        )
    data = Fields.of(
        read_json(index, INDEX_LIMITS, "shard index", CheckpointError),
        "the shard index",
        path=index,
        error=CheckpointError,
    )
    weight_map = data.mapping("weight_map")
    shards = sorted({weight_map.string(name) for name in weight_map.data})
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in _read_shard(st, path, shard, index).items():
            if name in tensors:
                raise CheckpointError(f"tensor {shown(name)} is in two shards; keep one copy", path=path / shard)
            tensors[name] = tensor
    return tensors


def _shard_file(directory: Path, name: str, index: Path) -> Path:
    """The file of shard `name`, refused unless it is a ``.safetensors`` file inside `directory`."""
    where = f"shard {shown(name)}"
    if (
        "\0" in name
        or PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
        or ".." in PurePosixPath(name.replace("\\", "/")).parts
    ):
        raise CheckpointError(
            f"{where} is outside the checkpoint directory; shard names are file names relative to it", path=index
        )
    if not name.endswith(".safetensors"):
        raise CheckpointError(f"{where} is not a .safetensors file", path=index)
    file = directory / name
    try:
        resolved, root = file.resolve(strict=True), directory.resolve(strict=True)
    except (OSError, RuntimeError):
        raise CheckpointError(f"{where} is missing; copy the whole checkpoint", path=index) from None
    if not resolved.is_relative_to(root):
        raise CheckpointError(
            f"{where} leads outside the checkpoint directory (through a symlink, to "
            f"{resolved}); shards must lie inside it",
            path=index,
        )
    if not resolved.is_file():
        raise CheckpointError(f"{where} is not a regular file", path=index)
    return resolved


def _read_shard(st, directory: Path, name: str, index: Path) -> dict[str, torch.Tensor]:
    """The tensors of one shard: a readable safetensors file inside `directory`, floating point and finite."""
    file = _shard_file(directory, name, index)
    try:
        tensors = st.load_file(str(file))
    except Exception as err:  # safetensors raises its own SafetensorError (not exported as a stable type) or OSError
        raise CheckpointError(
            f"cannot read this shard ({err}); the file is truncated or not safetensors — copy the checkpoint again",
            path=file,
        ) from err
    for tensor_name, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {shown(tensor_name)} has dtype {tensor.dtype}; only float16, bfloat16, "
                "float32 and float64 weights load (quantized checkpoints are not supported)",
                path=file,
            )
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"tensor {shown(tensor_name)} holds NaN or infinite values; the checkpoint is corrupt", path=file
            )
    return tensors


def load_hf_llama(
    path: str | Path, *, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
) -> LlamaModel:
    """Load a local Hugging Face Llama checkpoint directory into a `LlamaModel` (no downloads)."""
    path = Path(path)
    config_file = path / "config.json"
    config = config_from_hf(
        read_json(config_file, CONFIG_LIMITS, "checkpoint config", CheckpointError), path=config_file
    )
    tensors = _read_tensors(path)
    state = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name in [n for n in state if n.endswith("rotary_emb.inv_freq")]:
        del state[name]
    with torch.device("meta"):  # shapes only: a hostile config allocates nothing before it is checked
        expected = {name: tuple(t.shape) for name, t in LlamaModel(config).hf_state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match its config: missing {missing[:5]}, unexpected "
            f"{[shown(n) for n in unexpected[:5]]}",
            path=path,
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}, config implies {expected[name]}", path=path)
    model = LlamaModel(config).to(dtype=dtype)  # the q/k/v and gate/up parts are concatenated, then cast once
    model.load_hf_state_dict(state)
    return model.to(device=device).eval()


def save_hf_llama(model: LlamaModel, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a Hugging Face Llama checkpoint directory (config.json + model.safetensors)."""
    st = _import_safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    tensors = {}
    for name, tensor in model.hf_state_dict().items():  # the fused q/k/v and gate/up matrices split back
        key = name if name == "lm_head.weight" else f"model.{name}"
        tensors[key] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    st.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
