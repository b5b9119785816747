"""Llama checkpoints in GGUF: the model's config from the header's metadata, its weights dequantized into a
`LlamaModel` (`load_gguf_llama`); `EngineConfig(checkpoint="model.gguf")` loads one (`executor.checkpoint`).

What is whose. The header is read by `executor.gguf_file` (bounded: the well-kept readers trust every length a
header states). The tensor names are the `gguf` package's (`gguf.get_tensor_name_map`, llama.cpp's own table of
which Hugging Face name each GGUF name stands for), and so is the dequantization of each block type. What is
ours is small: the config keys (``llama.embedding_length`` -> ``hidden_size``, ...) and undoing the row order
llama.cpp's converter gives the query and key projections (it interleaves each head's two rotary halves, for its
own rotary kernel; `unpermute_rows`). transformers' own GGUF loading (``from_pretrained(..., gguf_file=...)``)
does the same through `gguf`, but builds a transformers model (and, from version 5, keeps quantized layers
quantized) and checks neither a header's sizes nor which tensors it names, so it serves as the independent
witness in the tests rather than as the loader.

Invariants kept: the architecture is ``llama`` with plain RoPE over whole heads, no biases and no experts; every
tensor the file holds is a weight of the model its metadata describes, with that weight's shape, and every weight
is there (``output.weight`` absent means tied embeddings); the memory loading takes (every weight as float32 and
in the model's dtype) fits what the machine has available — all checked from the header, before any tensor data
is read or any memory is allocated for the model (a file whose weights are a sparse hole is refused unread;
`executor.host_memory` computes the memory from the header alone, so a command checks it before importing torch).
Refusals are `CheckpointError`s naming the file and the metadata key or tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from executor.checkpoint_files import CheckpointError
from executor.gguf_file import GGUFHeader, import_gguf, read_gguf_header, read_tensor
from executor.hf import SIZE_LIMITS, expected_shapes, model_from_state
from executor.host_memory import check_load_memory
from executor.model import LlamaModel, ModelConfig
from kvstate.untrusted import Fields, shown

ARCHITECTURE = "llama"
OUTPUT = "output.weight"  # the GGUF name of the LM head; a file without it ties the embeddings


def gguf_llama_config(header: GGUFHeader) -> ModelConfig:
    """The `ModelConfig` the header's ``llama.*`` metadata describes; refuses what this model does not compute."""
    meta = Fields.of(header.metadata, "the GGUF metadata", path=header.path, error=CheckpointError)
    architecture = meta.get("general.architecture")
    if architecture != ARCHITECTURE:
        raise meta.fail(
            "general.architecture", f"is {shown(architecture)}; only {ARCHITECTURE!r} checkpoints load here"
        )

    def key(name: str) -> str:
        return f"{ARCHITECTURE}.{name}"

    for name, default in (("rope.scaling.type", "none"), ("expert_count", 0), ("rope.scaling.factor", 1.0)):
        if meta.get(key(name), default) not in (default, None):
            raise meta.fail(key(name), f"is {shown(meta.get(key(name)))}: only plain RoPE, dense models load")

    def size(name: str, limit: str, default: int | None = None) -> int:
        if default is not None and key(name) not in meta.data:
            return default
        return meta.integer(key(name), minimum=1, maximum=SIZE_LIMITS[limit])

    hidden = size("embedding_length", "hidden_size")
    heads = size("attention.head_count", "num_attention_heads")
    head_dim = size("attention.key_length", "head_dim", hidden // heads or 1)
    for name in ("attention.value_length", "rope.dimension_count"):
        if size(name, "head_dim", head_dim) != head_dim:
            raise meta.fail(key(name), f"is not the head size {head_dim}: only rotary over whole heads loads")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    embedding = header.tensor("token_embd.weight")
    vocab = len(tokens) if isinstance(tokens, list) else embedding.shape[0] if embedding is not None else None
    try:
        return ModelConfig(
            vocab_size=size("vocab_size", "vocab_size", vocab),
            hidden_size=hidden,
            intermediate_size=size("feed_forward_length", "intermediate_size"),
            num_layers=size("block_count", "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("attention.head_count_kv", "num_key_value_heads", heads),
            head_dim=head_dim,
            max_position_embeddings=size("context_length", "max_position_embeddings", 4096),
            rope_theta=meta.number(key("rope.freq_base"), positive=True, default=10000.0),
            rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), positive=True, default=1e-5),
            tie_word_embeddings=header.tensor(OUTPUT) is None,
        )
    except ValueError as err:  # ModelConfig's own checks: heads that do not group, an odd head size
        raise CheckpointError(
            f"the metadata describes no model this engine can build: {err}", path=header.path
        ) from err


def gguf_names(config: ModelConfig) -> dict[str, str]:
    """{GGUF tensor name: Hugging Face name (without ``model.``)} of every weight of `config`'s model, from
    the `gguf` package's name table."""
    gguf = import_gguf()
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)
    names = {}
    for name in expected_shapes(config):
        base, suffix = name.rsplit(".", 1)
        mapped = table.get_name(base if base == "lm_head" else f"model.{base}")
        if mapped is None:  # pragma: no cover - the gguf package's table covers every Llama weight
            raise CheckpointError(f"the gguf package has no GGUF name for {name}; upgrade it (pip install -U gguf)")
        names[f"{mapped}.{suffix}"] = name
    return names


def check_tensors(header: GGUFHeader, config: ModelConfig) -> dict[str, str]:
    """Refuse a file whose tensors are not exactly the weights of `config`'s model, with their shapes (from the
    header alone); returns {GGUF name: Hugging Face name}."""
    names, shapes = gguf_names(config), expected_shapes(config)
    for info in header.tensors:
        if info.name not in names:
            raise CheckpointError(
                f"tensor {shown(info.name)} is not a weight of the Llama its metadata describes (biases, "
                "experts and rope_freqs are not supported); is this another architecture?",
                path=header.path,
                field=f"tensor {info.name}",
            )
        expected = shapes[names[info.name]]
        if info.shape != expected:
            raise CheckpointError(
                f"has shape {info.shape}, the metadata implies {expected}",
                path=header.path,
                field=f"tensor {info.name}",
            )
    missing = sorted(set(names) - {info.name for info in header.tensors})
    if missing:
        raise CheckpointError(f"the file lacks the weights {missing[:5]}", path=header.path)
    return names


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of a query or key projection: per head it stores rows (i, half) for the
    Hugging Face order (half, i) (rotary halves interleaved); `heads` is the projection's head count."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def load_gguf_llama(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    header: GGUFHeader | None = None,
    progress: Callable[[str], None] | None = None,
) -> LlamaModel:
    """Load a local GGUF Llama checkpoint into a `LlamaModel` (no downloads); `header` reuses one already read;
    `progress` is told when the tensors are read and the model is built from them."""
    header = header or read_gguf_header(path)
    config = gguf_llama_config(header)
    names = check_tensors(header, config)
    check_load_memory(header, dtype)
    permuted = {"self_attn.q_proj.weight": config.num_heads, "self_attn.k_proj.weight": config.num_kv_heads}
    state = {}
    for info in header.tensors:
        name = names[info.name]
        weight = torch.from_numpy(read_tensor(header, info))
        heads = next((count for suffix, count in permuted.items() if name.endswith(suffix)), None)
        state[name] = weight if heads is None else unpermute_rows(weight, heads)
    if progress is not None:
        progress(f"building the model from its {len(state)} tensors")
    return model_from_state(config, state, dtype).to(device=device).eval()
