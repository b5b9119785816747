"""The review picture of a spec change (`kvstate diagram --diff OLD NEW`): one diagram, one Markdown summary.

`diff_specs` compares two specs: transitions by (event, source, dest) — added, removed, or changed (guard, effect,
destructive flag) — policy rules by name, states and invariants by name. `diff_diagram` is the union of both
(broadcast edges bundled, as the lifecycle view, where the event is broadcast in both specs and none of its edges
changed; an arrow never bundles edges of different changes; `all_edges`: one arrow per transition);
`render_diff_dot` draws it laid out as the lifecycle (by roles), added edges green and bold, removed ones red and
dotted, changed ones orange and bold with `old → new` in the label, the rest light grey and labelled without their
effects (context, not change). `summary_markdown` is the text a reviewer pastes into a pull request.

Invariants kept: the diff is a pure function of the two specs, in spec order (new spec first, then what only the old
one has); every text from a spec is written through `kvstate.diagrams.escape`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from kvstate.diagrams.dot import LegendRow, View, common_legend_rows, render_dot
from kvstate.diagrams.escape import md_code, md_text
from kvstate.diagrams.ir import Diagram, DrawnEdge, build_diagram
from kvstate.spec import Spec
from kvstate.validate import MAX_PROBLEMS

ADDED, REMOVED, CHANGED, SAME = "added", "removed", "changed", "unchanged"
CHANGE_STYLES = {  # change -> (colour, DOT style, legend sample)
    ADDED: ("#2e7d32", "bold", "——— green, bold"),
    REMOVED: ("#c62828", "dotted", "· · · red dotted"),
    CHANGED: ("#e65100", "bold", "——— orange, bold"),
    SAME: ("#bdbdbd", "solid", "——— light grey"),
}
CHANGE_MEANINGS = {
    ADDED: "transition only the new spec has",
    REMOVED: "transition only the old spec has",
    CHANGED: "transition in both whose guard, effect or destructive flag changed (old → new)",
    SAME: "unchanged transition, labelled event [guard] (its effect: kvstate diagram)",
}


@dataclass(frozen=True, slots=True)
class EdgeChange:
    """One transition that differs: `key` is (event, source, dest); `details` say what changed (CHANGED only)."""

    key: tuple[str, str, str]
    change: str
    details: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SpecDiff:
    """What differs between two specs; empty tuples when nothing does."""

    edges: tuple[EdgeChange, ...]
    policy: tuple[tuple[str, object, object], ...]  # (rule, old value, new value)
    states: tuple[tuple[str, str], ...]  # (state, ADDED or REMOVED)
    invariants: tuple[tuple[str, str], ...]  # (invariant id, ADDED or REMOVED)

    @property
    def empty(self) -> bool:
        return not (self.edges or self.policy or self.states or self.invariants)

    def change_of(self, key: tuple[str, str, str]) -> EdgeChange | None:
        return next((c for c in self.edges if c.key == key), None)


def _names(value: object) -> str:
    return ", ".join(value) if isinstance(value, tuple) else str(value)


def diff_specs(old: Spec, new: Spec) -> SpecDiff:
    before = {(t.event, t.source, t.dest): t for t in old.transitions}
    after = {(t.event, t.source, t.dest): t for t in new.transitions}
    edges = []
    for key, t in after.items():
        if key not in before:
            edges.append(EdgeChange(key, ADDED))
            continue
        was = before[key]
        details = tuple(
            f"{what} {_shown(getattr(was, what))} → {_shown(getattr(t, what))}"
            for what in ("guard", "effect", "destructive")
            if getattr(was, what) != getattr(t, what)
        )
        if details:
            edges.append(EdgeChange(key, CHANGED, details))
    edges += [EdgeChange(key, REMOVED) for key in before if key not in after]
    policy = tuple(
        (f.name, getattr(old.policy, f.name), getattr(new.policy, f.name))
        for f in fields(new.policy)
        if getattr(old.policy, f.name) != getattr(new.policy, f.name)
    )
    old_states, new_states = {s.name for s in old.states}, {s.name for s in new.states}
    states = tuple((s.name, ADDED) for s in new.states if s.name not in old_states)
    states += tuple((s.name, REMOVED) for s in old.states if s.name not in new_states)
    old_ids, new_ids = {i.id for i in old.invariants}, {i.id for i in new.invariants}
    invariants = tuple((i.id, ADDED) for i in new.invariants if i.id not in old_ids)
    invariants += tuple((i.id, REMOVED) for i in old.invariants if i.id not in new_ids)
    return SpecDiff(tuple(edges), policy, states, invariants)


def policy_change(was: object, now: object) -> str:
    """A changed rule in few words: for a list, what left it (−) and what joined it (+); else old → new."""
    if isinstance(was, tuple) and isinstance(now, tuple):
        parts = [f"− {x}" for x in was if x not in now] + [f"+ {x}" for x in now if x not in was]
        return ", ".join(parts) or "order changed: " + _names(now)
    return f"{_names(was)} → {_names(now)}"


def _shown(value: object) -> str:
    return "none" if value is None else str(value)


def diff_diagram(old: Spec, new: Spec, diff: SpecDiff | None = None, *, all_edges: bool = False) -> Diagram:
    """Both specs on one diagram: the new spec's states and transitions, then what only the old one has.

    An arrow bundles only transitions of one change (`Diagram.apart`), and only an event that is broadcast in both
    specs and whose transitions none changed is drawn from "any state" (`Diagram.bundled`): a change to one
    state's edge is drawn on that edge alone, and every other edge keeps its arrow."""
    diff = diff if diff is not None else diff_specs(old, new)
    base = build_diagram(new, all_edges=all_edges)
    gone = build_diagram(old, all_edges=all_edges)
    keys = {e.key for e in base.edges}
    names = {n.name for n in base.nodes}
    return replace(
        base,
        title=f"{new.name}: changes from {old.name} v{old.version}",
        nodes=base.nodes + tuple(n for n in gone.nodes if n.name not in names),
        edges=base.edges + tuple(e for e in gone.edges if e.key not in keys),
        apart={change.key: change.change for change in diff.edges},
        bundled=tuple(event for event in base.broadcast_events if event in gone.broadcast_events),
    )


