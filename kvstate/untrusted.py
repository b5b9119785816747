"""Bounded, typed reading of untrusted files: specifications, traces, checkpoint configs and shard indexes.

A file someone hands to kvstate (a spec sent for review, a trace from another machine, a downloaded checkpoint)
may be hostile or broken. Everything here reads it within stated `Limits` and turns every failure into an
`UntrustedFileError` (a `KVStateError` and a `ValueError`) whose message names the file, the line and the field
where there is one, and says what to do.

Invariants kept:
* no read holds more than ``Limits.max_bytes + 1`` bytes of a file, nor ``Limits.max_line_bytes + 1`` of a line
  (so ``/dev/zero`` or a 300 MB line is refused after reading the limit, not after exhausting memory);
* a value returned by `parse_json` / `read_json` / `read_toml` nests at most ``Limits.max_depth`` containers deep,
  holds no integer of more than ``Limits.max_int_digits`` digits, no NaN or infinity, and (JSON) no object with a
  repeated key; parsers' own failures (syntax, `RecursionError`, Python's integer-string limit) become
  `UntrustedFileError` too;
* TOML text reaches the parser only within bounds checked on the text itself (`toml_text_problem`): no dotted key
  of more than ``Limits.max_depth`` parts and at most ``Limits.max_keys`` keys and table headers, so that the
  parser's cost (quadratic in a dotted key's length, superlinear in the number of tables) stays small;
* messages echo at most `SHOWN_CHARS` characters of any value read from the file (`shown`), escaped as `repr`
  escapes them.
"""

from __future__ import annotations

import json
import math
import re
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeAlias

from kvstate.errors import KVStateError

SHOWN_CHARS = 80


@dataclass(frozen=True, slots=True)
class Limits:
    """What one untrusted file may contain. Every bound is inclusive and must be positive."""

    max_bytes: int
    max_line_bytes: int = 1 << 16
    max_depth: int = 32
    max_int_digits: int = 19  # a signed 64-bit integer has at most 19 digits
    max_keys: int = 10_000  # TOML: keys and table headers (each `=` and `[` header counts, strings included)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_line_bytes", "max_depth", "max_int_digits", "max_keys"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


