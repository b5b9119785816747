"""How spec names become TLA+ text: identifiers, strings and comments, each checked or escaped.

A spec or bounds file may come from anyone, and its names end up in a TLA+ module that SANY parses and TLC runs.
Names are therefore never pasted in raw: an identifier must be one (letters, digits, underscores, not a TLA+
reserved word), a name that is written as a TLA+ string must be a plain word too, and free text (descriptions,
docstrings) becomes a `\\*` comment of printable ASCII on one line.
"""

from __future__ import annotations

import re
import textwrap

from kvstate.errors import KVStateError

_WORD = re.compile(r"[A-Za-z0-9_]+\Z")
RESERVED = frozenset(
    {
        "ASSUME",
        "ASSUMPTION",
        "AXIOM",
        "BOOLEAN",
        "CASE",
        "CHOOSE",
        "CONSTANT",
        "CONSTANTS",
        "DOMAIN",
        "ELSE",
        "ENABLED",
        "EXCEPT",
        "EXTENDS",
        "FALSE",
        "IF",
        "IN",
        "INSTANCE",
        "LAMBDA",
        "LET",
        "LOCAL",
        "MODULE",
        "OTHER",
        "RECURSIVE",
        "STRING",
        "SUBSET",
        "THEN",
        "THEOREM",
        "TRUE",
        "UNCHANGED",
        "UNION",
        "VARIABLE",
        "VARIABLES",
        "WITH",
        "ACTION",
        "BY",
        "COROLLARY",
        "DEF",
        "DEFINE",
        "DEFS",
        "HAVE",
        "HIDE",
        "LEMMA",
        "NEW",
        "OBVIOUS",
        "OMITTED",
        "ONLY",
        "PICK",
        "PROOF",
        "PROPOSITION",
        "PROVE",
        "QED",
        "STATE",
        "SUFFICES",
        "TAKE",
        "TEMPORAL",
        "USE",
        "WITNESS",
    }
)


class TlaExportError(KVStateError):
    """The spec or a bound cannot be written as TLA+ (a name that is no TLA+ identifier, a missing TLA+ meaning);
    the message names the entry and what to change."""


def is_word(name: str) -> bool:
    """`name` is a non-empty run of ASCII letters, digits and underscores."""
    return bool(_WORD.match(name))


def identifier(name: str, what: str) -> str:
    """`name` as a TLA+ identifier, or `TlaExportError` naming `what` (for example "spec event 'x'")."""
    if not is_word(name) or name.isdigit() or name in RESERVED or name.startswith(("WF_", "SF_")):
        raise TlaExportError(
            f"{what} cannot be written as a TLA+ identifier ({name!r}); use letters, digits and underscores, "
            "not only digits, and no TLA+ reserved word"
        )
    return name


def camel(name: str, what: str) -> str:
    """A snake_case spec name as a CamelCase TLA+ identifier (`recompute_pause` -> `RecomputePause`)."""
    identifier(name, what)
    return identifier("".join(part[:1].upper() + part[1:] for part in name.split("_") if part), what)


def string(name: str, what: str) -> str:
    """`name` as a TLA+ string literal; only plain words (letters, digits, underscores) or "" are written."""
    if name and not is_word(name):
        raise TlaExportError(
            f"{what} cannot be written into the TLA+ module ({name!r}); use letters, digits and underscores"
        )
    return f'"{name}"'


def comment(text: str, width: int = 116, max_lines: int = 4) -> str:
    """`text` as `\\*` comment lines of at most `width` characters (at most `max_lines`, the last cut with "..."):
    printable ASCII only, no comment delimiters."""
    flat = " ".join(text.split())
    safe = "".join(c if " " <= c <= "~" else "?" for c in flat).replace("(*", "( *").replace("*)", "* )")
    lines = textwrap.wrap(safe, width - 3, break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = [*lines[: max_lines - 1], lines[max_lines - 1][: width - 6] + "..."]
    return "\n".join("\\* " + line for line in lines)
