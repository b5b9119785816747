"""How much room a text takes when Graphviz draws it in Helvetica, computed without Graphviz or a font file.

The diagrams are laid out in Python (`kvstate.diagrams.layout`) so that the committed DOT source, positions
included, is byte-stable on every machine; the sizes it lays out with must therefore not depend on the fonts a
machine has. `text_width` uses Helvetica's advance widths (the standard metrics of the PostScript core font, which
Arial and Liberation Sans share) and counts any character outside them as a full em, so it never underestimates
a text Graphviz draws in Helvetica or a metric-compatible font.

Invariants kept: every function is pure; `text_width` is additive over characters; boxes laid out with
`FALLBACK_FONT_SLACK` hold the text in a wider fallback font too.
"""

from __future__ import annotations

from collections.abc import Sequence

# Helvetica advance widths in 1/1000 em, grouped by width (regular and bold), ASCII 32-126 and the few typographic
# characters the diagrams print.
_REGULAR_GROUPS = {
    222: "'`ijl",
    260: "|",
    278: " !,./:;I[\\]ft",
    333: "()-r",
    334: "{}",
    355: '"',
    389: "*",
    469: "^",
    500: "Jcksvxyz",
    556: "#$0123456789?L_abdeghnopqu–",
    584: "+<=>~×−",
    611: "FTZ",
    667: "&ABEKPSVXY",
    722: "CDHNRUw",
    778: "GOQ",
    833: "Mm",
    889: "%",
    944: "W",
    1000: "—→←…",
    1015: "@",
}
_BOLD_GROUPS = {
    278: " ',./I\\`ijl",
    280: "|",
    333: "!()-:;[]ft",
    389: "*r{}",
    474: '"',
    500: "z",
    556: "#$0123456789J_aceksvxy–",
    584: "+<=>^~×−",
    611: "?FLTZbdghnopqu",
    667: "EPSVXY",
    722: "&ABCDHKNRU",
    778: "GOQw",
    833: "M",
    889: "%m",
    944: "W",
    975: "@",
    1000: "—→←…",
}
REGULAR = {char: width for width, chars in _REGULAR_GROUPS.items() for char in chars}
BOLD = {char: width for width, chars in _BOLD_GROUPS.items() for char in chars}
UNKNOWN_WIDTH = 1000  # a character outside the table: a full em, never less than it takes
LINE_SPACING = 1.2  # Graphviz's line height per point of font size
FALLBACK_FONT_SLACK = 1.2  # room for a wider fallback font (DejaVu Sans, up to 18 % wider) where Helvetica is missing


def text_width(text: str, size: float, *, bold: bool = False) -> float:
    """Points `text` takes on one line at `size` points."""
    table = BOLD if bold else REGULAR
    return sum(table.get(char, UNKNOWN_WIDTH) for char in text) * size / 1000


def text_size(lines: Sequence[str], size: float, *, bold: bool = False, slack: float = 1.0) -> tuple[float, float]:
    """(width, height) in points of `lines` drawn one under the other at `size` points, widths times `slack`."""
    width = max((text_width(line, size, bold=bold) for line in lines), default=0.0)
    return width * slack, len(lines) * size * LINE_SPACING
