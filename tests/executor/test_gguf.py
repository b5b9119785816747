"""GGUF checkpoints (`executor.gguf_file`, `executor.gguf_llama`, `executor.gguf_tokenizer`): files written by the
`gguf` package's own writer load into the model they describe, for every supported tensor type; every lie a header
can tell is refused from the header, naming the field or tensor."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from executor import CheckpointError, Engine, EngineConfig, LlamaModel, ModelConfig, load_checkpoint
from executor.gguf_file import SUPPORTED_TYPES, read_gguf_header
from executor.gguf_llama import load_gguf_llama
from executor.hf import expected_shapes
from executor.host_memory import check_load_memory, load_memory
from executor.text import load_tokenizer
from kvstate.config import SchedulerConfig
from tests.executor.fifos import refused_without_blocking
from tests.executor.gguf_files import (
    expected,
    patch,
    tensor_entry,
    tokenizer_fields,
    write_gguf,
    write_sparse_gguf,
)

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_seed(ModelConfig(tie_word_embeddings=True), seed=7)


@pytest.fixture
def file(tmp_path, model):
    return write_gguf(tmp_path / "model.gguf", model)


def refused(path, *needles: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_gguf_llama(path)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return info.value


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_every_supported_type_loads_the_values_the_gguf_package_dequantizes(tmp_path, model, kind):
    """Query and key rows come back in Hugging Face's order (llama.cpp permutes them), every weight as the `gguf`
    package dequantizes it (F32: the float32 values written)."""
    path = write_gguf(tmp_path / f"{kind}.gguf", model, kind=kind)
    loaded = load_gguf_llama(path, dtype=torch.float32)
    assert loaded.config == replace(model.config, rms_norm_eps=float(np.float32(model.config.rms_norm_eps)))
    state = loaded.hf_state_dict()
    for name, tensor in model.hf_state_dict().items():
        weight = tensor.double().numpy()
        want = expected(weight, kind if weight.ndim == 2 else "F32")
        np.testing.assert_array_equal(state[name].numpy(), want, err_msg=name)


def test_an_untied_model_keeps_its_lm_head(tmp_path):
    model = LlamaModel.from_seed(ModelConfig(), seed=8)
    loaded = load_gguf_llama(write_gguf(tmp_path / "m.gguf", model), dtype=torch.float64)
    assert not loaded.config.tie_word_embeddings
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight.float().double())


def test_the_engine_serves_a_gguf_checkpoint_with_the_outputs_of_its_model(file, model):
    config = EngineConfig(checkpoint=str(file), device="cpu", scheduler=SchedulerConfig(gpu_blocks=8, block_size=4))
    with Engine(config) as engine:
        rid = engine.add_request([1, 2, 3], 6)
        out = engine.run()[rid]
    reference = LlamaModel.from_seed(model.config, seed=7, dtype=torch.float32).double()
    logits = reference.forward_dense([1, 2, 3, *out[:-1]])
    assert out == logits[2:].argmax(-1).tolist()
    assert isinstance(load_checkpoint(file, dtype=torch.float32, device="cpu"), LlamaModel)


def test_the_gguf_tokenizer_encodes_as_the_tokenizer_it_was_written_from(file):
    fields = tokenizer_fields()
    original, ours = fields["tokenizer"], load_tokenizer(file)
    for text in ("the quick brown fox", "over the lazy dog 12345!", "héllo wörld"):
        assert ours.encode(text) == original.encode(text).ids
    assert ours.eos_token_ids == (2,)
    ids = ours.encode("<|im_start|>the fox<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special tokens are matched whole
    assert ours.decode(ids) == "the fox"  # and skipped when decoding
    assert ours.chat("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode("12") == [ours.encode("1")[0], ours.encode("2")[0]]  # smollm isolates every digit


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{{ ''.__class__.__mro__ }}", "chat_template"),  # the sandbox refuses Python internals
        ("{% for i in range(2000) %}{% for j in range(2000) %}xx{% endfor %}{% endfor %}", "more than"),
        ("{{ raise_exception('no system turns') }}", "no system turns"),
        ("{% if %}", "cannot be rendered"),
    ],
)
def test_a_hostile_or_broken_chat_template_is_one_error(tmp_path, model, template, needle):
    path = write_gguf(tmp_path / "t.gguf", model, chat_template=template)
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(path).chat("hi")
    assert needle in str(info.value) and "chat_template" in str(info.value)


# ------------------------------------------------------------------------------------------- lying headers
def _count(offset: int):
    return lambda path: patch(path, offset, "<Q", 1 << 40)


def _first_key_length(path):
    patch(path, 24, "<Q", 1 << 50)


def _version(path):
    patch(path, 4, "<I", 1)


def _magic(path):
    patch(path, 0, "<4s", b"GGUE")


def _dims(value: int):
    return lambda path: patch(path, tensor_entry(path, "blk.0.attn_q.weight"), "<I", value)


def _first_dim(value: int):
    return lambda path: patch(path, tensor_entry(path, "blk.0.attn_q.weight") + 4, "<Q", value)


def _type(value: int):
    return lambda path: patch(path, tensor_entry(path, "blk.0.attn_q.weight") + 4 + 16, "<I", value)


def _offset(delta: int):
    def change(path):
        at = tensor_entry(path, "blk.0.attn_q.weight") + 4 + 16 + 4
        patch(path, at, "<Q", int.from_bytes(path.read_bytes()[at : at + 8], "little") + delta)

    return change


def _truncate(path):
    os.truncate(path, 600)


@pytest.mark.parametrize(
    ("lie", "needles"),
    [
        (_magic, ("field 'magic'", "not a GGUF")),
        (_version, ("field 'version'", "is 1")),
        (_count(8), ("field 'tensor_count'", "at most 65536")),
        (_count(16), ("field 'metadata_kv_count'", "at most 4096")),
        (_first_key_length, ("metadata[0].key", "bytes of text")),
        (_dims(5), ("tensor blk.0.attn_q.weight", "5 dimensions")),
        (_first_dim(0), ("tensor blk.0.attn_q.weight", "dimension of 0")),
        (_first_dim(1 << 40), ("tensor blk.0.attn_q.weight", "claims bytes", "header lies")),
        (_type(14), ("tensor blk.0.attn_q.weight", "is Q6_K", "F32, F16")),
        (_type(999), ("tensor blk.0.attn_q.weight", "unknown type 999")),
        (_offset(4), ("tensor blk.0.attn_q.weight", "not a multiple of the alignment")),
        (_offset(-32), ("overlaps the bytes of tensor",)),
        (_truncate, ("past the end of the file",)),
    ],
)
def test_a_header_that_lies_is_refused_from_the_header(file, lie, needles):
    lie(file)
    err = refused(file, str(file), *needles)
    assert err.path == str(file)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    err = refused_without_blocking(lambda: read_gguf_header(fifo), fifo)
    assert isinstance(err, CheckpointError) and "not a regular file" in str(err)


# ------------------------------------------------------------------------------------ what the model refuses
@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"architecture": "qwen2"}, ("general.architecture", "'qwen2'")),
        ({"extra_metadata": {"llama.rope.scaling.type": "linear"}}, ("llama.rope.scaling.type", "plain RoPE")),
        ({"extra_metadata": {"llama.expert_count": 8}}, ("llama.expert_count",)),
        ({"extra_metadata": {"llama.rope.dimension_count": 8}}, ("llama.rope.dimension_count", "whole heads")),
        ({"extra_tensors": {"blk.0.attn_q.bias": np.zeros(64)}}, ("blk.0.attn_q.bias", "biases")),
        ({"skip": ("blk.1.ffn_up.weight",)}, ("lacks the weights", "blk.1.ffn_up.weight")),
    ],
)
def test_what_this_model_does_not_compute_is_refused_naming_the_key_or_tensor(tmp_path, model, changes, needles):
    refused(write_gguf(tmp_path / "m.gguf", model, **changes), *needles)


def test_a_tensor_of_the_wrong_shape_and_non_finite_values_are_refused(tmp_path, model):
    path = write_gguf(tmp_path / "m.gguf", model, extra_metadata={"llama.feed_forward_length": 96})
    refused(path, "tensor blk.0.ffn_gate.weight", "(128, 64)", "implies (96, 64)")
    broken = LlamaModel.from_seed(model.config, seed=7)
    with torch.no_grad():
        broken.layers[1].input_layernorm.weight[3] = float("nan")
    refused(write_gguf(tmp_path / "nan.gguf", broken), "blk.1.attn_norm.weight", "NaN")


def test_a_missing_checkpoint_path_names_both_kinds(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file"):
        load_checkpoint(tmp_path / "nowhere", dtype=torch.float32, device="cpu")


def test_kvstate_generate_takes_a_gguf_file_and_refuses_another_file(file, tmp_path, capsys):
    from kvstate.cli import main

    assert main(["generate", "--checkpoint", str(file), "--device", "cpu", "--max-new-tokens", "4", "the fox"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "<|im_end|>" not in out
    tensors = len(read_gguf_header(file).tensors)
    assert f"kvstate generate: loading {file}: its tokenizer, and its {tensors} tensors as float32" in err
    assert f"kvstate generate: building the model from its {tensors} tensors\n" in err
    other = tmp_path / "notes.txt"
    other.write_text("not a checkpoint")
    assert main(["generate", "--checkpoint", str(other), "hi"]) == 2
    assert "is not a directory, nor a GGUF file" in capsys.readouterr().err


def test_kvstate_generate_refuses_a_truncated_gguf_file_before_importing_torch(file):
    """The header is read and checked before torch is imported: a truncated file is one line, exit 2, and the
    process never imported torch."""
    _truncate(file)
    code = (
        "import sys; from kvstate.cli import main; "
        f"status = main(['generate', '--checkpoint', {str(file)!r}, 'hi']); "
        "print(status, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    error = done.stderr.strip()
    assert "\n" not in error and str(file) in error and "past the end of the file" in error, error


# ------------------------------------------------------------------------------------------- memory
LARGE = ModelConfig(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=2,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
)  # about 1.8 billion weights: 3.4 GB as F16


def test_a_sparse_file_larger_than_any_machine_is_refused_before_reading(tmp_path):
    """A consistent header whose tensor data is a hole in the file: refused from the header, naming the memory
    loading takes and what the machine has, before a byte of tensor data is read."""
    huge = replace(LARGE, hidden_size=16384, intermediate_size=65536, num_layers=64, num_heads=128)
    path = write_sparse_gguf(tmp_path / "sparse.gguf", huge, "Q4_0")
    assert os.stat(path).st_blocks * 512 < 1 << 20 < path.stat().st_size  # a hole: no data on disk
    header = read_gguf_header(path)
    assert load_memory(header, torch.float32) > 1 << 41  # more than 2 TiB: more than this machine has
    with pytest.raises(CheckpointError) as info:
        load_gguf_llama(path, dtype=torch.float32)
    message = str(info.value)
    assert message.startswith(f"{path}: field 'tensors': loading its {len(header.tensors)} tensors as float32")
    assert "GiB available" in message and "\n" not in message


def test_kvstate_generate_refuses_a_sparse_file_too_large_before_importing_torch(tmp_path):
    """A file `kvstate generate` would take (tokenizer included) whose weights need more memory than the machine
    has: refused from the header in the dtype the command loads into (float32 unless --dtype says otherwise),
    one line naming the file and both amounts, exit 2, and the process never imported torch."""
    huge = replace(LARGE, hidden_size=16384, intermediate_size=65536, num_layers=64, num_heads=128)
    path = write_sparse_gguf(tmp_path / "sparse.gguf", huge, "Q4_0", tokenizer=True)
    code = (
        "import sys; from kvstate.cli import main; "
        f"default = main(['generate', '--checkpoint', {str(path)!r}, 'hi']); "
        f"wide = main(['generate', '--checkpoint', {str(path)!r}, '--dtype', 'float64', 'hi']); "
        "print(default, wide, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["2", "2", "False"], (done.stdout, done.stderr)
    header = read_gguf_header(path)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr
    for line, dtype in zip(lines, ("float32", "float64"), strict=True):
        needed = f"{load_memory(header, dtype) / 1024**3:.2f} GiB"
        assert line.startswith(f"kvstate generate: error: {path}: field 'tensors': loading its {len(header.tensors)}")
        assert f"tensors as {dtype} takes at least {needed} of memory" in line and "GiB available" in line, line


def test_the_memory_check_counts_every_weight_in_float32_and_the_run_dtype(tmp_path):
    path = write_sparse_gguf(tmp_path / "sparse.gguf", LARGE)  # the F16 file of 3.4 GB, 4 KiB on disk
    header = read_gguf_header(path)
    weights = sum(int(np.prod(info.shape)) for info in header.tensors)
    assert weights == sum(int(np.prod(shape)) for shape in expected_shapes(LARGE).values())
    needed = load_memory(header, torch.float64)
    assert needed >= weights * (4 + 8) and needed > load_memory(header, torch.float32)
    check_load_memory(header, torch.float64, available=needed)  # exactly enough
    with pytest.raises(CheckpointError, match=r"takes at least .* GiB of memory, but this machine has 1\.00 GiB"):
        check_load_memory(header, torch.float64, available=1 << 30)


def test_a_tensor_name_holding_a_newline_cannot_forge_a_line(tmp_path, model):
    """Names read from the file are escaped in every message: an error stays one line whatever a name holds."""
    first, second = "a\nkvstate generate: ok, forged", "b\rforged\x1b[2K"
    path = write_gguf(tmp_path / "m.gguf", model, extra_tensors={first: np.zeros(8), second: np.zeros(8)})
    at = tensor_entry(path, second) + 4 + 8 + 4  # one dimension, then the type: its offset follows
    patch(path, at, "<Q", int.from_bytes(path.read_bytes()[at : at + 8], "little") - 32)  # onto the first one
    with pytest.raises(CheckpointError) as info:
        read_gguf_header(path)
    message = str(info.value)
    assert "overlaps the bytes of tensor 'a\\nkvstate generate: ok, forged'" in message
    assert not any(c in message for c in "\n\r\x1b"), message


def test_arrays_past_the_headers_total_are_refused_before_they_are_read(tmp_path):
    """Fifteen arrays of two million uint16 each: every one within the per-array limit, together 30 million
    Python objects. Refused at the array that passes the header's total, before its items are read."""
    from executor.gguf_file import GGUF_LIMITS

    items = 2_000_000
    path = tmp_path / "arrays.gguf"
    with path.open("wb") as out:
        out.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 15))
        for i in range(15):
            key = f"general.array{i}".encode()
            out.write(struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 2, items) + bytes(2 * items))
    with pytest.raises(CheckpointError) as info:
        read_gguf_header(path)
    message = str(info.value)
    assert f"at most {GGUF_LIMITS.max_total_items} in all" in message and "general.array1" in message
