"""Hugging Face-format Llama checkpoints: a directory with ``config.json`` and ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``). `safetensors` is imported only when a checkpoint is read or written.

Invariants kept:
* `load_hf_llama(save_hf_llama(model, d))` has exactly the parameters of `model` (names map by dropping or adding
  the ``model.`` prefix, and through `LlamaModel.hf_state_dict`/`load_hf_state_dict`, which split and concatenate
  the fused q/k/v and gate/up matrices; ``lm_head.weight`` is absent when embeddings are tied);
* a checkpoint is untrusted input: ``config.json`` and the shard index are read bounded and typed
  (`kvstate.untrusted`), only from regular files (`open_regular`: a FIFO is refused, never waited on), every
  file read lies inside the checkpoint directory (shard names with ``..``, absolute paths and symlinks leading
  out are refused), tensors are floating point and finite;
* every shard's safetensors header is read first, bounded (`SAFETENSORS_LIMITS`: its bytes, and the tensor
  count of all shards together), and its names, dtypes, shapes and byte ranges are checked against the config
  and the file before any tensor data is read or any memory is allocated for the model. Every refusal is a
  `CheckpointError` naming the file and the field or tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from executor.checkpoint_files import CheckpointError, open_regular, read_checkpoint_json
from executor.model import LlamaModel, ModelConfig
from kvstate.untrusted import Fields, Limits, parse_json, shown

CONFIG_LIMITS = Limits(max_bytes=1 << 20, max_depth=8)
INDEX_LIMITS = Limits(max_bytes=64 << 20, max_depth=4)  # the index names every tensor
# safetensors' dtype names of the floating-point tensors that load, and their bytes per element
SAFETENSORS_FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_TORCH_NAMES = {  # safetensors' names of the dtypes that do not load, as torch spells them (for messages)
    "I8": "torch.int8",
    "U8": "torch.uint8",
    "I16": "torch.int16",
    "I32": "torch.int32",
    "I64": "torch.int64",
    "BOOL": "torch.bool",
    "F8_E4M3": "torch.float8_e4m3fn",
    "F8_E5M2": "torch.float8_e5m2",
}
# generous ceilings (the largest public Llamas are far below them); the tensors' shapes are checked exactly
SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True, slots=True)
class SafetensorsLimits:
    """What the safetensors headers of one checkpoint may hold: far more than any public Llama needs (Llama 3.1
    405B has 1,138 tensors; a shard's header is a few hundred KiB)."""

    max_header_bytes: int = 16 << 20
    max_tensors: int = 1 << 16  # all shards together


SAFETENSORS_LIMITS = SafetensorsLimits()


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
        return f.integer(key, minimum=1, maximum=SIZE_LIMITS[key])

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


def _shard_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: ``model.safetensors``, or the shards its index names."""
    if (path / "model.safetensors").exists():
        return [_shard_file(path, "model.safetensors", path / "model.safetensors")]
    index = path / "model.safetensors.index.json"
    if not index.exists():
        raise CheckpointError(
            "no model.safetensors or model.safetensors.index.json; save the model with safetensors", path=path
        )
    data = Fields.of(
        read_checkpoint_json(index, INDEX_LIMITS, "shard index"), "the shard index", path=index, error=CheckpointError
    )
    weight_map = data.mapping("weight_map")
    if len(weight_map.data) > SAFETENSORS_LIMITS.max_tensors:
        raise CheckpointError(
            f"names {len(weight_map.data)} tensors; at most {SAFETENSORS_LIMITS.max_tensors} are read",
            path=index,
            field="weight_map",
        )
    return [_shard_file(path, shard, index) for shard in sorted({weight_map.string(n) for n in weight_map.data})]


def _shard_header(file: Path, limits: SafetensorsLimits) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from the header of one safetensors file, read bounded; every tensor is
    floating point and its byte range matches its shape and lies inside the file."""
    with open_regular(file, "safetensors shard") as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > min(limits.max_header_bytes, size - 8):
            raise CheckpointError(
                f"the safetensors header states {length if length is not None else 'no'} bytes; a header is at "
                f"most {limits.max_header_bytes} bytes and inside the {size}-byte file — the file is truncated "
                "or not safetensors",
                path=file,
            )
        raw = handle.read(length)
    limits_json = Limits(max_bytes=limits.max_header_bytes, max_depth=4)
    header = Fields.of(
        parse_json(raw, limits_json, "safetensors header", path=file, error=CheckpointError),
        "the safetensors header",
        path=file,
        error=CheckpointError,
    )
    entries = {name: value for name, value in header.data.items() if name != "__metadata__"}
    if len(entries) > limits.max_tensors:
        raise CheckpointError(
            f"the header names {len(entries)} tensors; at most {limits.max_tensors} are read", path=file
        )
    data_bytes = size - 8 - length
    tensors = {}
    for name, value in entries.items():
        entry = Fields.of(value, f"tensor {shown(name)}", path=file, where=name, error=CheckpointError)
        dtype = entry.string("dtype")
        if dtype not in SAFETENSORS_FLOATS:
            raise entry.fail(
                "dtype",
                f"tensor {shown(name)} has dtype {_TORCH_NAMES.get(dtype, shown(dtype))}; only float16, bfloat16, "
                "float32 and float64 weights load (quantized checkpoints are not supported)",
            )
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_index(n) for n in shape):
            raise entry.fail("shape", f"must be a list of at most 8 non-negative integers, got {shown(shape)}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_index(n) for n in offsets):
            raise entry.fail("data_offsets", f"must be [begin, end] in bytes, got {shown(offsets)}")
        begin, end = offsets
        if end - begin != math.prod(shape) * SAFETENSORS_FLOATS[dtype] or end > data_bytes:
            raise entry.fail(
                "data_offsets",
                f"{offsets} do not hold a {dtype} tensor of shape {shape} inside the {data_bytes} data bytes of "
                "the file: the file is truncated or not safetensors (or its header lies)",
            )
        tensors[name] = (dtype, tuple(shape))
    return tensors


def _index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _check_tensors(
    headers: Mapping[Path, Mapping[str, tuple[str, tuple[int, ...]]]], config: ModelConfig, path: Path
) -> dict[Path, list[str]]:
    """Every shard's tensors against the model `config` describes, from the headers alone: no tensor in two
    shards, none missing, none the config does not name, every shape the config's. Returns, per shard, the
    names to load (``model.`` prefixed, as stored)."""
    expected = expected_shapes(config)
    seen: dict[str, Path] = {}
    wanted: dict[Path, list[str]] = {}
    for file, tensors in headers.items():
        for stored, (_, shape) in tensors.items():
            name = stored.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue  # recomputed from the config, or the tied embedding's copy
            if name in seen:
                raise CheckpointError(f"tensor {shown(stored)} is in two shards; keep one copy", path=file)
            if name not in expected:
                raise CheckpointError(
                    f"tensor {shown(stored)} is not a weight of the model the config describes; is this the "
                    "checkpoint of another architecture or size?",
                    path=file,
                )
            if shape != expected[name]:
                raise CheckpointError(f"{name} has shape {shape}, config implies {expected[name]}", path=file)
            seen[name] = file
            wanted.setdefault(file, []).append(stored)
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise CheckpointError(f"checkpoint does not match its config: missing {missing[:5]}", path=path)
    return wanted


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{Hugging Face name (without ``model.``): shape} of every weight of a Llama checkpoint of `config`, computed
    from the config alone (the names and shapes `LlamaModel.hf_state_dict` has; a test holds them equal)."""
    c = config
    hidden, q, kv, inner = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inner, hidden),
        "mlp.up_proj.weight": (inner, hidden),
        "mlp.down_proj.weight": (hidden, inner),
    }
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, hidden)}
    for i in range(c.num_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["norm.weight"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def model_from_state(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> LlamaModel:
    """The `LlamaModel` of `config` holding `state` (Hugging Face names, checked against `expected_shapes`), in
    `dtype` on the CPU."""
    model = LlamaModel(config).to(dtype=dtype)
    model.load_hf_state_dict(state)  # the q/k/v and gate/up parts are concatenated, then cast
    return model


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


def _read_shard(st, file: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of one checked shard (`_shard_header`), each finite."""
    tensors = {}
    try:
        with st.safe_open(str(file), framework="pt") as shard:
            for name in names:
                tensors[name.removeprefix("model.")] = tensor = shard.get_tensor(name)
                if not bool(torch.isfinite(tensor).all()):
                    raise CheckpointError(
                        f"tensor {shown(name)} holds NaN or infinite values; the checkpoint is corrupt", path=file
                    )
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own SafetensorError (not exported as a stable type) or OSError
        raise CheckpointError(
            f"cannot read this shard ({err}); the file is truncated or not safetensors — copy the checkpoint again",
            path=file,
        ) from err
    return tensors


def load_hf_llama(
    path: str | Path, *, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
) -> LlamaModel:
    """Load a local Hugging Face Llama checkpoint directory into a `LlamaModel` (no downloads)."""
    path = Path(path)
    config_file = path / "config.json"
    config = config_from_hf(read_checkpoint_json(config_file, CONFIG_LIMITS, "checkpoint config"), path=config_file)
    st = _import_safetensors()
    headers, count = {}, 0
    for file in _shard_files(path):
        headers[file] = _shard_header(file, SAFETENSORS_LIMITS)
        count += len(headers[file])
        if count > SAFETENSORS_LIMITS.max_tensors:
            raise CheckpointError(
                f"the shards hold more than {SAFETENSORS_LIMITS.max_tensors} tensors together", path=path
            )
    state: dict[str, torch.Tensor] = {}
    for file, names in _check_tensors(headers, config, path).items():
        state.update(_read_shard(st, file, names))
    return model_from_state(config, state, dtype).to(device=device).eval()


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
