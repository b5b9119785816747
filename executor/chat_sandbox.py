"""A Jinja2 sandbox whose templates run within a budget of time and memory: an untrusted chat template cannot
hang the process or exhaust its memory before it is refused.

Invariants kept, for a template rendered by `BoundedSandbox` inside `budget()`:
* no string it builds (by ``*``, ``+``, ``~``, ``%``, ``format``, a padding or replacing method or filter, ``join``)
  is longer than `MAX_TEXT_CHARS`; no list or tuple it builds (``*``, ``+``, ``range``) has more than `MAX_ITEMS`
  items; no integer it computes (``*``, ``**``) has more than `MAX_INT_BITS` bits; no format width or precision
  exceeds `MAX_WIDTH`. Each check is made on the operands, before the result is built;
* it runs at most `MAX_LINES` lines of template code and stops within about `MAX_SECONDS` of wall time (a
  single bounded operation may finish first);
* every refusal is `TemplateRefused`, naming the limit.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import FILTERS
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEXT_CHARS = 1 << 20  # characters of any string a template builds
MAX_ITEMS = 1 << 16  # items of any list, tuple or range a template builds
MAX_INT_BITS = 1 << 14  # bits of any integer a template computes (about 4,900 decimal digits)
MAX_WIDTH = 1 << 12  # a format width or precision, a padding width
MAX_LINES = 1 << 21  # lines of template code one rendering runs
MAX_SECONDS = 2.0  # wall time of one rendering
TEMPLATE_FILE = "<template>"  # the file name Jinja2 gives the code it compiles from a string

__all__ = ["MAX_ITEMS", "MAX_LINES", "MAX_TEXT_CHARS", "BoundedSandbox", "TemplateRefused", "budget"]


class TemplateRefused(Exception):
    """A template asked for more than the sandbox allows; the message names the limit."""


def _refuse(what: str, limit: int | float, unit: str) -> TemplateRefused:
    return TemplateRefused(f"{what} more than {limit} {unit} (the limit for a chat template)")


def _length(value: object) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_text(size: int, what: str) -> None:
    if size > MAX_TEXT_CHARS:
        raise _refuse(f"{what} would build a string of {size} characters,", MAX_TEXT_CHARS, "characters")


def _check_sized(sequence: object, count: int, what: str) -> None:
    """`sequence` repeated or extended to `count` items (characters for a string)."""
    if isinstance(sequence, str):
        _check_text(count, what)
    elif count > MAX_ITEMS:
        raise _refuse(f"{what} would build a sequence of {count} items,", MAX_ITEMS, "items")


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)")


def check_format(text: str, args: Iterable[object]) -> None:
    """Refuse a printf-style or `str.format` string with a width or precision above `MAX_WIDTH`, or one that
    takes a width from its arguments (``*``, a nested ``{}``) when an argument is an integer above it."""
    numbers = [n for match in _PERCENT.finditer(text) for n in match.groups() if n]
    numbers += re.findall(r"\d+", " ".join(_BRACE_SPEC.findall(text)))
    if any(n != "*" and (len(n) > 9 or int(n) > MAX_WIDTH) for n in numbers):
        raise _refuse("a format width or precision is", MAX_WIDTH, "characters")
    takes_width = "*" in numbers or re.search(r"\{[^{}]*:[^{}]*\{", text) is not None
    if takes_width and any(isinstance(a, int) and abs(a) > MAX_WIDTH for a in args):
        raise _refuse("a format width taken from an argument is", MAX_WIDTH, "characters")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``*``, ``**``, ``+`` and ``%`` whose result would break a limit, judged on the operands."""
    if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            raise _refuse(f"a power of {right} would have", MAX_INT_BITS, "bits")
    elif operator == "*":
        if _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _refuse("a product would have", MAX_INT_BITS, "bits")
        elif _is_int(right) and isinstance(left, (str, list, tuple)):
            _check_sized(left, len(left) * right, "a repetition")
        elif _is_int(left) and isinstance(right, (str, list, tuple)):
            _check_sized(right, len(right) * left, "a repetition")
    elif operator == "+" and isinstance(left, (str, list, tuple)):
        _check_sized(left, _length(left) + _length(right), "a concatenation")
    elif operator == "%" and isinstance(left, str):
        check_format(left, right if isinstance(right, tuple) else (right,))


