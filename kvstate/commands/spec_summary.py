"""`kvstate spec`: validate a specification and print its states, events and invariants.

The tables fit the terminal's width (80 columns when output is piped): each transition takes two lines
(`source` over `→ dest`, `[guard]` over `/ effect`) and cells fold rather than cut, so no name is ever truncated.
"""

from __future__ import annotations

import argparse

from kvstate.commands.args import input_file


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("spec", help="validate the specification and print a summary of it",
                                   description=__doc__)
    parser.add_argument("--spec", metavar="PATH", help="a spec TOML file (default: the packaged spec)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    path = input_file(args.spec, "--spec") if args.spec is not None else None

    from rich.console import Console

    from kvstate.spec import load_spec

    spec = load_spec(path)
    console = Console()
    console.print(f"[bold]{spec.name}[/] v{spec.version} — {spec.source}: valid")
    for table in tables(spec):
        console.print(table)
    return 0


def tables(spec) -> list:
    """The states, transitions and invariants tables of `spec` (rich tables; cells fold, never truncate)."""
    from rich.table import Table
    from rich.text import Text

    class table(Table):  # noqa: N801 (a Table whose cells are plain text: "[guard]" is not markup)
        def __init__(self, title: str, *columns: str) -> None:
            super().__init__(title=title)
            for column in columns:
                self.add_column(Text(column), overflow="fold")

        def add_row(self, *cells: str) -> None:
            super().add_row(*(Text(cell) for cell in cells))

    states = table("States", "state", "residency", "terminal", "meaning")
    for s in spec.states:
        states.add_row(s.name, s.residency, "yes" if s.terminal else "", s.meaning)
    edges = table("Transitions (⚠ destructive: drops the KV)", "event", "from → to", "[guard] / effect")
    for t in spec.transitions:
        guard = f"[{t.guard}]" if t.guard else "[—]"
        edges.add_row(("⚠ " if t.destructive else "") + t.event, f"{t.source}\n→ {t.dest}",
                      f"{guard}\n/ {t.effect or '—'}")
    invariants = table("Invariants", "id", "scope", "statement")
    for inv in spec.invariants:
        invariants.add_row(inv.id, inv.scope, inv.statement)
    return [states, edges, invariants]
