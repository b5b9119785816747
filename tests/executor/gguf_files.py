"""Test data: GGUF files of a seeded `LlamaModel`, written with the `gguf` package's own `GGUFWriter` as llama.cpp's
converter writes them (query and key rows permuted for its rotary kernel, 2-D weights quantized, norms in F32),
with a small byte-level BPE tokenizer; and byte patches that make a file's header lie."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from executor import LlamaModel, ModelConfig
from executor.hf import expected_shapes

gguf = pytest.importorskip("gguf")

ROWS = {"self_attn.q_proj.weight": "num_heads", "self_attn.k_proj.weight": "num_kv_heads"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a query or key projection (what the loader undoes)."""
    split = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def stored(weight: np.ndarray, kind: str) -> np.ndarray:
    """`weight` as the file holds it in type `kind` (quantized bytes, or plain values)."""
    if kind == "F32":
        return weight.astype(np.float32)
    if kind == "F16":
        return weight.astype(np.float16)
    return gguf.quants.quantize(weight.astype(np.float32), gguf.GGMLQuantizationType[kind])


def expected(weight: np.ndarray, kind: str) -> np.ndarray:
    """What a loader must recover from `weight` stored as `kind`: the values the `gguf` package dequantizes."""
    if kind == "F32":
        return weight.astype(np.float32)
    data = stored(weight, kind)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(weight.shape)


def tokenizer_fields() -> dict:
    """A byte-level BPE tokenizer trained on a few sentences, as GGUF metadata (tokens, merges, types)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(  # what llama.cpp's pre-tokenizer "smollm" splits
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog 12345"] * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types, "tokenizer": tokenizer}


def add_tokenizer(writer, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Write `tokenizer_fields`' tokenizer (and `chat_template`) into the metadata of `writer`'s file."""
    fields = tokenizer_fields()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    path: Path,
    model: LlamaModel,
    *,
    kind: str = "F32",
    architecture: str = "llama",
    extra_metadata: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    skip: tuple[str, ...] = (),
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Write `model` as a GGUF file at `path`: 2-D weights in `kind`, 1-D ones in F32, tensors named by the `gguf`
    package's table, metadata under ``{architecture}.``; `skip` leaves out GGUF tensor names."""
    c: ModelConfig = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    add_tokenizer(writer, chat_template)
    for key, value in (extra_metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32
        add(key, value)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_layers)
    for name, tensor in model.hf_state_dict().items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{table.get_name(base if base == 'lm_head' else f'model.{base}')}.{suffix}"
        if gguf_name in skip:
            continue
        weight = tensor.detach().to(torch.float64).numpy()
        for part, heads in ROWS.items():
            if name.endswith(part):
                weight = permute_rows(weight, getattr(c, heads))
        kind_here = kind if weight.ndim == 2 else "F32"
        writer.add_tensor(gguf_name, stored(weight, kind_here), raw_dtype=gguf.GGMLQuantizationType[kind_here])
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patch(path: Path, offset: int, fmt: str, value) -> None:
    """Overwrite the bytes at `offset` with `struct.pack(fmt, value)`."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))


def tensor_entry(path: Path, name: str) -> int:
    """The offset of the dimension count that follows tensor `name`'s name in the header's tensor table."""
    encoded = name.encode()
    needle = struct.pack("<Q", len(encoded)) + encoded
    return path.read_bytes().index(needle) + len(needle)


def write_sparse_gguf(path: Path, config: ModelConfig, kind: str = "F16", *, tokenizer: bool = False) -> Path:
    """A GGUF file of `config`'s model whose header is consistent (every tensor inside the file, none
    overlapping) but whose tensor data is a hole: the file is extended, never written, so it takes a few KiB of
    disk however large it claims to be. `tokenizer` adds a tokenizer, so the file is one `kvstate generate`
    takes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer:
        add_tokenizer(writer)
    raw = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[raw]
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)
    data = 0
    for name, shape in expected_shapes(config).items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{table.get_name(base if base == 'lm_head' else f'model.{base}')}.{suffix}"
        here, size = (raw, block_bytes / block) if len(shape) == 2 else (gguf.GGMLQuantizationType.F32, 4)
        nbytes = int(np.prod(shape) * size)
        writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), nbytes, raw_dtype=here)
        data += -(-nbytes // 32) * 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    header_bytes = path.stat().st_size
    with path.open("r+b") as handle:
        handle.truncate(-(-header_bytes // 32) * 32 + data)
    return path
