"""The one escaping layer for every output format the diagrams and the report write.

A spec is a file someone sends you for review, so every text taken from it (its name, state and event names,
labels, guards, effects, meanings) is untrusted. Each renderer writes such text only through the function
of its format below; none of them builds an escape of its own.

Invariants kept:
* `one_line` removes every character that can end a line in any of the formats (ASCII controls, the Unicode
  line and paragraph separators, NEL): what a comment or a line-oriented format receives stays on its line;
* `dot_string` is a complete DOT double-quoted string: `\\`, `"` and line ends cannot close it or start a
  Graphviz escape (`\\N`, `\\G`, `\\l` ...), so a text can never add a DOT statement or attribute;
* `dot_comment` is a single line;
* `mermaid_id` is an identifier Mermaid cannot read as a keyword, unique per name; `mermaid_text` holds no
  quote, colon, semicolon, angle bracket, brace, bar, `#`, `%`, `&` or backtick (look-alikes instead);
* `md_text` has no raw HTML, link, emphasis or table-cell break; `md_code` is one code span whose content is
  shown literally;
* `html_text` is `html.escape` with quotes, safe in element content and quoted attributes;
* `safe_svg` keeps only an allow-list of SVG elements and attributes: no link, script, event handler,
  foreign object or external reference survives, and no `id` (two drawings inlined in one page cannot clash);
* `mpl_text` is shown literally by matplotlib (no mathtext).
"""

from __future__ import annotations

import html
import re
from xml.etree import ElementTree

LINE_BREAKING = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` with every line-ending or control character replaced by a space."""
    return LINE_BREAKING.sub(" ", text)


# ---------------------------------------------------------------------------------------------------- DOT


def dot_string(text: str) -> str:
    """`text` as a DOT double-quoted string; each newline in `text` becomes a centred DOT line break."""
    body = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + one_line(body) + '"'


def dot_comment(text: str) -> str:
    """A `//` comment line holding `text`."""
    return "// " + one_line(text)


def dot_html(text: str) -> str:
    """`text` inside a Graphviz HTML-like label."""
    return html.escape(one_line(text), quote=True)


# ------------------------------------------------------------------------------------------------ Mermaid

MERMAID_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
MERMAID_KEYWORDS = frozenset(
    {
        "state",
        "note",
        "click",
        "class",
        "classdef",
        "style",
        "direction",
        "end",
        "as",
        "linkstyle",
        "callback",
        "call",
        "href",
        "default",
        "left",
        "right",
        "of",
    }
)
# Mermaid's entity codes (`#59;`) themselves hold `#` and `;`, and not every diagram type decodes them, so each
# character Mermaid's grammar gives a meaning is replaced by the Unicode look-alike a reader sees the same way.
MERMAID_LOOKALIKES = {
    '"': "\u201d",
    "#": "\uff03",
    ":": "\u2236",
    ";": "\uff1b",
    "<": "\u2039",
    ">": "\u203a",
    "%": "\uff05",
    "&": "\uff06",
    "`": "\u02cb",
    "{": "\uff5b",
    "}": "\uff5d",
    "|": "\uff5c",
}
MERMAID_SPECIAL = re.compile("[" + re.escape("".join(MERMAID_LOOKALIKES)) + "]")


def mermaid_id(name: str) -> str:
    """The Mermaid id of the state `name`: the name itself when it is a plain identifier that is no Mermaid
    keyword; otherwise `s_` and the name's UTF-8 bytes in hex (unique, and never a keyword)."""
    if MERMAID_ID.fullmatch(name) and name.lower() not in MERMAID_KEYWORDS and not name.startswith("s_"):
        return name
    return "s_" + name.encode("utf-8").hex()


def mermaid_text(text: str) -> str:
    """`text` inside a quoted state description or after ` : ` of a transition: one line, and every character
    with a meaning to Mermaid replaced by its look-alike (`MERMAID_LOOKALIKES`)."""
    return MERMAID_SPECIAL.sub(lambda m: MERMAID_LOOKALIKES[m.group()], one_line(text))


# ----------------------------------------------------------------------------------------------- Markdown

MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~!])")


def md_text(text: str) -> str:
    """`text` as literal markdown inline text (also inside a table cell): punctuation that starts HTML, a link,
    an image, emphasis or code, and `|`, is backslash-escaped; `&` is an entity."""
    return MD_SPECIAL.sub(r"\\\1", one_line(text).replace("&", "&amp;"))


