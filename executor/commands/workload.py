"""The counts of a demo workload, shared by `kvstate demo` and `python -m executor.pipeline`: the same option
names, types, bounds (`kvstate.commands.args`) and help, as `(flag, argparse type, help)`; the pipeline demo reads
them back by name (`executor.pipeline.demo.workload_options`). `WORKLOAD_DEFAULTS` is the single-process demo's
workload; `python -m executor.pipeline` runs fewer requests. `add_offload_option` is the `--offload` option of the
commands that run the engine (the spec's offload policy, `executor.offload_spec`)."""

from __future__ import annotations

import argparse

from kvstate.commands.args import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_HIDDEN_SIZE,
    MAX_REQUESTS,
    MAX_SEED,
    MAX_TOKENS,
    BoundedInt,
    non_negative_int,
    positive_int,
    positive_multiple_of,
)

WORKLOAD_COUNTS = (
    ("--requests", BoundedInt(1, MAX_REQUESTS, "positive", "--requests"), "number of requests"),
    ("--gpu-blocks", positive_int(maximum=MAX_BLOCKS), "GPU tier blocks"),
    ("--host-blocks", non_negative_int(maximum=MAX_BLOCKS), "host tier blocks, 0 = no host tier"),
    ("--block-size", positive_int(maximum=MAX_BLOCK_SIZE), "tokens per block"),
    ("--chunk-size", positive_int(maximum=MAX_TOKENS), "prefill chunk size in tokens"),
    (
        "--hidden-size",
        positive_multiple_of(8, maximum=MAX_HIDDEN_SIZE),
        "the model's width (seeded weights)",
    ),
    ("--seed", non_negative_int(maximum=MAX_SEED), "workload, weights and sampling seed"),
)


WORKLOAD_DEFAULTS = {
    "requests": 48,
    "gpu_blocks": 32,
    "host_blocks": 16,
    "block_size": 8,
    "chunk_size": 64,
    "hidden_size": 64,
    "seed": 0,
}


def option_key(flag: str) -> str:
    """The attribute argparse stores `flag` under (``--gpu-blocks`` -> ``gpu_blocks``)."""
    return flag[2:].replace("-", "_")


def add_offload_option(parser: argparse.ArgumentParser) -> None:
    """`--offload {on_demand,eager}`: run a copy of the spec with this offload policy (default: the spec's own)."""
    from kvstate.policy import VOCABULARY

    parser.add_argument(
        "--offload",
        choices=tuple(VOCABULARY["offload"]),
        default=None,
        help=(
            "the spec's offload policy to run: on_demand moves a suspended request's held blocks to the host "
            "tier only when an allocation needs the GPU room, eager moves all of them when it is suspended "
            "(default: the spec's own, on_demand)"
        ),
    )
