"""`kvstate demo` end to end on a small workload."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstate.cli import main

SMALL_DEMO = ["--gpu-blocks", "12", "--block-size", "4"]  # a GPU tier of 12 blocks of 4 tokens: small, so pressured


def test_demo_runs_and_passes(tmp_path, capsys):
    trace = tmp_path / "demo.ndjson"
    code = main(
        [
            "demo",
            *SMALL_DEMO,
            "--requests",
            "8",
            "--host-blocks",
            "4",
            "--device",
            "cpu",
            "--seed",
            "1",
            "--trace",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OUTPUT EQUIVALENCE: PASS" in out
    assert "recompute-pauses" in out and "bytes migrated" in out and "tokens/s" in out
    assert str(trace) in out.replace("\n", "")
    lines = trace.read_text().splitlines()
    assert lines and all(json.loads(line)["event"] for line in lines)


def _summary(out: str) -> dict[str, str]:
    """The demo's summary rows, metric -> value, read back from its printed table."""
    rows = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) == 2 and all(cells):
            rows[cells[0]] = cells[1]
    return rows


@pytest.mark.parametrize("offload", ["on_demand", "eager"])
def test_demo_prints_what_each_offload_policy_copied(offload, capsys):
    argv = ["demo", "--gpu-blocks", "16", "--block-size", "4", "--requests", "8", "--host-blocks", "32"]
    argv += ["--device", "cpu", "--seed", "1"]
    code = main([*argv, "--offload", offload])
    out = capsys.readouterr().out
    assert code == 0 and "OUTPUT EQUIVALENCE: PASS" in out, out
    rows = _summary(out)
    assert rows["offload policy"] == offload and f"offload {offload}" in out
    offloaded, onboarded = int(rows["blocks offloaded (GPU -> host)"]), int(rows["blocks onboarded (host -> GPU)"])
    assert offloaded > 0 and int(rows["offloads"]) > 0
    assert offloaded + onboarded == int(rows["blocks migrated"])
    without, of = rows["resumes without a copy"].split(" of ")
    assert int(of) == int(rows["resumes"]) > 0
    if offload == "eager":  # a host tier with room for every victim: each one's blocks were all copied down
        assert int(without) == int(rows["blocks re-locked without a copy"]) == 0
    else:
        assert int(rows["blocks re-locked without a copy"]) > 0


def test_demo_without_host_tier(tmp_path, capsys):
    code = main(
        [
            "demo",
            *SMALL_DEMO,
            "--requests",
            "6",
            "--host-blocks",
            "0",
            "--device",
            "cpu",
            "--trace",
            str(tmp_path / "t.ndjson"),
        ]
    )
    assert code == 0
    assert "PASS" in capsys.readouterr().out


