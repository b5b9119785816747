"""Pipeline parallelism on `torch.distributed`: N stages, each a contiguous slice of the layers with a paged KV
cache for those layers only; rank 0 owns the scheduler and broadcasts each output as request ids; consensus
before a recompute-pause reset (spec §9.1); host-tier fallback agreed across ranks (spec §9.2).

Several micro-batches are in flight (`PipelineConfig.micro_batches`, default one per stage; 1 = lockstep); a request
recompute-paused while its decode step is in flight may finish while it awaits consensus. Launch with
`run_pipeline(config, requests, world_size)` (spawns local processes) or
`torchrun --nproc-per-node N -m executor.pipeline ...`.
"""

from executor.pipeline.config import PipelineConfig, PipelineConfigError, PipelineRequest, stage_layers
from executor.pipeline.consensus import ConsensusBook, PauseRecord
from executor.pipeline.devices import DeviceAssignment, assign_devices, rank_cores
from executor.pipeline.hosttier import HostTierDecision, agree_host_tier
from executor.pipeline.launch import PipelineResult, RankFailed, RankLost, run_pipeline, torchrun_main
from executor.pipeline.protocol import MirrorBook, MirrorDiverged
from executor.pipeline.runtime import PipelineFailed, RankResult, run_rank
from executor.pipeline.stage import StageCache, StageModel

__all__ = [
    "ConsensusBook",
    "DeviceAssignment",
    "HostTierDecision",
    "MirrorBook",
    "MirrorDiverged",
    "PauseRecord",
    "PipelineConfig",
    "PipelineConfigError",
    "PipelineFailed",
    "PipelineRequest",
    "PipelineResult",
    "RankFailed",
    "RankLost",
    "RankResult",
    "StageCache",
    "StageModel",
    "agree_host_tier",
    "assign_devices",
    "rank_cores",
    "run_pipeline",
    "run_rank",
    "stage_layers",
    "torchrun_main",
]
