"""The tokenizer a GGUF header describes: metadata that no BPE can be built from is one error naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor import CheckpointError
from executor.gguf_file import GGUFHeader
from executor.gguf_tokenizer import gguf_tokenizer
from tests.executor.gguf_files import tokenizer_fields

FIELDS = tokenizer_fields()


def header(changes: dict[str, object] | None = None) -> GGUFHeader:
    """The header of a file holding the test tokenizer, with `changes` to its metadata."""
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": FIELDS["tokens"],
        "tokenizer.ggml.merges": FIELDS["merges"],
        "tokenizer.ggml.token_type": FIELDS["types"],
        "tokenizer.ggml.eos_token_id": 2,
    }
    metadata.update(changes or {})
    return GGUFHeader(Path("model.gguf"), 3, metadata, ())


def test_the_test_tokenizer_builds() -> None:
    tokenizer = gguf_tokenizer(header())
    assert tokenizer.decode(tokenizer.encode("the lazy dog")) == "the lazy dog"


@pytest.mark.parametrize(
    ("merge", "missing"),
    [("zz qq", "'zz'"), ("t qq", "'qq'"), ("Ġ Ġ", "'ĠĠ'")],
    ids=["both-unknown", "second-unknown", "result-unknown"],
)
def test_a_merge_naming_a_token_not_in_the_vocabulary_is_refused(merge: str, missing: str) -> None:
    merges = [*FIELDS["merges"], merge]
    with pytest.raises(CheckpointError) as info:
        gguf_tokenizer(header({"tokenizer.ggml.merges": merges}))
    message = str(info.value)
    assert message.startswith(f"model.gguf: field 'tokenizer.ggml.merges[{len(merges) - 1}]': is {merge!r}: ")
    assert f"{missing} is not in the vocabulary" in message and "\n" not in message


def test_a_vocabulary_larger_than_the_model_embeds_is_refused_before_it_is_built() -> None:
    from executor.gguf_file import TensorInfo

    rows = len(FIELDS["tokens"]) - 1
    embedding = TensorInfo("token_embd.weight", (rows, 64), "F32", 0, rows * 64 * 4)
    plain = header()
    with pytest.raises(CheckpointError) as info:
        gguf_tokenizer(GGUFHeader(plain.path, plain.version, plain.metadata, (embedding,)))
    assert f"holds {len(FIELDS['tokens'])} tokens but the model embeds {rows}" in str(info.value)
    assert "field 'tokenizer.ggml.tokens'" in str(info.value)


def test_more_special_tokens_than_are_read_are_refused_before_the_tokenizer_is_built() -> None:
    from executor.gguf_tokenizer import CONTROL, MAX_SPECIAL_TOKENS

    extra = [f"<|reserved_{i}|>" for i in range(MAX_SPECIAL_TOKENS)]
    tokens = [*FIELDS["tokens"], *extra]
    types = [*FIELDS["types"], *[CONTROL] * len(extra)]
    with pytest.raises(CheckpointError, match=f"more than the {MAX_SPECIAL_TOKENS} read here") as info:
        gguf_tokenizer(header({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}))
    assert "field 'tokenizer.ggml.token_type'" in str(info.value)


@pytest.mark.parametrize("bos", ["<s> x", "$B", "a:1"], ids=["space", "sequence", "colon"])
def test_a_bos_token_that_cannot_be_prepended_is_refused_naming_the_field(bos: str) -> None:
    tokens = [*FIELDS["tokens"], bos]
    changes = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [*FIELDS["types"], 3],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    with pytest.raises(CheckpointError) as info:
        gguf_tokenizer(header(changes)).encode("the fox")
    message = str(info.value)
    assert message.startswith("model.gguf: field 'tokenizer.ggml.bos_token_id': ") and repr(bos) in message


def test_a_plain_bos_token_is_prepended() -> None:
    changes = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": True}
    assert gguf_tokenizer(header(changes)).encode("the fox")[0] == 1


def test_token_types_that_are_not_integers_are_refused() -> None:
    types = [*FIELDS["types"][:-1], "3"]
    with pytest.raises(CheckpointError, match=r"token_type\[\d+\]': is '3'; a token type is an integer"):
        gguf_tokenizer(header({"tokenizer.ggml.token_type": types}))
