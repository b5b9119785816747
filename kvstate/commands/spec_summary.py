"""`kvstate spec`: validate a specification and print its states, events and invariants."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from kvstate.spec import load_spec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("spec", help="validate the specification and print a summary of it")
    parser.add_argument("--spec", metavar="PATH", help="a spec TOML file (default: the packaged spec)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    console = Console()
    console.print(f"[bold]{spec.name}[/] v{spec.version} — {spec.source}: valid")
    states = Table("state", "residency", "terminal", "meaning", title="States")
    for s in spec.states:
        states.add_row(s.name, s.residency, "yes" if s.terminal else "", s.meaning)
    console.print(states)
    edges = Table("from", "event", "guard", "to", "effect", "destructive", title="Transitions")
    for t in spec.transitions:
        edges.add_row(t.source, t.event, t.guard or "—", t.dest, t.effect or "—", "yes" if t.destructive else "")
    console.print(edges)
    invariants = Table("id", "scope", "statement", title="Invariants")
    for inv in spec.invariants:
        invariants.add_row(inv.id, inv.scope, inv.statement)
    console.print(invariants)
    return 0
