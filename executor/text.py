"""Text in, text out: a checkpoint's own tokenizer around an `Engine` (`kvstate generate`).

A checkpoint directory (`EngineConfig(checkpoint=DIR)`, see `executor.hf`) that also holds the tokenizer it was
trained with — ``tokenizer.json``, as written by `tokenizers.Tokenizer.save` or a fast tokenizer's
``save_pretrained`` — is loaded with the `tokenizers` library from the local directory; nothing is downloaded.
The end-of-sequence ids come from ``generation_config.json`` or ``config.json`` (``eos_token_id``) when present.
A GGUF checkpoint (`EngineConfig(checkpoint="model.gguf")`) carries its tokenizer, stop ids and chat template in
its header (`executor.gguf_tokenizer`).

Invariants kept: ``tokenizer.json`` is read only from a regular file and only up to `TOKENIZER_MAX_BYTES`, and a
Rust panic while parsing or encoding is one `CheckpointError` (`executor.tokenizer.guarded`); every id
`CheckpointTokenizer.encode` returns is below the model's vocabulary size (checked once, when the tokenizer is
paired with an engine); the pieces `generate_text` yields concatenate to a prefix of the decoding of the tokens
generated so far (a piece is held back while it ends in an incomplete character), and to the whole decoding at
the end when decoding is prefix-stable (as byte-level BPE is).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

from executor.checkpoint_files import CheckpointError, read_bounded, read_checkpoint_json
from executor.engine import Engine
from executor.gguf_file import read_gguf_header
from executor.gguf_tokenizer import gguf_tokenizer
from executor.hf import CONFIG_LIMITS
from executor.sampler import GREEDY, SamplingParams
from executor.tokenizer import CheckpointTokenizer, TextTokenizer, guarded
from kvstate.untrusted import decode

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_MAX_BYTES = 64 << 20  # Llama 3's tokenizer.json is 9 MiB
INCOMPLETE = "\ufffd"  # what a decoder yields for the first bytes of a character split across tokens


def load_tokenizer(checkpoint: str | Path) -> CheckpointTokenizer:
    """The tokenizer of a checkpoint: the ``tokenizer.json`` in its directory, or a GGUF file's own;
    `CheckpointError` names the file when it is missing or bad."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise CheckpointError("text generation needs the 'tokenizers' package: pip install 'kvstate[text]'") from err
    directory = Path(checkpoint)
    if directory.is_file():
        return gguf_tokenizer(read_gguf_header(directory))
    path = directory / TOKENIZER_FILE
    if not path.exists():
        raise CheckpointError(
            f"{directory}: {TOKENIZER_FILE} not found; save the checkpoint's tokenizer there "
            "(tokenizers.Tokenizer.save or a fast tokenizer's save_pretrained)"
        )
    text = decode(read_bounded(path, TOKENIZER_MAX_BYTES, "tokenizer"), "tokenizer", path=path, error=CheckpointError)
    try:
        tokenizer = guarded(lambda: Tokenizer.from_str(text), "load", path)
    except CheckpointError:
        raise
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{path}: not a tokenizers JSON file ({str(err)[:200]}); re-save the tokenizer") from None
    return CheckpointTokenizer(tokenizer, _eos_token_ids(directory), path)


def _eos_token_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.exists():
            continue
        config = read_checkpoint_json(path, CONFIG_LIMITS, "checkpoint config")
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
            f"{tokenizer.source} has {tokenizer.vocab_size} token ids but the "
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
    progress: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """Submit `prompt` as text and yield the generated text piece by piece as the engine produces tokens.

    `tokenizer` defaults to the one in the engine's checkpoint directory. The engine is stepped until every
    request it holds is done (`Engine.stream`); only this request's text is yielded. `progress` is told how many
    tokens the prompt is before its prefill starts.
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
    if progress is not None:
        progress(f"prefill of {len(ids)} prompt tokens, then up to {max_new_tokens} new tokens")
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


__all__ = ["CheckpointTokenizer", "TextTokenizer", "check_fits", "generate_text", "load_tokenizer"]