def md_code(text: str) -> str:
    """`text` as one code span (shown literally), safe inside a table cell."""
    body = one_line(text).replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if body.startswith("`") or body.endswith("`") or longest else ""
    return f"{fence}{pad}{body}{pad}{fence}"


# ---------------------------------------------------------------------------------------------------- HTML


def html_text(text: str) -> str:
    """`text` in HTML element content or a double-quoted attribute."""
    return html.escape(text, quote=True)


SVG_NS = "http://www.w3.org/2000/svg"
SVG_ELEMENTS = frozenset(
    {
        "svg",
        "g",
        "title",
        "desc",
        "polygon",
        "polyline",
        "path",
        "ellipse",
        "circle",
        "rect",
        "line",
        "text",
        "tspan",
        "defs",
        "linearGradient",
        "radialGradient",
        "stop",
    }
)
SVG_UNWRAP = frozenset({"a", "switch"})  # links and switches: their drawing is kept, the wrapper is dropped
SVG_ATTRIBUTES = frozenset(
    {
        "class",
        "width",
        "height",
        "viewBox",
        "preserveAspectRatio",
        "transform",
        "points",
        "d",
        "cx",
        "cy",
        "r",
        "rx",
        "ry",
        "x",
        "y",
        "x1",
        "y1",
        "x2",
        "y2",
        "dx",
        "dy",
        "fill",
        "fill-opacity",
        "stroke",
        "stroke-width",
        "stroke-dasharray",
        "stroke-opacity",
        "stroke-linecap",
        "stroke-linejoin",
        "opacity",
        "font-family",
        "font-size",
        "font-weight",
        "font-style",
        "text-anchor",
        "dominant-baseline",
        "offset",
        "stop-color",
        "stop-opacity",
        "gradientUnits",
        "gradientTransform",
        "version",
    }
)
SVG_UNSAFE_VALUE = re.compile(r"url\s*\(|javascript:|data:|expression\s*\(", re.IGNORECASE)


class UnsafeSvgError(ValueError):
    """The bytes given to `safe_svg` are not a parseable SVG document."""


def safe_svg(svg: bytes | str) -> str:
    """The `<svg>` element of `svg`, re-serialized with only allow-listed elements and attributes.

    Links (`<a>`, `<switch>`) are unwrapped: their children stay, the link goes. Any other element outside
    the allow-list is dropped with its content; attributes outside the allow-list, and values holding
    `url(`, `javascript:` or `data:`, are dropped. The XML prolog and DOCTYPE are not kept. Raises
    `UnsafeSvgError` when `svg` is not a well-formed SVG document or declares XML entities (never expanded).
    """
    text = svg.decode("utf-8") if isinstance(svg, bytes) else svg
    if "<!ENTITY" in text:
        raise UnsafeSvgError("SVG declares XML entities; refusing to expand them")
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as err:
        raise UnsafeSvgError(f"SVG is not well-formed XML: {err}") from err
    if _local(root.tag) != "svg":
        raise UnsafeSvgError(f"expected an <svg> document, got <{_local(root.tag)}>")
    clean = _clean(root)
    clean.set("xmlns", SVG_NS)
    return ElementTree.tostring(clean, encoding="unicode")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _clean(element: ElementTree.Element) -> ElementTree.Element:
    """A copy of the allow-listed part of `element` (which is itself allow-listed), without namespaces."""
    out = ElementTree.Element(_local(element.tag))
    for key, value in element.attrib.items():
        if key in SVG_ATTRIBUTES and not SVG_UNSAFE_VALUE.search(value):
            out.set(key, value)
    out.text = element.text
    out.tail = element.tail
    _append_children(out, element)
    return out


def _append_children(out: ElementTree.Element, element: ElementTree.Element) -> None:
    for child in element:
        tag = _local(child.tag)  # a string: the default parser drops comments and processing instructions
        if tag in SVG_ELEMENTS:
            out.append(_clean(child))
        elif tag in SVG_UNWRAP:
            _append_children(out, child)


# ---------------------------------------------------------------------------------------------- matplotlib


def mpl_text(text: str) -> str:
    """`text` shown literally by matplotlib: `$` would start mathtext."""
    return one_line(text).replace("$", r"\$")


__all__ = [
    "UnsafeSvgError",
    "dot_comment",
    "dot_html",
    "dot_string",
    "html_text",
    "md_code",
    "md_text",
    "mermaid_id",
    "mermaid_text",
    "mpl_text",
    "one_line",
    "safe_svg",
]