def _check_padding(text: str, width: object, what: str) -> None:
    if _is_int(width) and width > max(MAX_WIDTH, len(text)):  # type: ignore[operator]
        raise _refuse(f"{what} to a width of {width} is", MAX_WIDTH, "characters")


def _replace_size(text: str, old: object, new: object) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    occurrences = text.count(old) if old else len(text) + 1
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _join_size(separator: object, items: object) -> int:
    if not isinstance(items, (list, tuple)):
        return 0
    texts = sum(len(item) if isinstance(item, str) else 0 for item in items)
    return texts + len(str(separator)) * max(len(items) - 1, 0)


def check_call(function: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a call of a string method that would build a string over `MAX_TEXT_CHARS` (padding, replacing,
    joining), judged on its arguments."""
    owner, name = getattr(function, "__self__", None), getattr(function, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_padding(owner, args[0], f"str.{name}")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if _is_int(size) and size > MAX_WIDTH:
            raise _refuse("a tab size is", MAX_WIDTH, "characters")
    elif name == "replace" and len(args) >= 2:
        _check_text(_replace_size(owner, args[0], args[1]), "str.replace")
    elif name == "join" and args:
        _check_text(_join_size(owner, args[0]), "str.join")


def _bounded_filters() -> dict[str, Callable[..., Any]]:
    """Jinja2's filters that can amplify their input, each checked before it runs."""

    def center(value: object, width: int = 80) -> str:
        _check_padding(str(value), width, "center")
        return FILTERS["center"](value, width)

    def indent(value: str, width: int | str = 4, *args: Any, **kwargs: Any) -> str:
        lines = str(value).count("\n") + 1
        _check_text(len(str(value)) + lines * (len(width) if isinstance(width, str) else int(width)), "indent")
        return FILTERS["indent"](value, width, *args, **kwargs)

    def format_(value: str, *args: Any, **kwargs: Any) -> str:
        check_format(str(value), [*args, *kwargs.values()])
        return FILTERS["format"](value, *args, **kwargs)

    def replace(eval_ctx: Any, value: str, old: str, new: str, count: int | None = None) -> str:
        _check_text(_replace_size(str(value), old, new), "replace")
        return FILTERS["replace"](eval_ctx, value, old, new, count)

    def join(eval_ctx: Any, value: Iterable[Any], d: str = "", attribute: Any = None) -> str:
        items = list(value)
        _check_sized(items, len(items), "join")
        _check_text(_join_size(d, [str(i) for i in items] if attribute is None else []), "join")
        text = FILTERS["join"](eval_ctx, items, d, attribute)
        _check_text(len(text), "join")
        return text

    replace.jinja_pass_arg = FILTERS["replace"].jinja_pass_arg  # type: ignore[attr-defined]
    join.jinja_pass_arg = FILTERS["join"].jinja_pass_arg  # type: ignore[attr-defined]
    return {"center": center, "indent": indent, "format": format_, "replace": replace, "join": join}


def bounded_range(*args: int) -> range:
    """`range`, refused past `MAX_ITEMS` items."""
    numbers = range(*args)
    if len(numbers) > MAX_ITEMS:
        raise _refuse(f"range{args} has", MAX_ITEMS, "items")
    return numbers


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja2's code generator with ``~`` (string concatenation) routed through `BoundedSandbox.bounded_concat`."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with every amplifying operation checked against the limits of this module."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["range"] = bounded_range
        self.filters.update(_bounded_filters())

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        check_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` and `str.format_map`, sandboxed as Jinja2 does, and refused by `check_format` first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            mappings = (v for a in args if isinstance(a, dict) for v in a.values())
            check_format(text, [*args, *kwargs.values(), *mappings])
            return wrapped(*args, **kwargs)

        return checked

    @staticmethod
    def bounded_concat(parts: tuple[Any, ...]) -> str:
        texts = [str(part) for part in parts]
        _check_text(sum(map(len, texts)), "a concatenation (~)")
        return "".join(texts)


@contextmanager
def budget(seconds: float = MAX_SECONDS, lines: int = MAX_LINES) -> Iterator[None]:
    """Within the block, template code (Jinja2's compiled code, this thread) runs at most `lines` lines and stops
    at the first line after `seconds` of wall time, with `TemplateRefused`."""
    deadline = time.monotonic() + seconds
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count > lines:
                raise _refuse("the template ran", lines, "lines")
            if count % 1024 == 0 and time.monotonic() > deadline:
                raise _refuse("the template ran", seconds, "seconds")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)
