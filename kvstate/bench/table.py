"""The rich table of every figure and the JSON document of a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvstate.bench.results import Section

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
