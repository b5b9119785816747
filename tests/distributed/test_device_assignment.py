"""Which device and backend every pipeline rank uses (`executor.pipeline.assign_devices`), tested on the CPU: NCCL
never gets two ranks on one GPU (it would fail at the first collective with a duplicate-GPU error), so that is
refused up front with the fix. Not marked `distributed`: pure functions, run by default."""

from __future__ import annotations

import itertools

import pytest

from executor import EngineConfig
from executor.pipeline import PipelineConfig, PipelineConfigError, assign_devices, rank_cores, run_pipeline


def test_the_cpu_runs_gloo_on_every_rank():
    for device in ("cpu", "auto"):
        assignment = assign_devices(device, "auto", 3, cuda_count=0)
        assert assignment.backend == "gloo" and assignment.devices == ("cpu", "cpu", "cpu")
    with pytest.raises(PipelineConfigError, match=r"nccl.*needs CUDA"):
        assign_devices("cpu", "nccl", 2, cuda_count=4)


def test_cuda_puts_local_rank_r_on_gpu_r_mod_count_with_nccl():
    assignment = assign_devices("auto", "auto", 2, cuda_count=2)
    assert assignment.backend == "nccl" and assignment.devices == ("cuda:0", "cuda:1")
    assert assign_devices("cuda", "auto", 3, cuda_count=4).devices == ("cuda:0", "cuda:1", "cuda:2")
    assert assign_devices("cuda", "gloo", 2, cuda_count=2).backend == "gloo"
    assert assign_devices("cuda:1", "auto", 1, cuda_count=2).devices == ("cuda:1",)


@pytest.mark.parametrize(("device", "stages", "gpus"), [("auto", 2, 1), ("cuda", 3, 2), ("cuda:0", 2, 4)])
def test_two_ranks_on_one_gpu_are_refused_with_the_fix(device, stages, gpus):
    with pytest.raises(PipelineConfigError, match=r"two ranks on one GPU.*duplicate GPU.*use device 'cpu'"):
        assign_devices(device, "auto", stages, cuda_count=gpus)


def test_cuda_without_a_gpu_or_an_unknown_device_is_refused():
    with pytest.raises(PipelineConfigError, match="no CUDA device is visible"):
        assign_devices("cuda", "auto", 2, cuda_count=0)
    with pytest.raises(PipelineConfigError, match=r"cuda:3.*not visible"):
        assign_devices("cuda:3", "auto", 1, cuda_count=2)
    with pytest.raises(PipelineConfigError, match="device must be"):
        assign_devices("tpu", "auto", 1, cuda_count=0)


def test_run_pipeline_refuses_before_any_rank_starts(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = PipelineConfig(engine=EngineConfig(device="auto"))
    with pytest.raises(PipelineConfigError, match="two ranks on one GPU"):
        run_pipeline(config, [([1, 2, 3], 2)], world_size=2)


def test_micro_batches_default_to_one_per_stage_and_one_means_lockstep():
    assert PipelineConfig().micro_batches_for(3) == 3 and PipelineConfig().micro_batches_for(1) == 1
    assert PipelineConfig(micro_batches=1).micro_batches_for(2) == 1
    with pytest.raises(PipelineConfigError, match="micro_batches"):
        PipelineConfig(micro_batches=0)


def test_the_demo_refuses_micro_batch_options_without_pipeline_stages(capsys):
    from kvstate.cli import main

    for option in (["--micro-batches", "2"], ["--compare-lockstep"]):
        assert main(["demo", "--device", "cpu", *option]) == 2
        assert "apply to pipeline stages only; add --pp N" in capsys.readouterr().err


def test_the_pipeline_demo_defaults_to_a_workload_with_full_micro_batches_unless_told_otherwise():
    from executor.commands.demo import DEFAULTS, PP_DEFAULTS, check_args
    from kvstate.cli import parse

    def filled(*argv: str) -> tuple[int, int]:
        args = parse(["demo", "--device", "cpu", *argv])
        check_args(args)
        return args.requests, args.gpu_blocks

    single, pipeline = filled(), filled("--pp", "2")
    assert single == (DEFAULTS["requests"], DEFAULTS["gpu_blocks"])  # the single-process demo is unchanged
    assert pipeline == (PP_DEFAULTS["requests"], PP_DEFAULTS["gpu_blocks"])
    assert pipeline[0] > single[0] and pipeline[1] > single[1]  # more requests at once than the single process
    assert filled("--pp", "2", "--requests", "6", "--gpu-blocks", "12") == (6, 12)  # given flags win


def test_the_pipeline_demo_defaults_to_a_wider_model_unless_told_otherwise():
    from executor.checks import demo_model
    from executor.commands.demo import DEFAULTS, PP_DEFAULTS, check_args
    from executor.model import ModelConfig
    from kvstate.cli import parse

    def width(*argv: str) -> int:
        args = parse(["demo", "--device", "cpu", *argv])
        check_args(args)
        return args.hidden_size

    assert width() == DEFAULTS["hidden_size"] and demo_model(width()) == ModelConfig()  # the single process: as before
    assert width("--pp", "2") == PP_DEFAULTS["hidden_size"] > DEFAULTS["hidden_size"]
    assert width("--pp", "2", "--hidden-size", "64") == 64  # given flags win
    wide = demo_model(PP_DEFAULTS["hidden_size"])
    assert (wide.head_dim * wide.num_heads, wide.intermediate_size) == (wide.hidden_size, 2 * wide.hidden_size)
    assert wide.num_layers == ModelConfig().num_layers  # so --pp accepts the same stage counts


@pytest.mark.parametrize("width", [0, -8, 12, 7])
def test_a_demo_model_width_that_is_not_a_positive_multiple_of_8_is_refused(width):
    from executor.checks import demo_model

    with pytest.raises(ValueError, match="multiple of 8"):
        demo_model(width)


@pytest.mark.parametrize(("world", "cores"), [(2, [0, 1]), (2, [3, 1, 2, 0, 5]), (3, [4, 6, 8]), (1, [0, 1])])
def test_every_rank_gets_its_own_cores_and_all_cores_are_used(world, cores):
    shares = [rank_cores(rank, world, cores) for rank in range(world)]
    assert all(shares)
    assert set().union(*shares) == set(cores) and sum(len(s) for s in shares) == len(cores)  # disjoint, cover all
    assert all(max(a) < min(b) for a, b in itertools.pairwise(shares))  # contiguous shares, in rank order


def test_fewer_cores_than_ranks_leaves_the_affinity_alone():
    assert rank_cores(0, 3, [0, 1]) is None and rank_cores(2, 3, {7}) is None
