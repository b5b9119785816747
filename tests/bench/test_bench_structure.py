"""Structure of the benchmark code (never wall times): keys present, ratios positive, JSON valid."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from executor.bench.migration import layout_plans
from executor.bench.overhead import scheduler_section, transition_section
from executor.bench.results import Row, Section
from executor.bench.stepping import OursDriver, Workload
from executor.bench.table import document, render_table, write_json
from executor.bench.timing import interleaved, medians
from kvstate.cli import main


def test_interleaved_runs_every_variant_every_round_in_seeded_order():
    calls = []
    samples = interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        repeats=4,
        warmup=1,
        seed=3,
        setup={"a": lambda: calls.append("setup a")},
    )
    assert set(samples) == {"a", "b"} and all(len(v) == 4 for v in samples.values())
    assert calls.count("a") == calls.count("b") == calls.count("setup a") == 5
    assert all(calls[i + 1] == "a" for i, c in enumerate(calls) if c == "setup a")
    again = []
    interleaved({"a": lambda: again.append("a"), "b": lambda: again.append("b")}, repeats=4, warmup=1, seed=3)
    assert again == [c for c in calls if c != "setup a"]
    assert all(t >= 0 for t in medians(samples).values())
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"a": lambda: None}, repeats=0)


def test_row_ratio_and_json_of_a_zero_baseline():
    row = Row("g", "n", 2.0, "x", "b", 4.0)
    assert row.ratio == 0.5 and row.to_dict()["ratio"] == 0.5
    assert Row("g", "n", 2.0, "x", "b", 0.0).to_dict()["ratio"] is None


def test_layout_plans_come_from_the_pool():
    offload, resume, gpu = layout_plans("contiguous", 8)
    assert len(offload.runs()) == len(resume.runs()) == 1 and gpu == 8
    assert (offload.direction, resume.direction) == ("to_host", "to_gpu") and offload.num_blocks == 8
    offload, resume, gpu = layout_plans("alternating", 8)
    assert len(offload.runs()) == 8 and gpu == 16
    assert [d for _, d in resume.pairs] == [s for s, _ in offload.pairs]  # resumed onto the same fragmented ids
    assert layout_plans("random", 32, seed=1)[0] == layout_plans("random", 32, seed=1)[0]
    assert 1 < len(layout_plans("random", 32, seed=1)[0].runs()) < 32


@pytest.mark.parametrize("size", [16, 48])
def test_steady_workload_decodes_everyone_every_step_and_pressure_preempts(size):
    steps = 20
    steady = OursDriver(Workload(size, "steady", steps))
    settling = len(steady.step_s)
    for _ in range(steps):
        steady.step()
    assert steady.scheduled[settling:] == [size] * steps and steady.preempted == [0] * (settling + steps)
    assert len(steady.step_s) == len(steady.schedule_s) == settling + steps
    assert all(whole >= part > 0 for whole, part in zip(steady.step_s, steady.schedule_s, strict=True))
    pressure = Workload(size, "pressure", steps)
    assert pressure.gpu_blocks < steady.workload.gpu_blocks and pressure.max_new_tokens > steps
    squeezed = OursDriver(pressure, lifecycle="compiled")
    for _ in range(steps):
        squeezed.step()
    assert max(squeezed.scheduled[-steps:]) < size  # the GPU tier no longer holds everyone
    requests = squeezed.scheduler.requests.values()
    assert any(r.num_recomputed_tokens for r in requests)  # victims were recompute-paused and replayed
    assert not any(r.generated and r.final_token_produced for r in requests)  # nobody finished


def test_workload_rejects_unknown_regimes():
    with pytest.raises(ValueError, match="regime"):
        Workload(16, "idle", 3)


def test_overhead_sections_have_positive_ratios():
    sections = [transition_section(repeats=1), scheduler_section(sizes=(16, 32), repeats=2)]
    rows = [row for s in sections for row in s.rows]
    assert rows and all(r.value > 0 and r.baseline > 0 and r.ratio > 0 for r in rows)
    assert sections[0].rows[0].met in (True, False)
    assert set(sections[1].data["figures"]) == {f"{n} steady ours" for n in (16, 32)} | {
        f"{n} pressure ours {k}" for n in (16, 32) for k in ("machine", "compiled")
    }


def test_table_and_json(tmp_path):
    from rich.console import Console

    section = Section("x", [Row("g", "fig", 1.0, "u", "base", 2.0, target="ratio >= 0.7", met=False)], {"k": 1})
    console = Console(record=True, width=200)
    console.print(render_table([section], "t"))
    text = console.export_text()
    assert "fig" in text and "0.5" in text and "ratio >= 0.7" in text
    path = write_json(document([section], {"quick": True}), tmp_path / "b.json")
    doc = json.loads(path.read_text())
    assert doc["meta"] == {"quick": True} and doc["sections"][0]["rows"][0]["ratio"] == 0.5


def test_import_kvstate_bench_and_report_import_no_torch_or_matplotlib():
    code = (
        "import sys, kvstate, executor.bench, executor.bench.migration, executor.bench.end_to_end, "
        "executor.bench.plots, kvstate.report, kvstate.cli; kvstate.cli.build_parser(); "
        "bad = [m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_command_writes_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")
    path = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--quick",
                "--only",
                "overhead",
                "--only",
                "migration",
                "--json",
                str(path),
                "--plots",
                str(tmp_path / "plots"),
            ]
        )
        == 0
    )
    doc = json.loads(path.read_text())
    names = [s["name"] for s in doc["sections"]]
    assert names == ["migration", "transition", "scheduler"]
    for section in doc["sections"]:
        for row in section["rows"]:
            assert {"group", "name", "value", "baseline", "ratio", "target", "met"} <= set(row)
            assert row["ratio"] is not None and row["ratio"] > 0 and math.isfinite(row["value"])
    migration = doc["sections"][0]
    assert {(s["op"], s["layout"]) for s in migration["data"]["series"]} == {
        (op, layout) for op in ("offload", "resume") for layout in ("contiguous", "alternating", "random")
    }
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["migration.png", "scheduler.png"]
    assert doc["meta"]["vllm"] and doc["meta"]["transformers"]  # a version or "not installed"
    assert (tmp_path / "plots" / "migration.png").read_bytes()[:4] == b"\x89PNG"
    assert "ratio" in capsys.readouterr().out


def test_end_to_end_quick_structure():
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from executor.bench import end_to_end

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (host,) = end_to_end.run(quick=True, device="cpu")
        decode = end_to_end.decode_section(shape=end_to_end.DecodeShape((1, 3), 8, 6, 1), device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert [row.name.split(",")[1] for row in decode.rows] == [" batch 1", " batch 3"]
    assert all(row.ratio > 0 for row in decode.rows)
    assert {b: d["outputs_equal"] for b, d in decode.data["per_batch"].items()} == {1: 1, 3: 3}
    runs = host.data["runs"]
    assert set(runs) == {"none", "small", "large"}
    assert runs["none"]["suspensions"] == 0 and runs["none"]["recomputed"] > 0
    assert runs["large"]["recompute_pauses"] == 0 and runs["large"]["recomputed"] == 0
    assert len({r["generated"] for r in runs.values()}) == 1  # same workload, same tokens out
    assert all(row.value >= 0 and row.baseline > 0 for row in host.rows)


def test_lifecycle_and_pressure_sections_compare_side_by_side():
    from executor.bench.overhead import lifecycle_section, pressure_section

    lifecycle = lifecycle_section(size=32, repeats=1)
    assert set(lifecycle.data["us_per_call"]) == {
        f"{r} {k}" for r in ("steady", "pressure") for k in ("machine", "compiled")
    }
    assert all(row.baseline > 0 and row.value > 0 for row in lifecycle.rows)
    pressure = pressure_section(sizes=(32,), steps=3)
    (row,) = pressure.rows
    per_step = pressure.data["scheduled_per_step"][32]
    assert row.value == per_step["host tier"] and row.baseline == per_step["recompute only"] > 0
    assert row.met == (row.value / row.baseline >= 0.95)
