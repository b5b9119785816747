"""The CUDA path's pieces that run on the CPU too: the reused decode plan, staged fragmented copies, fences ordered
only before resumes, RMSNorm in low precision, the per-dtype equality rule, and scripts/gpu-check refusing cleanly."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor import BatchPlanner, PagedBatch, PagedKVCache, SeqChunk
from executor.checks import GAP_TOLERANCE, Compared, compare_outputs
from executor.model import RMSNorm
from kvstate.pool import TO_GPU, TO_HOST, MigrationPlan

GPU_CHECK = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


# ------------------------------------------------------------------------------------------ decode plan reuse
def _values(batch: PagedBatch) -> dict:
    """Every value of a batch, tensors as lists (None stays None)."""

    def plain(x):
        return x.tolist() if isinstance(x, torch.Tensor) else x

    groups = [
        {
            f: plain(getattr(g, f))
            for f in ("num_seqs", "num_queries", "num_blocks", "query_rows", "row_start", "blocks", "mask", "valid")
        }
        for g in batch.groups
    ]
    return {
        "input_ids": plain(batch.input_ids),
        "positions": plain(batch.positions),
        "slot_blocks": plain(batch.slot_blocks),
        "slot_offsets": plain(batch.slot_offsets),
        "seqs": batch.seqs,
        "logits_indices": plain(batch.logits_indices),
        "groups": groups,
        "out_order": plain(batch.out_order),
    }


def test_planner_reuses_decode_plans_and_equals_a_fresh_build():
    """Decode steps of a stable batch reuse the plan, also across block boundaries inside the plan's width, and
    when a request leaves (its row is dropped in place: the persistent decode batch), and for the decode steps of
    a batch whose prefill chunk comes first; a context outgrowing the plan, or a request back before the plan's
    own, rebuilds it; every batch holds exactly the values `PagedBatch.build` gives."""
    rng = random.Random(0)
    size = 4
    lengths = [3, 9, 6]  # the longest request sets the plan's width (3 blocks), the others cross inside it
    tables = [(10, 11, 12, 13, 14, 15), (20, 21, 22, 23, 24, 25), (30, 31, 32, 33, 34, 35)]
    planner = BatchPlanner(size)
    reused = []
    for step in range(12):
        members = range(3) if step < 8 else range(2)  # request 2 leaves at step 8
        if step == 5:
            chunks = [SeqChunk((1, 2), lengths[0], tables[0])] + [
                SeqChunk((rng.randrange(512),), lengths[i], tables[i]) for i in (1, 2)
            ]
        else:
            chunks = [SeqChunk((rng.randrange(512),), lengths[i], tables[i]) for i in members]
        before = planner.reuses
        assert _values(planner.plan(chunks)) == _values(PagedBatch.build(chunks, size))
        reused.append(planner.reuses > before)
        for c, i in zip(chunks, members, strict=True):
            lengths[i] += len(c.tokens)
    # built: 0 the first step; 3, 7, 11 request 1 needs one block more than the plan's width; 6 request 0 decodes
    # again, first in the batch (before the plan's requests). Reused: every other step, requests 0 and 2 crossing
    # into a new block inside the width at steps 1 and 2, step 5 (request 0's prefill chunk is built, requests 1
    # and 2 decode on the kept plan, request 0 dropped from it) and step 8, where request 2 left
    assert reused == [False, True, True, False, True, True, False, False, True, True, True, False]
    assert planner.reuses == 7 and planner.builds == 5


def test_planner_refuses_a_changed_table():
    """A request whose blocks changed (same position, other table) is rebuilt, not patched."""
    planner = BatchPlanner(4)
    planner.plan([SeqChunk((1,), 5, (3, 4))])
    batch = planner.plan([SeqChunk((2,), 6, (7, 4))])
    assert planner.reuses == 0 and batch.groups[0].blocks.tolist() == [7, 4]


# ---------------------------------------------------------------------------------------------- staged copies
def _cache(gpu=24, host=16, dtype=torch.float32) -> PagedKVCache:
    return PagedKVCache(
        gpu, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu", num_host_blocks=host
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_copy_moves_every_block_with_one_transfer_per_host_run(dtype):
    """The CUDA path for fragmented plans, run on the CPU: suspend gathers, resume scatters; the tier crossing is
    one copy per run of consecutive host ids."""
    cache = _cache(dtype=dtype)
    cache.device_cache.copy_(torch.randn(cache.device_cache.shape).to(dtype))
    suspend = MigrationPlan(0, "r", TO_HOST, ((1, 4), (3, 5), (8, 6), (9, 7), (20, 0)))  # host runs: 4..7, 0
    expected = cache.device_cache[[1, 3, 8, 9, 20]].clone()
    keep = cache._copy_staged(TO_HOST, cache.host_cache, cache.device_cache, suspend.pairs, suspend.runs())
    assert torch.equal(cache.host_cache[[4, 5, 6, 7, 0]], expected)
    assert cache.num_transfers == 2 and cache.num_copies == len(suspend.runs()) == 4
    assert keep[0].shape == (5, *cache.block_shape)  # the staging buffer the fence keeps
    resume = MigrationPlan(1, "r", TO_GPU, ((4, 17), (5, 2), (6, 13), (7, 11), (0, 0)))
    cache._copy_staged(TO_GPU, cache.device_cache, cache.host_cache, resume.pairs, resume.runs())
    assert torch.equal(cache.device_cache[[17, 2, 13, 11, 0]], expected)
    assert cache.num_transfers == 4


def test_cpu_execute_of_fragmented_plans_round_trips():
    """The CPU path (unchanged by staging) still moves fragmented plans exactly, both ways."""
    cache = _cache(dtype=torch.float64)
    cache.device_cache.copy_(torch.randn(cache.device_cache.shape, dtype=torch.float64))
    ids = [0, 2, 4, 6, 8, 10, 12]
    original = cache.device_cache[ids].clone()
    cache.execute(MigrationPlan(0, "r", TO_HOST, tuple((b, i) for i, b in enumerate(ids))))
    cache.device_cache.zero_()
    back = [23, 1, 21, 3, 19, 5, 17]
    cache.execute(MigrationPlan(1, "r", TO_GPU, tuple((i, b) for i, b in enumerate(back))))
    assert torch.equal(cache.device_cache[back], original)


# -------------------------------------------------------------------------------------------- fence ordering
class _RecordingFence:
    def __init__(self, fence, direction, log):
        self.fence, self.direction, self.log = fence, direction, log

    def wait(self):
        self.fence.wait()

    def done(self):
        return self.fence.done()

    def order_before(self, stream):
        self.log.append(self.direction)
        self.fence.order_before(stream)


def test_only_resume_fences_order_the_forward(make_engine, monkeypatch):
    """The forward waits for copies into the GPU tier only; offloads (device to host) are waited for after it."""
    engine = make_engine(gpu_blocks=10, host_blocks=12, block_size=4, max_num_tokens=64, prefill_chunk_size=16)
    log: list[str] = []
    execute = engine.cache.execute
    monkeypatch.setattr(engine.cache, "execute", lambda plan: _RecordingFence(execute(plan), plan.direction, log))
    for i in range(6):
        engine.add_request([(7 * i + j) % 500 for j in range(10)], 14)
    engine.run()
    assert engine.totals.suspensions > 0 and engine.totals.events["resume"] > 0
    assert log and set(log) == {TO_GPU} and len(log) == engine.totals.events["resume"]


# ---------------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_of_large_low_precision_input_is_not_zero(dtype):
    """Squaring 300 overflows float16 (65504): the norm is computed in float32, as Hugging Face does."""
    norm = RMSNorm(64, 1e-6).to(dtype)
    x = torch.full((3, 64), 300.0) * torch.linspace(0.5, 1.5, 64)
    out = norm(x.to(dtype))
    expected = RMSNorm(64, 1e-6)(x)
    assert out.dtype == dtype and torch.isfinite(out).all() and out.abs().min() > 0.1
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------- the per-dtype rule
def _near_tie(model, rng, want_gap_below: float):
    """(prompt, greedy reference, position, runner-up token, top-2 gap) of a position of `model` whose gap is
    below `want_gap_below` (searched over seeded prompts)."""
    best = None
    for _ in range(40):
        prompt = [rng.randrange(512) for _ in range(rng.randint(4, 12))]
        logits = model.forward_dense(prompt)[-1].double()
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        if best is None or gap < best[-1]:
            best = (prompt, [int(top.indices[0])], 0, int(top.indices[1]), gap)
        if gap < want_gap_below:
            break
    return best


def test_compare_outputs_accepts_only_near_ties_within_the_tolerance(tiny_model):
    prompt, ref, _, runner_up, gap = _near_tie(tiny_model, random.Random(1), 0.05)
    diverged = [runner_up]
    near = compare_outputs(tiny_model, [Compared("a", diverged, ref, prompt)], tolerance=gap * 1.01)
    assert near.ok and [(d.request_id, d.position, d.token) for d in near.accepted] == [("a", 0, runner_up)]
    assert near.accepted[0].gap == pytest.approx(gap)
    far = compare_outputs(tiny_model, [Compared("a", diverged, ref, prompt)], tolerance=gap * 0.99)
    assert not far.ok and "a" in far.mismatches
    sampled = compare_outputs(tiny_model, [Compared("a", diverged, ref, prompt, greedy=False)], tolerance=1e9)
    assert not sampled.ok  # only greedy divergences can be accepted
    assert GAP_TOLERANCE[torch.float64] == 0.0 and GAP_TOLERANCE[torch.float32] == 0.0
    exact = compare_outputs(tiny_model, [Compared("a", diverged, ref, prompt)])  # float64: exact, no exception
    assert not exact.ok


def test_compare_outputs_prefixes_and_lengths(tiny_model):
    ok = compare_outputs(
        tiny_model, [Compared("c", [1, 2], [1, 2, 3], [5], partial=True), Compared("f", [1, 2, 3], [1, 2, 3], [5])]
    )
    assert ok.ok and ok.compared == 2 and not ok.accepted
    short = compare_outputs(tiny_model, [Compared("f", [1, 2], [1, 2, 3], [5])])
    assert short.mismatches == {"f": ([1, 2], [1, 2, 3])}


def test_demo_in_bfloat16_passes_by_the_rule_and_reports(capsys, tmp_path):
    """`kvstate demo --dtype bfloat16` compares by the per-dtype rule: it passes, and says how many outputs
    diverged at a near-tie when some did."""
    from kvstate.cli import main

    code = main(
        ["demo", "--device", "cpu", "--dtype", "bfloat16", "--requests", "16", "--trace", str(tmp_path / "t.ndjson")]
    )
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "(bfloat16)" in out


# -------------------------------------------------------------------------------------------- scripts/gpu-check
def _load_gpu_check():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(GPU_CHECK))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def test_gpu_check_pieces_import():
    module = _load_gpu_check()
    assert set(module.CHECKS) >= {"pytest -m cuda", "host syncs per decode step"}
    assert {
        "kvstate demo --device cuda, each offload policy",
        "copy stream delayed; control without offload fences, each policy",
    } <= set(module.CHECKS)
    assert module.DTYPES == ("float64", "float32", "bfloat16", "float16")
    assert module.OFFLOADS == ("on_demand", "eager")
    assert callable(module.pressured_run) and callable(module.count_syncs)
    import kvstate.cli  # noqa: F401 - what its subprocesses run


def test_gpu_check_pressured_run_works_on_the_cpu():
    """The ordering checks' workload, on the CPU (copies are synchronous there, so even the controls pass): it
    offloads and resumes requests under each offload policy and every output satisfies the rule; on CUDA the
    controls must fail instead."""
    module = _load_gpu_check()
    run = module.pressured_run(delay_cycles=0, fence_resumes=False, device="cpu")
    assert run.bad == 0 and run.resumes > 0 and run.compared == 24
    for offload in module.OFFLOADS:
        control = module.pressured_run(delay_cycles=0, fence_offloads=False, offload=offload, device="cpu")
        assert control.bad == 0 and control.offloads > 0 and control.blocks_offloaded >= control.offloads


def test_gpu_check_reads_the_demo_summary_rows(capsys):
    """The offload check reads what each policy copied from the demo's printed summary (`summary_rows`)."""
    from kvstate.cli import main

    module = _load_gpu_check()
    assert main(["demo", "--device", "cpu", "--requests", "8", "--offload", "eager"]) == 0
    rows = module.summary_rows(capsys.readouterr().out)
    assert rows["offload policy"] == "eager" and set(module.COPY_ROWS) <= set(rows)
    assert rows["resumes without a copy"].startswith("0 of ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_cleanly_without_cuda():
    done = subprocess.run([sys.executable, str(GPU_CHECK)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == _load_gpu_check().NO_CUDA == 3
    assert "no CUDA device" in done.stdout and "nothing was checked" in done.stdout
    assert done.stdout.count("\n") == 1 and not done.stderr
