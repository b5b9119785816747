"""Terminal output fits 80 columns without cutting a name: `kvstate spec` and the `kvstate bench` table."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from executor.bench.results import Row, Section
from executor.bench.table import render_table
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
    lines = capsys.readouterr().out.splitlines()
    # a line wider than the terminal is one word that cannot be cut (the spec's path: an installed package's is long)
    assert all(len(line) <= WIDTH or len(line.split()) == 1 for line in lines), [x for x in lines if len(x) > WIDTH]


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
    """The mark follows residencies and flags, not event names; a pause that holds the KV until consensus
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


# ------------------------------------------------------------------------------------- wrap only on a terminal
def test_piped_output_is_not_wrapped_and_a_long_path_stays_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    directory = tmp_path / ("a-directory-name-long-enough-to-push-the-path-past-eighty-columns" * 2)
    directory.mkdir()
    spec = directory / "lifecycle.toml"
    spec.write_bytes(Path(load_spec().source).read_bytes())
    assert main(["spec", "--spec", str(spec)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f"{spec}: valid")  # one line, the path whole


def test_bench_table_rows_are_one_line_each_when_piped(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    rows = [
        Row(
            "lifecycle",
            f"schedule() steady decode, {n:,} running requests on a wide workload",
            0.25,
            "ms",
            "nano-vllm-style peer measured side by side",
            0.25,
            better="lower",
            target="ratio <= 1.5",
            met=True,
            note="a note long enough that an 80-column table would fold it",
        )
        for n in (256, 1024, 4096)
    ]
    monkeypatch.setattr("executor.bench.run_all", lambda **_: [Section("lifecycle", rows, {})])
    assert main(["bench", "--only", "lifecycle"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for row in rows:
        assert sum(row.name in line for line in lines) == 1  # each figure's name whole, on one line