def test_demo_writes_a_report_of_its_trace(tmp_path, capsys):
    code = main(
        [
            "demo",
            *SMALL_DEMO,
            "--requests",
            "6",
            "--host-blocks",
            "4",
            "--device",
            "cpu",
            "--trace",
            str(tmp_path / "[x] t.ndjson"),  # paths that read as Rich markup are printed as typed
            "--report",
            str(tmp_path / "[link=https:x]report"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    html = tmp_path / "[link=https:x]report" / "report.html"
    assert f"report: {html}" in out.splitlines() and html.stat().st_size > 0
    assert f"trace: {tmp_path / '[x] t.ndjson'} (" in out


@pytest.mark.distributed
def test_demo_on_two_pipeline_stages(tmp_path, capsys):
    trace = tmp_path / "pp.ndjson"
    code = main(
        [
            "demo",
            *SMALL_DEMO,
            "--pp",
            "2",
            "--requests",
            "6",
            "--host-blocks",
            "4",
            "--device",
            "cpu",
            "--trace",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pipeline stages" in out and "OUTPUT EQUIVALENCE: PASS" in out
    assert "blocks offloaded (GPU -> host)" in out and "resumes without a copy" in out
    assert trace.exists() and (tmp_path / "pp.rank1.ndjson").exists()


def test_demo_bad_option_is_a_clear_error(tmp_path, capsys):
    code = main(["demo", "--gpu-blocks", "0", "--device", "cpu", "--trace", str(tmp_path / "t.ndjson")])
    assert code == 2
    assert "--gpu-blocks must be a positive integer, got 0" in capsys.readouterr().err


def test_import_kvstate_does_not_import_torch():
    code = "import sys, kvstate, kvstate.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.cuda
def test_demo_on_cuda(tmp_path, capsys):
    code = main(
        [
            "demo",
            *SMALL_DEMO,
            "--requests",
            "8",
            "--host-blocks",
            "4",
            "--device",
            "cuda",
            "--trace",
            str(tmp_path / "t.ndjson"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on cuda" in out and "PASS" in out


def test_demo_on_cuda_without_cuda_is_one_error_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for pp in ("1", "2"):
        code = main(["demo", "--pp", pp, "--device", "cuda", "--trace", str(tmp_path / "t.ndjson")])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert err.count("\n") == 1 and "--device cuda" in err and "use 'cpu' or 'auto'" in err


def test_demo_with_more_stages_than_layers_says_what_to_pass(tmp_path, capsys):
    code = main(["demo", "--pp", "3", "--device", "cpu", "--trace", str(tmp_path / "t.ndjson")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--pp 3" in err and "use --pp between 1 and 2" in err
    assert "world_size" not in err and "num_layers" not in err and not (tmp_path / "t.ndjson").exists()


def test_demo_says_when_requests_are_capped_to_fit_the_gpu_tier(tmp_path, capsys):
    code = main(
        [
            "demo",
            "--requests",
            "3",
            "--gpu-blocks",
            "2",
            "--block-size",
            "8",
            "--host-blocks",
            "0",
            "--device",
            "cpu",
            "--trace",
            str(tmp_path / "t.ndjson"),
        ]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "PASS" in out
    assert "each request is capped at 16 tokens" in out


def test_ctrl_c_during_the_demo_is_one_calm_line_and_exit_130(tmp_path, capsys, monkeypatch):
    from executor.model import LlamaModel

    forward = LlamaModel.forward_paged
    calls = []

    def interrupted_on_the_tenth_pass(self, batch, cache):  # the user presses Ctrl-C during a forward pass
        calls.append(None)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return forward(self, batch, cache)

    monkeypatch.setattr(LlamaModel, "forward_paged", interrupted_on_the_tenth_pass)
    code = main(["demo", *SMALL_DEMO, "--requests", "8", "--device", "cpu", "--trace", str(tmp_path / "t.ndjson")])
    err = capsys.readouterr().err
    assert code == 130 and len(calls) == 10
    assert err.count("\n") == 1 and err.startswith("kvstate demo: interrupted at step "), err
    assert "was settled" in err and "of 8 requests had finished" in err
    assert "failed" not in err and "keep stepping" not in err, err


def test_the_demo_peaks_count_a_state_entered_and_left_within_one_step(capsys):
    from executor import Engine
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, demo_engine_config, random_workload
    from executor.commands.demo import _run_with_progress, progress_status
    from kvstate.terminal import console

    config = demo_engine_config(
        gpu_blocks=12,
        host_blocks=4,
        block_size=4,
        chunk_size=64,
        hidden_size=64,
        seed=0,
        dtype="float64",
        trace=None,
        device="cpu",
    )
    with Engine(config) as engine:
        entered, sampled = set(), {}
        engine.scheduler.on_transition = lambda request, transition: entered.add(transition.dest)
        step = engine.step

        def sampling_step():  # what a per-step sample of requests_per_state sees
            stats = step()
            for state, count in stats.requests_per_state.items():
                sampled[state] = max(sampled.get(state, 0), count)
            return stats

        engine.step = sampling_step
        work = random_workload(
            8, 0, DEMO_PROMPT_LEN, DEMO_MAX_NEW_TOKENS, vocab=engine.model.config.vocab_size, max_tokens=48
        )
        for prompt, new in work:
            engine.add_request(prompt, new)
        peak = _run_with_progress(engine, console())
        assert any(sampled[state] == 0 for state in entered), "no state was entered and left within one step"
        assert all(peak[state] >= max(1, sampled[state]) for state in entered), (peak, entered)
        status = progress_status(engine, engine.stats())
        assert status.startswith(
            f"suspensions {engine.totals.suspensions}, recompute-pauses {engine.totals.recompute_pauses} (now 0 "
        )
        assert engine.totals.recompute_pauses > 0
