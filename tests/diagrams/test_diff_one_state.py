"""`kvstate diagram --diff` on a change to one state's edge of a broadcast event (cancel from one state removed):
only that edge is drawn removed, every other edge keeps its arrow, and `--all-edges` draws one arrow per
transition."""

from __future__ import annotations

import tomllib
from pathlib import Path

import tomli_w

from kvstate.cli import main
from kvstate.diagrams.diff import REMOVED, SAME, change_of, diff_diagram, diff_specs, diff_view, render_diff_dot
from kvstate.diagrams.ir import ANY_STATE
from kvstate.spec import load_spec, packaged_spec_path

EVENT = "cancel"


def one_source_removed(tmp_path: Path) -> tuple[Path, str]:
    """A copy of the packaged spec whose `EVENT` no longer leaves the last source of its edge into a terminal
    state (a broadcast event loses one state); (its path, that state)."""
    spec = load_spec()
    assert EVENT in {e.event for e in _broadcast(spec)}
    data = tomllib.loads(packaged_spec_path().read_text(encoding="utf-8"))
    event = next(e for e in data["events"] if e["name"] == EVENT)
    entry = next(t for t in event["transitions"] if spec.state_by_name[t["dest"]].terminal)
    removed = entry["source"].pop()
    path = tmp_path / "one-state.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path, removed


def _broadcast(spec):
    from kvstate.diagrams.ir import build_diagram

    diagram = build_diagram(spec)
    return [e for e in diagram.edges if e.event in diagram.broadcast_events]


def test_only_the_removed_states_edge_is_drawn_removed(tmp_path: Path) -> None:
    old = load_spec()
    path, removed = one_source_removed(tmp_path)
    new = load_spec(path)
    diff = diff_specs(old, new)
    assert [(c.key, c.change) for c in diff.edges] == [((EVENT, removed, old.terminal_states[0]), REMOVED)]
    diagram = diff_diagram(old, new, diff)
    for drawn in diagram.drawn_edges:  # no arrow mixes a change with edges that did not change
        assert len({(diff.change_of(m.key) or change_of(diff, drawn)).change for m in drawn.members}) == 1
    (arrow,) = [d for d in diagram.drawn_edges if diff.edges[0].key in {m.key for m in d.members}]
    assert arrow.source == removed and change_of(diff, arrow).change == REMOVED
    assert [m.event for m in arrow.members] == [EVENT]
    for t in new.transitions:  # every remaining edge keeps an arrow of its own change: unchanged
        (kept,) = [d for d in diagram.drawn_edges if (t.event, t.source, t.dest) in {m.key for m in d.members}]
        assert change_of(diff, kept).change == SAME
    for drawn in diagram.drawn_edges:  # "any state" holds in both specs for every event drawn from it
        if drawn.source == ANY_STATE:
            for member in drawn.members:
                for spec in (old, new):
                    sources = {t.source for t in spec.event_by_name[member.event].transitions if t.dest == drawn.dest}
                    assert {m.source for m in drawn.members if m.event == member.event} == sources
    dot = render_diff_dot(old, new, diff)
    removed_lines = [line for line in dot.splitlines() if "[removed]" in line]
    assert len(removed_lines) == 1 and removed_lines[0].lstrip().startswith(f'"{removed}" -> ')
    kept_labels = [line for line in dot.splitlines() if " -> " in line and "[removed]" not in line]
    assert sum(EVENT in line for line in kept_labels) >= 1  # the remaining edges of the event are drawn


def test_all_edges_works_with_diff(tmp_path: Path, capsys) -> None:
    old = load_spec()
    path, _ = one_source_removed(tmp_path)
    new = load_spec(path)
    every = diff_diagram(old, new, all_edges=True)
    keys = {(t.event, t.source, t.dest) for spec in (old, new) for t in spec.transitions}
    assert len(every.drawn_edges) == len(every.edges) == len(keys)
    assert all(d.source != ANY_STATE for d in every.drawn_edges)
    outs = {}
    for flag in ((), ("--all-edges",)):
        out = tmp_path / ("all" if flag else "bundled")
        assert main(["diagram", "--diff", str(packaged_spec_path()), str(path), "--out", str(out), *flag]) == 0
        outs[flag] = (out / "spec-diff.dot").read_text(encoding="utf-8")
    capsys.readouterr()
    assert ANY_STATE in outs[()] and ANY_STATE not in outs[("--all-edges",)]
    arrows = [line for line in outs[("--all-edges",)].splitlines() if " -> " in line and "initial" not in line]
    assert len(arrows) >= len(every.edges)


def test_unchanged_edges_are_labelled_without_their_effects(tmp_path: Path) -> None:
    """Context, not change: an unchanged arrow says its event and guard; a changed one keeps its effect."""
    old = load_spec()
    path, _ = one_source_removed(tmp_path)
    new = load_spec(path)
    diff = diff_specs(old, new)
    view = diff_view(diff)
    diagram = diff_diagram(old, new, diff)
    labels = view.edge_labels(diagram, diagram.drawn_edges)
    for drawn, parts in zip(diagram.drawn_edges, labels, strict=True):
        if change_of(diff, drawn).change == SAME:
            assert tuple(parts) == drawn.head_parts()
        else:
            assert drawn.effect is None or f"/ {drawn.effect}" in parts
