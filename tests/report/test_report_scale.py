"""`kvstate report` and `kvstate validate` are linear in the trace (issue 32, item 15): the timeline draws one
collection per state however many requests there are (no artist per span), and the validator never copies its
set of requests in host states per line. Algorithmic properties, not wall times."""

from __future__ import annotations

import json

import pytest

from kvstate import load_spec
from kvstate.checker import trace as validator
from kvstate.checker.trace import validate_trace
from kvstate.roles import ACTIVE, ENDED, OFFLOADED, QUEUED


def trace_lines(requests: int) -> list[dict]:
    """A valid trace: every request admitted, then every one suspended, resumed and finished (events by role)."""
    spec = load_spec()
    role = spec.role
    edge = {(t.source, t.dest): t for t in spec.transitions}
    steps = [(role(QUEUED), role(ACTIVE)), (role(ACTIVE), role(OFFLOADED)), (role(OFFLOADED), role(ACTIVE))]
    steps.append((role(ACTIVE), role(ENDED)))
    lines, gpu_free, host_free = [], requests, requests
    for phase, (source, dest) in enumerate(steps):
        t = edge[(source, dest)]
        for rid in range(requests):
            gpu_free += {0: -1, 1: 1, 2: -1, 3: 1}[phase]
            host_free += {1: -1, 2: 1}.get(phase, 0)
            on_host = spec.residency(dest) == "host"
            lines.append(
                {
                    "iteration": 1 + phase * requests + rid,
                    "request_id": rid,
                    "event": t.event,
                    "from": source,
                    "to": dest,
                    "gpu_blocks": 0 if on_host or spec.residency(dest) == "none" else 1,
                    "host_blocks": 1 if on_host else 0,
                    "gpu_free": gpu_free,
                    "host_free": host_free,
                    "gpu_fenced": 0,
                    "host_fenced": 0,
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


class CountingSet(set):
    """A set that counts the whole-set copies made of it."""

    copies = 0

    def _count(self):
        CountingSet.copies += 1

    def __or__(self, other):
        self._count()
        return CountingSet(set.__or__(self, other))

    def __sub__(self, other):
        self._count()
        return CountingSet(set.__sub__(self, other))

    def copy(self):
        self._count()
        return CountingSet(self)


def test_validation_never_copies_the_requests_in_host_states(monkeypatch) -> None:
    original = validator._Validator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.host_held = CountingSet()

    monkeypatch.setattr(validator._Validator, "__init__", init)
    CountingSet.copies = 0
    lines = [json.dumps(line) for line in trace_lines(300)]
    report = validate_trace(lines)
    assert report.ok, report.divergence and report.divergence.describe()
    assert report.lines == 1200 and CountingSet.copies == 0, "a copy per line makes reading quadratic"


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
