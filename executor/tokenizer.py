"""A checkpoint's tokenizer: a `tokenizers.Tokenizer`, its end-of-sequence ids and its chat template.

Built from a Hugging Face ``tokenizer.json`` (`executor.text.load_tokenizer`) or from a GGUF file's metadata
(`executor.gguf_tokenizer`). The tokenizer is untrusted input: a hostile pre-tokenizer regex can make the Rust
library panic while encoding (for example on catastrophic backtracking, "retry-limit-in-match over"), which
pyo3 raises as a `BaseException` after Rust has written its panic message to the process's stderr.
`guarded` turns that into one `CheckpointError` line and drops the panic message (anything else the call wrote
to stderr is written again).

Invariants kept: `CheckpointTokenizer.encode` returns ids of the tokenizer's vocabulary, or raises a
`CheckpointError` naming `source`; `chat` renders the template in a Jinja2 sandbox (`executor.chat`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from executor.chat import render_chat
from executor.checkpoint_files import CheckpointError

T = TypeVar("T")


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
    """A checkpoint's tokenizer, the file it was read from (`source`), its end-of-sequence ids, and its chat
    template (None: prompts are used as they are) with the special tokens the template may name."""

    tokenizer: TextTokenizer
    eos_token_ids: tuple[int, ...]
    source: Path
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return guarded(lambda: self.tokenizer.encode(text).ids, "encode the prompt", self.source)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, user_text: str) -> str:
        """`user_text` as one user turn of the chat template, ready for the assistant's answer."""
        if self.chat_template is None:
            raise CheckpointError("has no chat template; pass the prompt as it is", path=self.source)
        return render_chat(
            self.chat_template,
            [{"role": "user", "content": user_text}],
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            source=self.source,
        )


def guarded(call: Callable[[], T], what: str, source: Path) -> T:
    """`call()`, with a Rust panic inside it raised as a `CheckpointError` naming `source` and `what` was being
    done, and the panic message Rust printed to the stderr file descriptor dropped (other output kept)."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            return call()
        except BaseException as err:
            if type(err).__name__ != "PanicException":  # pyo3's, not importable by a stable name
                raise
            sink.truncate(0)  # the panic message: the error below says it in one line
            raise CheckpointError(
                f"the tokenizer failed to {what} ({str(err).splitlines()[0] if str(err) else 'a Rust panic'}); "
                "its file is broken or hostile (a pre-tokenizer regex that backtracks without end?) — use the "
                "checkpoint's own tokenizer",
                path=source,
            ) from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = sink.read()
            if kept:
                os.write(2, kept)
