"""What every benchmark returns: ratio rows for the table, plus raw series for the plots and the JSON file.

A `Row` is one figure: a measured value, the baseline it ran beside in the same loop, their ratio, and the
target (if any) with whether it is met. A peer that is not installed leaves its rows without a baseline
(`baseline=None`, `baseline_name` saying so): our value is still measured, the ratio is undefined. `Section`
groups the rows of one benchmark with its raw data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Row:
    """One figure. `ratio = value / baseline` (NaN without a baseline); `better` says which direction of the
    ratio is good."""

    group: str
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline: float | None
    better: str = "higher"  # "higher" or "lower": which direction of `ratio` is good
    target: str = ""  # e.g. "ratio >= 0.7"; empty when the figure has no target
    met: bool | None = None  # None when there is no target
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")  # None or 0: no ratio

    def to_dict(self) -> dict:
        """JSON-ready: a ratio that is not finite (a zero baseline) is null, and so is a value that could not be
        measured (NaN: the model a group measures is not installed)."""
        ratio = self.ratio
        value = self.value if math.isfinite(self.value) else None
        return {**asdict(self), "value": value, "ratio": ratio if math.isfinite(ratio) else None}


@dataclass
class Section:
    """The rows and raw data of one benchmark."""

    name: str
    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "rows": [row.to_dict() for row in self.rows], "data": self.data}