def change_of(diff: SpecDiff, edge: DrawnEdge) -> EdgeChange:
    """The change of a drawn edge: of its first member that changed (a bundle may hold several)."""
    found = (diff.change_of(member.key) for member in edge.members)
    return next((c for c in found if c is not None), EdgeChange(edge.members[0].key, SAME))


PROBLEM_COLOR = CHANGE_STYLES[REMOVED][0]  # red: a proposal's validation problems
PROBLEM_LINE = 110  # characters of a problem per legend line
MAX_PROBLEM_CHARS = 400  # characters of one problem the picture keeps (the summary keeps every one whole)


def problem_rows(problems: Sequence[str]) -> list[LegendRow]:
    """The new spec's validation problems as legend rows, keys in red: a row saying the spec is not well formed,
    then `problem N` and the problem, wrapped, at most `MAX_PROBLEMS` of them (and a row saying how many more)."""
    if not problems:
        return []
    rows = [
        LegendRow(
            "NOT WELL FORMED",
            f"the new spec has {len(problems)} validation problem(s); every command given it with --spec refuses it",
            PROBLEM_COLOR,
        )
    ]
    for number, problem in enumerate(problems[:MAX_PROBLEMS], 1):
        text = problem if len(problem) <= MAX_PROBLEM_CHARS else problem[: MAX_PROBLEM_CHARS - 1] + "…"
        for index, line in enumerate(textwrap.wrap(text, PROBLEM_LINE) or [""]):
            rows.append(LegendRow(f"problem {number}" if index == 0 else "", line, PROBLEM_COLOR))
    if len(problems) > MAX_PROBLEMS:
        rows.append(LegendRow("", f"... and {len(problems) - MAX_PROBLEMS} more (spec-diff.md lists them all)"))
    return rows


