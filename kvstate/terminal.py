"""Printing for people: text from outside stays inert text, and lines wrap only where a width is known.

What kvstate prints often holds text it did not write: names and meanings from a spec, ids from a trace, paths
and values from the command line, a model's vocabulary. Every command prints through this module, which keeps
two promises:

* **Inert.** Nothing printed is read as Rich markup, emoji codes or highlighting: `console()` turns all three off,
  so ``[/]``, ``[link=...]`` or ``:warning:`` in a name print as typed, and styles come only from code
  (`styled(("PASS", "bold green"), " - ", untrusted)`). Control characters never reach the terminal: `inert`
  writes C0 and C1 controls, DEL, bidirectional overrides and isolates, line separators and lone surrogates as
  visible escapes (``\\x1b``, ``\\u202e``), so a file cannot clear the screen, retitle the window, write the
  clipboard (OSC 52) or forge a line of output. A newline is escaped too, unless the caller keeps it (`keep`,
  for multi-line messages and generated text, whose values are echoed with `kvstate.untrusted.shown`).
* **Wrapping.** On a terminal, or where ``COLUMNS`` declares a width, `say` wraps a message at spaces and never
  inside a word or a path (a longer word stays whole); piped output is not wrapped at all (`console()` is then
  `UNWRAPPED_WIDTH` wide), so a table row or a line stays one line.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported when a console is made: importing a command stays fast
    from rich.console import Console
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

UNWRAPPED_WIDTH = 1 << 16  # the width of a console writing to a pipe or a file: nothing wraps

# Characters that a terminal may act on rather than show, or that reorder or split what it shows.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_WORD = re.compile(r"\S+")

Part = str | tuple[str, str]  # plain text, or (text, style) where the style is the caller's own literal


def inert(text: object, *, keep: str = "") -> str:
    """`text` (as `str`) with every unsafe character written as a visible escape (``\\x1b``), except those in
    `keep` (for example ``"\\n"``)."""
    return _UNSAFE.sub(lambda m: m[0] if m[0] in keep else _escaped(m[0]), str(text))


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def console(*, stderr: bool = False) -> Console:
    """A rich console that reads no markup, emoji codes or highlighting; on a pipe (and no ``COLUMNS``) it is
    `UNWRAPPED_WIDTH` wide, so nothing wraps. It writes to the `sys.stdout` (or `sys.stderr`) of print time."""
    from rich.console import Console

    out = Console(stderr=stderr, markup=False, emoji=False, highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = UNWRAPPED_WIDTH
    return out


def styled(*parts: Part) -> Text:
    """One line of output: each plain part inert, each (text, style) part inert and styled. Never markup."""
    from rich.text import Text

    return Text.assemble(*((inert(p), "") if isinstance(p, str) else (inert(p[0]), p[1]) for p in parts))


def cell(text: object) -> Text:
    """A table cell (or title) of plain, inert text."""
    from rich.text import Text

    return Text(inert(text))


def say(out: Console, *parts: Part) -> None:
    """Print one message built as `styled(*parts)`: where the console has a width (a terminal, ``COLUMNS``) it
    wraps at spaces, never inside a word or a path; on a pipe it stays one line."""
    line = styled(*parts)
    pieces = [line] if out.width >= UNWRAPPED_WIDTH else line.divide(_breaks(line.plain, out.width))
    for piece in pieces:
        piece.rstrip()
        out.print(piece, overflow="ignore", crop=False, no_wrap=True)


def _breaks(text: str, width: int) -> list[int]:
    """The offsets at which `text` breaks into lines of at most `width` cells, only before a word (after spaces);
    a word longer than `width` keeps a line of its own."""
    from rich.cells import cell_len

    breaks: list[int] = []
    start = 0
    for word in _WORD.finditer(text):
        if word.start() > start and cell_len(text[start : word.end()]) > width:
            breaks.append(word.start())
            start = word.start()
    return breaks


def description_column() -> ProgressColumn:
    """A progress column showing each task's description as inert plain text (descriptions hold names, paths)."""
    from rich.progress import ProgressColumn

    class Description(ProgressColumn):
        def render(self, task: Task) -> Text:
            return cell(task.description)

    return Description()
