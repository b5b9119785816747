"""The rich table of every figure, the JSON document of a run, and the summary of its targets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from executor.bench.results import Row, Section

if TYPE_CHECKING:  # rich is imported where a table is drawn
    from rich.console import JustifyMethod


def document(sections: list[Section], meta: dict) -> dict:
    """The JSON-ready record of a run: metadata, then every section's rows (with ratios) and raw data."""
    return {"meta": meta, "sections": [section.to_dict() for section in sections]}


def write_json(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False, default=_finite) + "\n", encoding="utf-8")
    return path


def _finite(value: object) -> object:
    raise TypeError(f"not JSON serializable: {value!r}")


def _num(x: float) -> str:
    if math.isnan(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def render_table(sections: list[Section], title: str):
    """One row per figure: measured value over the baseline measured beside it, ratio, target and verdict.

    Four columns whose cells take two lines (figure over its note, ours over the baseline), folded rather than
    cut, so the table reads in an 80-column terminal and widens with it.
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("figure", "left"),
        ("ours vs baseline", "right"),
        ("ratio", "right"),
        ("target", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold")
    for section in sections:
        for row in section.rows:
            figure = Text(f"{row.group}: {row.name}")
            if row.note:
                figure.append(f"\n{row.note}", style="dim")
            target = Text(row.target)
            if row.met is not None:
                target.append("\nmet" if row.met else "\nnot met", style="green" if row.met else "red")
            arrow = "↑" if row.better == "higher" else "↓"
            baseline = "" if row.baseline is None else f"{_num(row.baseline)} {row.unit} "
            table.add_row(
                figure,
                Text(f"{_num(row.value)} {row.unit}\nvs {baseline}{row.baseline_name}"),
                Text(f"{_num(row.ratio)} {arrow}"),
                target,
            )
        table.add_section()
    return table


def summary(sections: list[Section]) -> tuple[int, list[Row], int]:
    """(targets met, the rows whose target was not met, targets that could not be judged: no baseline)."""
    targeted = [row for section in sections for row in section.rows if row.target]
    missed = [row for row in targeted if row.met is False]
    return sum(row.met is True for row in targeted), missed, sum(row.met is None for row in targeted)


def summary_line(sections: list[Section]) -> str:
    """'targets: 5 met, 2 not met (group: figure; ...), 1 not judged (no baseline)' for the end of a run."""
    met, missed, unjudged = summary(sections)
    text = f"targets: {met} met, {len(missed)} not met"
    if missed:
        text += " (" + "; ".join(f"{row.group}: {row.name}" for row in missed) + ")"
    if unjudged:
        text += f", {unjudged} not judged (no baseline)"
    return text
