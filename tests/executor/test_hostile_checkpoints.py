"""Hostile Hugging Face checkpoints: a safetensors header that claims what the config
never names, or too much, is refused from the header before any tensor data is read; a FIFO in place of a
checkpoint file is refused without waiting on it; tokenizer.json is read bounded; a pre-tokenizer regex that
makes the Rust tokenizer panic is one error line."""

from __future__ import annotations

import json
import os
import struct

import pytest

from executor import CheckpointError, LlamaModel, load_hf_llama, save_hf_llama
from executor.text import TOKENIZER_MAX_BYTES, load_tokenizer
from kvstate.cli import main
from tests.executor.fifos import refused_without_blocking

st = pytest.importorskip("safetensors.torch")


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    save_hf_llama(LlamaModel.from_seed(seed=1), path)
    return path


@pytest.fixture
def no_data_read(monkeypatch):
    """Fail the test if any safetensors tensor data is read (the refusals below come from the header)."""

    def read(*args, **kwargs):
        raise AssertionError("tensor data was read before the header was checked")

    monkeypatch.setattr(st, "load_file", read)
    monkeypatch.setattr(st, "safe_open", read)


def rewrite_header(file, change) -> None:
    """Rewrite the JSON header of the safetensors `file` with `change(header) -> (header, extra data bytes)`;
    the extra bytes are a hole (a sparse file), not written."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header, extra = change(json.loads(data[8 : 8 + length]))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with file.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
        handle.truncate(8 + len(raw) + len(data) - 8 - length + extra)


def end_of_data(header: dict) -> int:
    return max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")


def test_a_huge_tensor_the_config_never_names_is_refused_before_any_data_is_read(checkpoint, no_data_read):
    """Item 14: a 3 GiB tensor in a sparse file (nothing on disk) was read in full and checked for NaN first."""
    size = 3 << 30

    def claim(header):
        end = end_of_data(header)
        header["model.extra.weight"] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [end, end + size]}
        return header, size

    rewrite_header(checkpoint / "model.safetensors", claim)
    with pytest.raises(CheckpointError, match=r"model\.extra\.weight.*not a weight of the model the config"):
        load_hf_llama(checkpoint)


def test_a_header_with_more_tensors_than_the_bound_is_refused_from_the_header(checkpoint, no_data_read):
    """Item 14: a header of 600,000 tensors took > 300 s; the count is bounded (65,536 for all shards)."""

    def many(header):
        end = end_of_data(header)
        for i in range(65_537):
            header[f"t{i}"] = {"dtype": "F32", "shape": [1], "data_offsets": [end + 4 * i, end + 4 * i + 4]}
        return header, 4 * 65_537

    rewrite_header(checkpoint / "model.safetensors", many)
    with pytest.raises(CheckpointError, match="at most 65536 are read"):
        load_hf_llama(checkpoint)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda h: ({**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [1 << 40]}}, 0), "do not hold"),
        (lambda h: ({**h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "I8"}}, 0), "torch.int8"),
        (lambda h: ({**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [128]}}, 0), "do not hold"),
    ],
)
def test_a_header_that_lies_about_a_tensor_is_refused_before_any_data_is_read(checkpoint, no_data_read, change, needle):
    rewrite_header(checkpoint / "model.safetensors", change)
    with pytest.raises(CheckpointError, match=needle):
        load_hf_llama(checkpoint)


def test_a_header_length_past_the_file_is_refused(checkpoint, no_data_read):
    file = checkpoint / "model.safetensors"
    data = bytearray(file.read_bytes())
    struct.pack_into("<Q", data, 0, 1 << 40)
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="the safetensors header states 1099511627776 bytes"):
        load_hf_llama(checkpoint)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_waiting(checkpoint, name):
    """Item 19: a FIFO as config.json or the shard index hung forever (open() waits for a writer)."""
    if name != "config.json":
        (checkpoint / "model.safetensors").unlink()
    fifo = checkpoint / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    err = refused_without_blocking(lambda: load_hf_llama(checkpoint), fifo)
    assert isinstance(err, CheckpointError) and "not a regular file" in str(err)


def test_tokenizer_json_is_read_bounded(checkpoint, monkeypatch):
    """Item 19: tokenizer.json was read whole; a sparse one of 1 GiB is refused after reading its limit."""
    tokenizers = pytest.importorskip("tokenizers")

    def parse(*args, **kwargs):
        raise AssertionError("an oversized tokenizer.json was handed to the parser")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", parse)
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", parse)
    with (checkpoint / "tokenizer.json").open("wb") as handle:
        handle.truncate(1 << 30)
    with pytest.raises(CheckpointError, match=f"larger than {TOKENIZER_MAX_BYTES} bytes"):
        load_tokenizer(checkpoint)


def test_a_fifo_as_tokenizer_json_is_refused(checkpoint):
    os.mkfifo(checkpoint / "tokenizer.json")
    err = refused_without_blocking(lambda: load_tokenizer(checkpoint), checkpoint / "tokenizer.json")
    assert isinstance(err, CheckpointError) and "not a regular file" in str(err)


def test_a_pre_tokenizer_regex_that_panics_the_tokenizer_is_one_error_line(checkpoint, capfd):
    """Item 19: a backtracking regex made tokenizers' Rust code panic (pyo3's PanicException, a BaseException, and
    Rust's own message on stderr); `kvstate generate` prints one error line instead, exit status 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    document = json.loads(tokenizer.to_str())
    document["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(x+x+)+y"}, "behavior": "Isolated"}
    document["pre_tokenizer"]["invert"] = False
    (checkpoint / "tokenizer.json").write_text(json.dumps(document))
    status = main(["generate", "--checkpoint", str(checkpoint), "--device", "cpu", "--quiet", "x" * 40])
    _, err = capfd.readouterr()
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "tokenizer failed to encode the prompt" in lines[0] and "retry-limit-in-match" in lines[0]
    assert "panicked" not in err and "Traceback" not in err