def diff_view(diff: SpecDiff, problems: Sequence[str] = ()) -> View:
    """The diff's edges by change; `problems`, the new spec's validation problems, head the legend in red."""

    def labels(diagram: Diagram, drawn: tuple[DrawnEdge, ...]) -> list[tuple[str, ...]]:
        out = []
        for edge in drawn:
            change = change_of(diff, edge)
            if change.change == SAME:  # context: event and guard; the effect would crowd the changes out
                out.append(tuple(edge.head_parts()))
            else:
                out.append((f"[{change.change}]", *edge.label_parts(), *change.details))
        return out

    def attributes(diagram: Diagram, edge: DrawnEdge) -> list[str]:
        color, style, _ = CHANGE_STYLES[change_of(diff, edge).change]
        return [f'color="{color}", fontcolor="{color}", style={style}']

    def legend(diagram: Diagram) -> list[LegendRow]:
        rows = problem_rows(problems)
        rows += [LegendRow(CHANGE_STYLES[c][2], CHANGE_MEANINGS[c], CHANGE_STYLES[c][0]) for c in CHANGE_STYLES]
        rows += [LegendRow(f"policy {rule}", policy_change(was, now)) for rule, was, now in diff.policy]
        return rows + common_legend_rows(diagram)

    return View(": the spec change", labels, attributes, legend)


def render_diff_dot(
    old: Spec, new: Spec, diff: SpecDiff | None = None, *, all_edges: bool = False, problems: Sequence[str] = ()
) -> str:
    """The diff picture's DOT source; `all_edges` draws every transition as its own arrow; `problems` (the new
    spec's validation problems) are listed in red in its legend."""
    diff = diff if diff is not None else diff_specs(old, new)
    return render_dot(diff_diagram(old, new, diff, all_edges=all_edges), diff_view(diff, problems))


def summary_markdown(old: Spec, new: Spec, diff: SpecDiff | None = None, problems: Sequence[str] = ()) -> str:
    """The change as Markdown for a pull request: the new spec's validation problems first (when it has any), then
    transitions, policy rules, states, invariants."""
    diff = diff if diff is not None else diff_specs(old, new)
    lines = [
        f"### Spec change: {md_text(old.name)} v{old.version} → {md_text(new.name)} v{new.version}",
        "",
    ]
    if problems:
        refused = "every command given it with `--spec` refuses it"
        lines += [f"**The new spec is not well formed** ({len(problems)} problem(s); {refused}):", ""]
        lines += [f"* {md_text(problem)}" for problem in problems]
        lines.append("")
    if diff.empty:
        return "\n".join([*lines, "No transition, policy rule, state or invariant changed.", ""])
    if diff.edges:
        lines += ["| change | event | from | to | what changed |", "| --- | --- | --- | --- | --- |"]
        lines += [
            f"| {c.change} | {md_code(c.key[0])} | {md_code(c.key[1])} | {md_code(c.key[2])} | "
            f"{md_text('; '.join(c.details)) or '—'} |"
            for c in diff.edges
        ]
        lines.append("")
    if diff.policy:
        lines += ["| policy rule | old | new |", "| --- | --- | --- |"]
        lines[-2:] = ["| policy rule | old | new | change |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {md_code(r)} | {md_text(_names(a))} | {md_text(_names(b))} | {md_text(policy_change(a, b))} |"
            for r, a, b in diff.policy
        ]
        lines.append("")
    for what, items in (("state", diff.states), ("invariant", diff.invariants)):
        lines += [f"* {what} {md_code(name)} {change}" for name, change in items]
    return "\n".join(lines).rstrip("\n") + "\n"
