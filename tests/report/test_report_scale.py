"""`kvstate report` and `kvstate validate` are linear in the trace: the timeline draws one
collection per state however many requests there are (no artist per span), and the validator never walks or copies
its per-tier maps of the requests' blocks per line. Algorithmic properties, not wall times."""

from __future__ import annotations

import json

import pytest

from kvstate import load_spec
from kvstate.checker import trace as validator
from kvstate.checker.trace import validate_trace
from kvstate.roles import ACTIVE, ENDED, OFFLOADED, QUEUED


def trace_lines(requests: int) -> list[dict]:
    """A valid trace: every request admitted, then every one suspended (held on the GPU), offloaded, resumed and
    finished (edges by role); each copy completes before the next line."""
    spec = load_spec()
    role = spec.role
    edge = {(t.source, t.dest): t for t in spec.transitions}
    active, held = role(ACTIVE), role(OFFLOADED)
    # (source, dest, the request's (GPU, host) blocks after the edge, the blocks its copy fences on the line)
    steps = [
        (role(QUEUED), active, (1, 0), (0, 0)),
        (active, held, (1, 0), (0, 0)),
        (held, held, (0, 1), (1, 0)),
        (held, active, (1, 0), (0, 1)),
        (active, role(ENDED), (0, 0), (0, 0)),
    ]
    lines, owned, blocks = [], [0, 0], {}
    for phase, (source, dest, after, fenced) in enumerate(steps):
        t = edge[(source, dest)]
        for rid in range(requests):
            before = blocks.get(rid, (0, 0))
            owned = [owned[k] + after[k] - before[k] for k in (0, 1)]
            blocks[rid] = after
            lines.append(
                {
                    "iteration": 1 + phase * requests + rid,
                    "request_id": rid,
                    "event": t.event,
                    "from": source,
                    "to": dest,
                    "gpu_blocks": after[0],
                    "host_blocks": after[1],
                    "gpu_free": requests - owned[0] - fenced[0],
                    "host_free": requests - owned[1] - fenced[1],
                    "gpu_fenced": fenced[0],
                    "host_fenced": fenced[1],
                    "gpu_capacity": requests,
                    "host_capacity": requests,
                    "generated": phase,
                    "computed_tokens": 4,
                    "done_reason": (
                        spec.event_by_name[t.event].done_reason if spec.state_by_name[dest].terminal else None
                    ),
                }
            )
    return lines


class CountingDict(dict):
    """A dict that counts the walks over it and the copies made of it."""

    walks = 0

    def _count(self):
        CountingDict.walks += 1

    def __iter__(self):
        self._count()
        return super().__iter__()

    def keys(self):
        self._count()
        return super().keys()

    def values(self):
        self._count()
        return super().values()

    def items(self):
        self._count()
        return super().items()

    def copy(self):
        self._count()
        return CountingDict(self)

    def __or__(self, other):
        self._count()
        return CountingDict(dict.__or__(self, other))


def test_validation_never_walks_the_requests_holding_blocks(monkeypatch) -> None:
    original = validator._Validator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.blocks = {tier: CountingDict() for tier in self.blocks}

    monkeypatch.setattr(validator._Validator, "__init__", init)
    CountingDict.walks = 0
    lines = [json.dumps(line) for line in trace_lines(300)]
    report = validate_trace(lines)
    assert report.ok, report.divergence and report.divergence.describe()
    assert report.lines == 1500 and CountingDict.walks == 0, "a walk per line makes reading quadratic"


def test_the_timeline_draws_one_collection_per_state_not_per_request(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from kvstate.report.figures import timeline
    from kvstate.report.model import summarize

    spec = load_spec()
    counts = []
    for requests in (20, 200):
        fig = timeline(summarize(trace_lines(requests)), spec)
        ax = fig.axes[0]
        counts.append(len(ax.collections) + len(ax.patches))
    assert counts[0] == counts[1] <= len(spec.states), counts


def test_a_counterexample_loop_is_marked_and_reached() -> None:
    """A lasso's loop (`kvstate check` writes it with the trace) is shaded and named on both figures, and the
    figures reach its last iteration even when the loop takes no transition."""
    pytest.importorskip("matplotlib")
    from kvstate.report.figures import occupancy, timeline
    from kvstate.report.model import summarize

    lines = trace_lines(3)
    summary = summarize(lines, loop=(5, lines[-1]["iteration"] + 20))
    assert summary.last_iteration == lines[-1]["iteration"] + 20
    for fig in (timeline(summary, load_spec()), occupancy(summary)):
        assert any("repeats forever" in t.get_text() for ax in fig.axes for t in ax.texts)
    with pytest.raises(ValueError, match="first <= last"):
        summarize(lines, loop=(9, 3))
