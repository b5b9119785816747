"""Terminal output fits 80 columns without cutting a name: `kvstate spec` and the `kvstate bench` table."""

from __future__ import annotations

import io

from rich.console import Console

from kvstate.bench.results import Row, Section
from kvstate.bench.table import render_table
from kvstate.cli import main
from kvstate.commands.spec_summary import tables
from kvstate.spec import load_spec

WIDTH = 80


def rendered(renderables, width: int = WIDTH) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    for renderable in renderables:
        console.print(renderable)
    return console.export_text()


def test_spec_tables_fit_80_columns_and_show_every_name_whole():
    spec = load_spec()
    text = rendered(tables(spec))
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    names = {s.name for s in spec.states} | {inv.id for inv in spec.invariants}
    for t in spec.transitions:
        names |= {t.event, t.source, t.dest} | {n for n in (t.guard, t.effect) if n}
    words = set(text.replace("[", " ").replace("]", " ").split())
    assert names <= words, sorted(names - words)  # none folded or cut


def test_spec_command_fits_a_piped_80_column_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert main(["spec"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= WIDTH


def test_bench_table_fits_80_columns():
    rows = [
        Row(
            "migration",
            "suspend copy of 512 blocks of 64 KiB, merged runs",
            4.2,
            "GB/s",
            "one contiguous copy of the same bytes",
            15.0,
            target="ratio >= 0.7",
            met=False,
            note="per-block copies; merged runs close the gap",
        ),
        Row(
            "overhead",
            "schedule() steady decode, 1,024 running",
            0.25,
            "ms",
            "nano-vllm-style peer",
            0.25,
            better="lower",
            target="ratio <= 1.5",
            met=True,
        ),
    ]
    text = rendered([render_table([Section("x", rows, {})], "kvstate bench: ratios measured side by side")])
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    flat = " ".join(text.split())
    assert "0.28 ↑" in flat and "1.00 ↓" in flat and "not met" in flat and "ratio >= 0.7" in flat


def test_spec_marks_exactly_the_transitions_whose_data_drop_the_kv():
    """Issue 29: the mark follows residencies and flags, not event names; a pause that holds the KV until consensus
    (destructive, into a state that keeps the KV) is not marked, and every KV-dropping edge is."""
    from kvstate.commands.spec_summary import DROPS_KV_MARK, _transition_row, drops_kv

    spec = load_spec()
    for t in spec.transitions:
        dest = spec.state_by_name[t.dest]
        expected = t.destructive and dest.residency == "none" and not dest.terminal
        assert drops_kv(spec, t) == expected
        assert _transition_row(spec, t)[0].startswith(DROPS_KV_MARK) == expected
    holds = [t for t in spec.transitions if t.destructive and spec.state_by_name[t.dest].residency != "none"]
    assert holds and not any(drops_kv(spec, t) for t in holds), "the hold-for-consensus edge keeps its KV"
