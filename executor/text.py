"""Text in, text out: a checkpoint's own Hugging Face tokenizer around an `Engine` (`kvstate generate`).

A checkpoint directory (`EngineConfig(checkpoint=DIR)`, see `executor.hf`) that also holds the tokenizer it was
trained with — ``tokenizer.json``, as written by `tokenizers.Tokenizer.save` or a fast tokenizer's
``save_pretrained`` — is loaded with the `tokenizers` library from the local directory; nothing is downloaded.
The end-of-sequence ids come from ``generation_config.json`` or ``config.json`` (``eos_token_id``) when present.

Invariants kept: every id `CheckpointTokenizer.encode` returns is below the model's vocabulary size (checked once,
when the tokenizer is paired with an engine); the pieces `generate_text` yields concatenate to a prefix of the
decoding of the tokens generated so far (a piece is held back while it ends in an incomplete character), and to
the whole decoding at the end when decoding is prefix-stable (as byte-level BPE is).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from executor.engine import Engine
from executor.hf import CONFIG_LIMITS, CheckpointError
from executor.sampler import GREEDY, SamplingParams
from kvstate.untrusted import read_json

TOKENIZER_FILE = "tokenizer.json"
INCOMPLETE = "\ufffd"  # what a decoder yields for the first bytes of a character split across tokens


class _Encoding(Protocol):
    @property
    def ids(self) -> list[int]: ...


class TextTokenizer(Protocol):
    """What `CheckpointTokenizer` uses of a `tokenizers.Tokenizer` (an optional dependency: kvstate[text])."""

    def get_vocab_size(self, /, with_added_tokens: bool = True) -> int: ...

    def encode(self, /, sequence: str) -> _Encoding: ...

    def decode(self, /, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class CheckpointTokenizer:
    """A checkpoint's tokenizer (`tokenizers.Tokenizer`) and its end-of-sequence ids."""

    tokenizer: TextTokenizer
    eos_token_ids: tuple[int, ...]
    source: Path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(checkpoint: str | Path) -> CheckpointTokenizer:
    """The tokenizer saved in the checkpoint directory; `CheckpointError` names the file when it is missing or bad."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise CheckpointError("text generation needs the 'tokenizers' package: pip install 'kvstate[text]'") from err
    directory = Path(checkpoint)
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{directory}: {TOKENIZER_FILE} not found; save the checkpoint's tokenizer there "
            "(tokenizers.Tokenizer.save or a fast tokenizer's save_pretrained)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{path}: not a tokenizers JSON file ({err}); re-save the tokenizer") from None
    return CheckpointTokenizer(tokenizer, _eos_token_ids(directory), directory)


def _eos_token_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        config = read_json(path, CONFIG_LIMITS, "checkpoint config", CheckpointError)
        value = config.get("eos_token_id") if isinstance(config, dict) else None
        ids = value if isinstance(value, list) else [value]
        if value is not None:
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
            return tuple(ids)
    return ()


def check_fits(tokenizer: CheckpointTokenizer, engine: Engine) -> None:
    """Refuse a tokenizer whose ids the engine's model cannot embed."""
    vocab = engine.model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise CheckpointError(
            f"{tokenizer.source / TOKENIZER_FILE} has {tokenizer.vocab_size} token ids but the "
            f"model's vocabulary has {vocab}; pair the checkpoint with the tokenizer it was "
            "trained with"
        )


def generate_text(
    engine: Engine,
    prompt: str,
    *,
    max_new_tokens: int,
    tokenizer: CheckpointTokenizer | None = None,
    sampling: SamplingParams = GREEDY,
    request_id: Hashable | None = None,
) -> Iterator[str]:
    """Submit `prompt` as text and yield the generated text piece by piece as the engine produces tokens.

    `tokenizer` defaults to the one in the engine's checkpoint directory. The engine is stepped until every
    request it holds is done (`Engine.stream`); only this request's text is yielded.
    """
    if tokenizer is None:
        if engine.config.checkpoint is None:
            raise CheckpointError(
                "the engine has no checkpoint, so no tokenizer: pass tokenizer= or build the "
                "engine with EngineConfig(checkpoint=DIR)"
            )
        tokenizer = load_tokenizer(engine.config.checkpoint)
    check_fits(tokenizer, engine)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; pass some text")
    rid = engine.add_request(
        ids, max_new_tokens, stop_token_ids=tokenizer.eos_token_ids, sampling=sampling, request_id=request_id
    )
    generated: list[int] = []
    emitted = ""
    for produced_by, token in engine.stream():
        if produced_by != rid:
            continue
        generated.append(token)
        text = tokenizer.decode(generated)
        if text.endswith(INCOMPLETE) or not text.startswith(emitted):
            continue
        if len(text) > len(emitted):
            yield text[len(emitted) :]
            emitted = text
    text = tokenizer.decode(generated)
    if text.startswith(emitted) and len(text) > len(emitted):
        yield text[len(emitted) :]
