"""Reading the values TLC prints in its states (error traces), within limits.

TLC writes a state as conjuncts `/\\ var = value`. Values are integers, strings, TRUE/FALSE, model values (bare
names such as `r0`), records `[f |-> v, ...]`, functions `(a :> v @@ b :> w)`, tuples `<<v, ...>>` and sets
`{v, ...}`. `parse_state(text)` returns {variable: value} with records and functions as dicts, tuples as tuples,
sets as frozensets (tuples when their members are records) and model values as `ModelValue`. The text comes from a
TLC process we started on a module we wrote, but it is still read within `MAX_TEXT` characters and `MAX_DEPTH`
levels of nesting, and anything else is a `TlcOutputError` saying where.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from kvstate.errors import KVStateError

MAX_TEXT = 1 << 20
MAX_DEPTH = 16

_TOKEN = re.compile(
    r"""\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<int>-?\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"""
    r"""|(?P<op>\|->|:>|@@|<<|>>|/\\|[\[\](){},=]))"""
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", '"': '"', "\\": "\\"}


class TlcOutputError(KVStateError):
    """TLC printed something this reader does not understand (the message says what and where)."""


class ModelValue(NamedTuple):
    """A TLC model value (a constant such as `r0` that equals only itself)."""

    name: str


def parse_state(text: str) -> dict[str, object]:
    """The variables of one TLC state (`/\\ x = 1 /\\ y = [a |-> 2]`, or a single `x = 1`)."""
    parser = _Parser(text)
    values: dict[str, object] = {}
    while not parser.at_end():
        parser.accept("/\\")
        name = parser.expect("name")
        parser.expect_op("=")
        values[name] = parser.value(0)
    return values


class _Parser:
    def __init__(self, text: str) -> None:
        if len(text) > MAX_TEXT:
            raise TlcOutputError(f"a TLC state of {len(text)} characters is over the limit of {MAX_TEXT}")
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None:
                if text[position:].strip() == "":
                    break
                raise TlcOutputError(
                    f"unexpected text in a TLC state at character {position}: {text[position:][:40]!r}"
                )
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.at = 0

    def at_end(self) -> bool:
        return self.at >= len(self.tokens)

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.at] if self.at < len(self.tokens) else ("end", "")

    def accept(self, op: str) -> bool:
        if self.peek() == ("op", op):
            self.at += 1
            return True
        return False

    def expect_op(self, op: str) -> None:
        if not self.accept(op):
            raise TlcOutputError(f"expected {op!r} in a TLC state, found {self.peek()[1]!r}")

    def expect(self, kind: str) -> str:
        found_kind, text = self.peek()
        if found_kind != kind:
            raise TlcOutputError(f"expected a {kind} in a TLC state, found {text!r}")
        self.at += 1
        return text

    def value(self, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise TlcOutputError(f"a TLC value nested deeper than {MAX_DEPTH} levels")
        kind, text = self.peek()
        self.at += 1
        if kind == "int":
            return int(text)
        if kind == "string":
            return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), text[1:-1])
        if kind == "name":
            return {"TRUE": True, "FALSE": False}.get(text, ModelValue(text))
        compound = {"[": self.record, "(": self.function, "<<": self.sequence, "{": self.set}.get(text)
        if compound is None:
            raise TlcOutputError(f"unexpected {text!r} where a TLC value starts")
        return compound(depth)

    def sequence(self, depth: int) -> tuple[object, ...]:
        return tuple(self.items(">>", depth))

    def set(self, depth: int) -> frozenset[object] | tuple[object, ...]:
        members = self.items("}", depth)
        try:
            return frozenset(members)
        except TypeError:  # records or functions in a set: kept in TLC's order
            return tuple(members)

    def items(self, close: str, depth: int) -> list[object]:
        out: list[object] = []
        if self.accept(close):
            return out
        while True:
            out.append(self.value(depth + 1))
            if self.accept(close):
                return out
            self.expect_op(",")

    def record(self, depth: int) -> dict[object, object]:
        out: dict[object, object] = {}
        if self.accept("]"):
            return out
        while True:
            field = self.expect("name")
            self.expect_op("|->")
            out[field] = self.value(depth + 1)
            if self.accept("]"):
                return out
            self.expect_op(",")

    def function(self, depth: int) -> dict[object, object]:
        out: dict[object, object] = {}
        while True:
            key = self.value(depth + 1)
            self.expect_op(":>")
            out[key] = self.value(depth + 1)
            if self.accept(")"):
                return out
            self.expect_op("@@")
