"""`kvstate spec`: validate a specification and print its states, events and invariants.

The tables fit the terminal's width (piped, they are not wrapped; `COLUMNS` sets a width): each transition takes
two lines (`source` over `→ dest`, `[guard]` over `/ effect`) and cells fold rather than cut, so no name is ever
truncated. Everything from the spec is printed as inert text (`kvstate.terminal`). A transition is marked
`DROPS_KV_MARK` when the spec's data says it drops the request's KV (a destructive edge into a non-terminal state
without KV: the request must be replayed; `kvstate.diagrams.ir.EdgeKind.DROP`), never by its event's name: a
recompute-pause that holds the KV until consensus is not marked.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvstate.commands.args import add_spec_option, input_file
from kvstate.terminal import cell, console, say

DROPS_KV_MARK = "⚠ "

if TYPE_CHECKING:
    from rich.table import Table

    from kvstate.spec import Spec, Transition


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "spec", help="validate the specification and print a summary of it", description=__doc__
    )
    add_spec_option(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    path = input_file(args.spec, "--spec") if args.spec is not None else None

    from kvstate.spec import load_spec

    spec = load_spec(path)
    out = console()
    say(out, (spec.name, "bold"), f" v{spec.version} — {spec.source}: valid")
    for table in tables(spec):
        out.print(table)
    return 0


def tables(spec: Spec) -> list[Table]:
    """The states, transitions and invariants tables of `spec` (rich tables; cells fold, never truncate)."""
    return [
        _table(
            "States",
            ("state", "residency", "terminal", "meaning"),
            [(s.name, s.residency, "yes" if s.terminal else "", s.meaning) for s in spec.states],
        ),
        _table(
            f"Transitions ({DROPS_KV_MARK}drops the KV: the request must be replayed)",
            ("event", "from → to", "[guard] / effect"),
            [_transition_row(spec, t) for t in spec.transitions],
        ),
        _table(
            "Invariants",
            ("id", "scope", "statement"),
            [(inv.id, inv.scope, inv.statement) for inv in spec.invariants],
        ),
    ]


def drops_kv(spec: Spec, t: Transition) -> bool:
    """Whether `t` drops the request's KV, from the spec's data (its residencies, terminal flags, destructive flag)."""
    from kvstate.diagrams.ir import EdgeKind, edge_kind

    return edge_kind(spec, t.source, t.dest, t.destructive) is EdgeKind.DROP


def _transition_row(spec: Spec, t: Transition) -> tuple[str, tuple[str, str], tuple[str, str]]:
    guard = f"[{t.guard}]" if t.guard else "[—]"
    mark = DROPS_KV_MARK if drops_kv(spec, t) else ""
    return mark + t.event, (t.source, f"→ {t.dest}"), (guard, f"/ {t.effect or '—'}")


def _table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str | tuple[str, ...]]]) -> Table:
    """A rich table of inert plain-text cells (never read as markup) that fold rather than truncate; a tuple value
    is a cell of several lines, each inert (a newline is ours, never the spec's: `cell` shows the spec's as `\\n`)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for column in columns:
        table.add_column(cell(column), overflow="fold")
    for row in rows:
        table.add_row(*(Text("\n").join(map(cell, v)) if isinstance(v, tuple) else cell(v) for v in row))
    return table