class UntrustedFileError(KVStateError, ValueError):
    """An untrusted file cannot be used: unreadable, over a limit, malformed, or a field of the wrong type.

    `path`, `line` (1-based) and `field` locate the problem where known; the message starts with them.
    """

    def __init__(
        self, message: str, *, path: str | Path | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field
        self.detail = message  # the message without the location
        where = self.path or ""
        if line is not None:
            where += f":{line}" if where else f"line {line}"
        if field is not None:
            where += f"{': ' if where else ''}field {field!r}"
        super().__init__(f"{where}: {message}" if where else message)


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` cut to about `limit` characters, for echoing untrusted values in messages."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = (
        repr(value)
        if not isinstance(value, (list, dict, tuple)) or _small(value)
        else f"<a {type(value).__name__} of {len(value)} items>"
    )
    return text if len(text) <= limit else text[:limit] + "..."


def bare(value: object) -> str:
    """A name as messages write it: bare when it is a short identifier (``running``), else `shown` (quoted,
    escaped, cut short)."""
    return value if isinstance(value, str) and value.isidentifier() and len(value) <= 40 else shown(value)


def _small(value: list | dict | tuple) -> bool:
    return len(value) <= 8 and all(
        not isinstance(v, (list, dict, tuple)) for v in (value.values() if isinstance(value, dict) else value)
    )


# ------------------------------------------------------------------------------------------------ bytes
def open_binary(path: str | Path, what: str, error: type[UntrustedFileError] = UntrustedFileError) -> IO[bytes]:
    """`path` opened for reading bytes; a missing file, a directory or no permission is `error`."""
    try:
        return Path(path).open("rb")
    except OSError as err:
        why = "it does not exist" if isinstance(err, FileNotFoundError) else (err.strerror or str(err))
        raise error(f"cannot read {what}: {why}; pass the path of an existing {what}", path=path) from None


def read_bytes(
    path: str | Path, limits: Limits, what: str, error: type[UntrustedFileError] = UntrustedFileError
) -> bytes:
    """The bytes of `path`, refused when larger than ``limits.max_bytes`` (read no further than one byte more)."""
    with open_binary(path, what, error) as handle:
        try:
            data = handle.read(limits.max_bytes + 1)
        except OSError as err:
            raise error(f"cannot read {what}: {err.strerror or err}", path=path) from None
    if len(data) > limits.max_bytes:
        raise error(
            f"the {what} is larger than {limits.max_bytes} bytes, far more than a {what} needs; check the "
            "path (a device or a stream such as /dev/zero is not a file to read)",
            path=path,
        )
    return data


def decode(
    data: bytes,
    what: str,
    *,
    path: str | Path | None,
    line: int | None = None,
    error: type[UntrustedFileError] = UntrustedFileError,
) -> str:
    """`data` as UTF-8 text, or `error` naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(
            f"not UTF-8 ({err.reason} at byte {err.start}); a {what} is UTF-8 text, check what wrote it",
            path=path,
            line=line,
        ) from None


def iter_lines(
    handle: IO[bytes],
    limits: Limits,
    what: str,
    *,
    path: str | Path | None,
    error: type[UntrustedFileError] = UntrustedFileError,
) -> Iterator[tuple[int, bytes]]:
    """(line number, line bytes) of an open binary file, blank lines included, within `limits`.

    Raises `error` naming the line that is longer than ``limits.max_line_bytes`` or that takes the file past
    ``limits.max_bytes``; reads at most one byte past either limit.
    """
    total, number = 0, 0
    while True:
        number += 1
        try:
            raw = handle.readline(limits.max_line_bytes + 1)
        except OSError as err:
            raise error(f"cannot read {what}: {err.strerror or err}", path=path, line=number) from None
        if not raw:
            return
        if len(raw) > limits.max_line_bytes and not (len(raw) == limits.max_line_bytes + 1 and raw.endswith(b"\n")):
            raise error(
                f"the line is longer than {limits.max_line_bytes} bytes; a {what} line is far shorter — "
                "is this the right file (not a binary or a stream such as /dev/zero)?",
                path=path,
                line=number,
            )
        total += len(raw)
        if total > limits.max_bytes:
            raise error(
                f"the {what} is larger than {limits.max_bytes} bytes at this line; split it, or pass larger "
                "limits if it is genuine",
                path=path,
                line=number,
            )
        yield number, raw


# ------------------------------------------------------------------------------------------------ parsing
def parse_json(
    text: str | bytes,
    limits: Limits,
    what: str,
    *,
    path: str | Path | None,
    line: int | None = None,
    error: type[UntrustedFileError] = UntrustedFileError,
) -> Any:
    """One JSON document (`text` already within the size limits), checked as the module docstring says."""
    if isinstance(text, bytes):
        text = decode(text, what, path=path, line=line, error=error)
    try:
        value = _DECODER.decode(text)
    except RecursionError:
        raise error(
            f"nested too deeply to parse (a {what} nests at most {limits.max_depth} levels)", path=path, line=line
        ) from None
    except _Refused as err:
        raise error(f"{err.args[0]}; a {what} is plain JSON", path=path, line=line) from None
    except json.JSONDecodeError as err:
        # json's message may end in "starting at" (an unterminated string): the column then follows it directly
        where = f"{err.msg} column {err.colno}" if err.msg.endswith(" at") else f"{err.msg} at column {err.colno}"
        raise error(
            f"not a JSON object ({where}); was the file truncated, or written by something other than a {what} writer?",
            path=path,
            line=line or err.lineno,
        ) from err
    except ValueError:  # Python's limit on the digits of an integer string
        raise error(_too_many_digits(limits), path=path, line=line) from None
    check_value(value, limits, what, path=path, line=line, error=error)
    return value


def read_json(path: str | Path, limits: Limits, what: str, error: type[UntrustedFileError] = UntrustedFileError) -> Any:
    """The JSON document in `path`, read and checked within `limits`."""
    return parse_json(read_bytes(path, limits, what, error), limits, what, path=path, error=error)


def read_toml(
    path: str | Path, limits: Limits, what: str, error: type[UntrustedFileError] = UntrustedFileError
) -> dict:
    """The TOML document in `path`, read and checked within `limits` (its text before it is parsed)."""
    text = decode(read_bytes(path, limits, what, error), what, path=path, error=error)
    problem = toml_text_problem(text, limits, what)
    if problem is not None:
        raise error(problem[1], path=path, line=problem[0])
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise error(
            f"nested too deeply to parse (a {what} nests at most {limits.max_depth} levels)", path=path
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise error(f"is not valid TOML: {err}", path=path) from err
    except ValueError:  # Python's limit on the digits of an integer string
        raise error(_too_many_digits(limits), path=path) from None
    check_value(value, limits, what, path=path, error=error)
    return value


# One part of a dotted key (bare or quoted) and the dot between two parts, with possessive quantifiers (no
# backtracking). They are matched on the raw text of a line, strings and comments included, so that no quoting can
# hide a key from the check; text that merely reads as a long dotted key is refused too, which no spec needs.
_KEY_PART = r"""(?:[A-Za-z0-9_-]++|"[^"\\\n]*+"|'[^'\n]*+')"""
_KEY_DOT = r"[ \t]*+\.[ \t]*+"
_HEADER = re.compile(r"^[ \t]*\[", re.M)


def toml_text_problem(text: str, limits: Limits, what: str) -> tuple[int | None, str] | None:
    """(line, message) of the first bound the TOML `text` breaks before it is parsed, or None: a dotted key of more
    than ``limits.max_depth`` parts, or more than ``limits.max_keys`` keys and table headers. Linear in the text
    (only a line with that many dots is searched, by a regular expression that never backtracks)."""
    too_long = re.compile(rf"(?<![A-Za-z0-9_-]){_KEY_PART}(?:{_KEY_DOT}{_KEY_PART}){{{limits.max_depth}}}")
    for number, line in enumerate(text.split("\n"), 1):
        if line.count(".") >= limits.max_depth and too_long.search(line):
            message = (
                f"a dotted key (or text that reads as one) of more than {limits.max_depth} parts, nested deeper "
                f"than {limits.max_depth} levels; a {what} is shallow (refused before parsing)"
            )
            return number, message
    keys = text.count("=") + len(_HEADER.findall(text))
    if keys > limits.max_keys:
        message = (
            f"holds {keys} keys and table headers ('=' signs and '[' headers), more than the {limits.max_keys} a "
            f"{what} may hold; is this the right file?"
        )
        return None, message
    return None


def _too_many_digits(limits: Limits) -> str:
    return (
        f"a number has more than {sys.get_int_max_str_digits()} digits, too many to read; integers have at most "
        f"{limits.max_int_digits} digits"
    )


class _Refused(ValueError):
    pass


def _no_constant(name: str) -> None:
    raise _Refused(f"{name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"key {shown(key)} appears twice in one object")
            seen.add(key)
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=_unique_keys)  # built once: it is reused


def check_value(
    value: Any,
    limits: Limits,
    what: str,
    *,
    path: str | Path | None,
    line: int | None = None,
    error: type[UntrustedFileError] = UntrustedFileError,
) -> None:
    """Refuse nesting deeper than ``limits.max_depth``, over-long integers and non-finite floats (iteratively).

    Fast on the common case, a flat object of strings and small numbers: only containers and bad numbers are
    pushed on the stack, and a field's name is spelled out only when it is refused.
    """
    largest = 10**limits.max_int_digits
    stack: list[_Entry] = [(value, 0, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        kind = type(item)
        if kind is dict or kind is list:
            if depth >= limits.max_depth:
                raise error(
                    f"nested deeper than {limits.max_depth} levels; a {what} is shallow",
                    path=path,
                    line=line,
                    field=_field_path(entry),
                )
            for key, child in item.items() if kind is dict else enumerate(item):
                child_kind = type(child)
                if (
                    child_kind is str
                    or child_kind is bool
                    or child is None
                    or (child_kind is int and -largest < child < largest)
                    or (child_kind is float and math.isfinite(child))
                ):
                    continue
                stack.append((child, depth + 1, key, entry))
        elif kind is int and not -largest < item < largest:
            raise error(
                f"{shown(item)} has more than {limits.max_int_digits} digits; no {what} field needs that",
                path=path,
                line=line,
                field=_field_path(entry),
            )
        elif kind is float and not math.isfinite(item):
            raise error(f"{item} is not a finite number", path=path, line=line, field=_field_path(entry))


# A stack entry of `check_value`: (item, depth, key in its parent, the parent's entry); the root's parent is None.
_Entry: TypeAlias = tuple[Any, int, str | int | None, "_Entry | None"]


def _field_path(entry: _Entry) -> str | None:
    """``a.b[2].c`` for a stack entry of `check_value`, cut to `SHOWN_CHARS`; None for the whole document."""
    parts = []
    key, parent = entry[2], entry[3]
    while parent is not None:
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        key, parent = parent[2], parent[3]
    text = "".join(reversed(parts)).removeprefix(".")
    return (text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...") or None


# ------------------------------------------------------------------------------------------- typed fields
_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class Fields:
    """Typed access to the fields of one parsed object of an untrusted file; every refusal names the field.

    `where` prefixes field names in messages (for example ``"weight_map"``); `path` and `line` locate the object.
    """

    data: Mapping[str, Any]
    path: str | None = None
    line: int | None = None
    where: str = ""
    error: type[UntrustedFileError] = UntrustedFileError

    @classmethod
    def of(
        cls,
        value: Any,
        what: str,
        *,
        path: str | Path | None = None,
        line: int | None = None,
        where: str = "",
        error: type[UntrustedFileError] = UntrustedFileError,
    ) -> Fields:
        """`Fields` over `value`, refused unless it is a mapping (a JSON object or a TOML table)."""
        if not isinstance(value, Mapping):
            raise error(
                f"{what} must be an object (a mapping of names to values), got {shown(value)}",
                path=path,
                line=line,
                field=where or None,
            )
        return cls(value, None if path is None else str(path), line, where, error)

    def fail(self, key: str, message: str) -> UntrustedFileError:
        name = f"{self.where}.{key}" if self.where else key
        return self.error(message, path=self.path, line=self.line, field=name)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise self.fail(key, "is missing; add it")
        return default

    def integer(
        self, key: str, *, minimum: int | None = None, maximum: int | None = None, default: Any = _MISSING
    ) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(key, f"must be an integer, got {shown(value)}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise self.fail(key, f"is {shown(value)}; it must be {bounds}")
        return value

    def number(self, key: str, *, positive: bool = False, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(key, f"must be a number, got {shown(value)}")
        if not math.isfinite(value) or (positive and value <= 0):
            raise self.fail(key, f"is {shown(value)}; it must be a finite number{' > 0' if positive else ''}")
        return float(value)

    def boolean(self, key: str, *, default: Any = _MISSING) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {shown(value)}")
        return value

    def string(self, key: str, *, default: Any = _MISSING) -> str:
        value = self.get(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {shown(value)}")
        return value

    def mapping(self, key: str, *, default: Any = _MISSING) -> Fields:
        value = self.get(key, default)
        name = f"{self.where}.{key}" if self.where else key
        return Fields.of(value, f"field {name!r}", path=self.path, line=self.line, where=name, error=self.error)
