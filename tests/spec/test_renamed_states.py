"""Code reads state roles, never state names: a copy of the spec with every state renamed runs unchanged through
the scheduler on the sim (with a host tier, without one, with two pipeline stages), the trace validator, the model
checker (abstract model, refinement and step simulation) and the diagrams."""

from __future__ import annotations

import json
import random
import re
import tomllib
from pathlib import Path

import pytest
import tomli_w

from kvstate.checker import HOLDS, check_bound, select_bounds, validate_trace
from kvstate.config import SchedulerConfig
from kvstate.diagrams import render_sources
from kvstate.scheduler import Scheduler
from kvstate.sim import SimExecutor, reference_output
from kvstate.spec import load_spec, packaged_spec_path
from kvstate.trace import trace_record

PACKAGED = load_spec()
RENAMED = {s.name: f"st{i}_{s.role.upper()}" for i, s in enumerate(PACKAGED.states)}


def rename(data: dict) -> dict:
    """The spec's TOML data with every state name replaced (and nothing else)."""
    data["spec"]["initial"] = RENAMED[data["spec"]["initial"]]
    for state in data["states"]:
        state["name"] = RENAMED[state["name"]]
    for event in data["events"]:
        for edge in event["transitions"]:
            edge["source"] = [RENAMED[s] for s in edge["source"]]
            edge["dest"] = RENAMED[edge["dest"]]
    for output_list in data["output_lists"]:
        output_list["states"] = [RENAMED[s] for s in output_list["states"]]
    return data


@pytest.fixture(scope="module")
def renamed_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("renamed") / "lifecycle.toml"
    path.write_text(tomli_w.dumps(rename(tomllib.loads(packaged_spec_path().read_text(encoding="utf-8")))))
    return path


@pytest.fixture(scope="module")
def renamed(renamed_path: Path):
    spec = load_spec(renamed_path)
    assert not {s.name for s in spec.states} & {s.name for s in PACKAGED.states}
    return spec


@pytest.mark.parametrize("host_blocks, stages", [(6, 1), (0, 1), (4, 2)])
def test_the_scheduler_runs_a_pressured_workload_on_renamed_states(renamed, host_blocks: int, stages: int) -> None:
    lines: list[str] = []
    scheduler = Scheduler(
        SchedulerConfig(
            gpu_blocks=12, host_blocks=host_blocks, block_size=2, prefill_chunk_size=4, pipeline_stages=stages
        ),
        renamed,
        on_transition=lambda r, t: lines.append(json.dumps(trace_record(scheduler, r, t))),
    )
    rng = random.Random(host_blocks + stages)
    work = {}
    for i in range(8):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(2, 9))]
        work[i] = (prompt, rng.randint(2, 24 - len(prompt)))
        scheduler.submit(*work[i], request_id=i)
    outputs = SimExecutor(scheduler).run(max_iterations=2000)
    assert outputs == {i: reference_output(p, m) for i, (p, m) in work.items()}
    events = {json.loads(line)["event"] for line in lines}
    assert "recompute_pause" in events and ("suspend" in events) == bool(host_blocks)
    report = validate_trace(lines, renamed)
    assert report.ok, report


@pytest.mark.parametrize("bound", ["default", "pipeline2"])
def test_the_model_checker_holds_on_renamed_states(renamed, bound: str) -> None:
    (b,) = select_bounds([bound])
    report = check_bound(b, spec=renamed)
    assert report.verdict == HOLDS, report.counterexample


def test_the_diagrams_name_the_renamed_states(renamed) -> None:
    sources = render_sources(renamed)
    text = "\n".join(sources.values())
    assert all(name in text for name in RENAMED.values())
    for old in RENAMED:  # no node or edge end keeps an old name (prose and list names may still say "suspended")
        as_node = re.compile(rf'(^|[\s"]){old}"?\s*(\[|->|-->|:)|(->|-->)\s*"?{old}\b', re.MULTILINE)
        assert not as_node.search(text), f"a diagram still draws state {old!r}"
