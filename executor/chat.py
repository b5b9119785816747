"""Chat templates (the Jinja2 templates checkpoints ship to format a conversation), rendered in Jinja2's
immutable sandbox, as transformers renders them: blocks trimmed, `raise_exception` available.

A template is untrusted input: the sandbox (`executor.chat_sandbox`) refuses access to Python internals, bounds
what the template may build and how long it may run; the rendered text is refused past `MAX_RENDERED_CHARS`. Every
failure (a refusal, a syntax error, a `MemoryError` or `RecursionError` all the same) is a `CheckpointError` naming
the file the template came from and the field ``chat_template``, on one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from executor.checkpoint_files import CheckpointError
from kvstate.terminal import inert

MAX_RENDERED_CHARS = 1 << 20  # a formatted prompt is far shorter; a template that writes more is refused
FIELD = "chat_template"


class _TemplateRaised(Exception):
    """`raise_exception(message)` called by a template (its way of refusing a conversation)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    bos_token: str,
    eos_token: str,
    source: Path,
    add_generation_prompt: bool = True,
) -> str:
    """`messages` ({"role", "content"} each) formatted by `template`, ending with the assistant's turn opened."""
    import jinja2

    from executor.chat_sandbox import BoundedSandbox, TemplateRefused, budget

    environment = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    try:
        with budget():
            return _rendered(
                environment.from_string(template), messages, bos_token, eos_token, source, add_generation_prompt
            )
    except CheckpointError:
        raise
    except (TemplateRefused, MemoryError, RecursionError) as err:
        why = {MemoryError: "it ran out of memory", RecursionError: "it nests or recurses too deeply"}.get(type(err))
        raise CheckpointError(
            f"cannot be rendered: {why or err}; the template is broken or hostile", path=source, field=FIELD
        ) from None
    except (jinja2.TemplateError, _TemplateRaised, TypeError, ValueError, ArithmeticError) as err:
        raise CheckpointError(
            f"cannot be rendered ({type(err).__name__}: {inert(str(err)[:200])}); the template is broken or hostile",
            path=source,
            field=FIELD,
        ) from None


def _rendered(
    compiled: Any,
    messages: Sequence[Mapping[str, str]],
    bos_token: str,
    eos_token: str,
    source: Path,
    add_generation_prompt: bool,
) -> str:
    """The text `compiled` writes, refused past `MAX_RENDERED_CHARS`."""
    pieces, size = [], 0
    stream = compiled.generate(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    for piece in stream:
        size += len(piece)
        if size > MAX_RENDERED_CHARS:
            raise CheckpointError(
                f"writes more than {MAX_RENDERED_CHARS} characters for one message; the template is broken",
                path=source,
                field=FIELD,
            )
        pieces.append(piece)
    return "".join(pieces)
