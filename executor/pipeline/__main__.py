"""`python -m executor.pipeline`: the pipeline demo, spawned locally or one rank per process under torchrun.

    python -m executor.pipeline --pp 2                      # spawns 2 local ranks (gloo on the CPU)
    torchrun --nproc-per-node 2 -m executor.pipeline ...    # one rank per process; rank 0 prints the summary

Exit status 1 if an output differs from its single-process reference or a block leaked.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from executor.commands.workload import WORKLOAD_COUNTS, WORKLOAD_DEFAULTS, add_offload_option, option_key
from executor.pipeline.config import MAX_TIMEOUT_S, MIN_TIMEOUT_S
from executor.pipeline.demo import DEMO_TIMEOUT_S
from kvstate.commands.args import MAX_STAGES, OptionParser, device_name, non_negative_int, positive_int, seconds
from kvstate.terminal import inert

DEFAULTS = {**WORKLOAD_DEFAULTS, "requests": 16}  # the demo's workload, with fewer requests


def _parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="python -m executor.pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--pp",
        type=positive_int(maximum=MAX_STAGES),
        default=2,
        help="stages to spawn without torchrun (default %(default)s)",
    )
    for flag, kind, text in WORKLOAD_COUNTS:
        p.add_argument(flag, type=kind, default=DEFAULTS[option_key(flag)], help=f"{text} (default %(default)s)")
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--trace", default=None, help="rank 0's trace file; rank r writes <stem>.rank<r><suffix>")
    add_offload_option(p)
    p.add_argument(
        "--fail-host-tier-on-rank",
        type=non_negative_int(maximum=MAX_STAGES - 1),
        action="append",
        default=[],
        help="force this rank's host-tier allocation to fail (repeatable; tests the fallback)",
    )
    p.add_argument(
        "--micro-batches",
        type=positive_int(maximum=MAX_STAGES),
        default=None,
        help="micro-batches in flight (default: one per stage; 1 = lockstep)",
    )
    p.add_argument(
        "--compare-lockstep",
        action="store_true",
        help="also run the workload in lockstep (--micro-batches 1) and print the tokens/s ratio",
    )
    p.add_argument(
        "--timeout",
        type=seconds(MIN_TIMEOUT_S, MAX_TIMEOUT_S),
        default=DEMO_TIMEOUT_S,
        help=f"bound of every wait on a peer rank, {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} s (default %(default)s)",
    )
    return p


def _print(summary) -> None:
    print(summary.header)
    print("state: peak final")
    for state, peak, final in summary.state_rows:
        print(f"  {state}: {peak} {final}")
    for metric, value in summary.summary_rows:
        print(f"  {metric}: {value}")
    if summary.comparison is not None:
        print(f"throughput: {summary.comparison}")
    for path, lines in summary.traces:
        print(inert(f"trace: {path} ({lines} transitions)"))
    verdict = "PASS" if not summary.differ else f"FAIL ({len(summary.differ)} differ: {list(summary.differ)[:10]})"
    print(f"OUTPUT EQUIVALENCE: {verdict}; leaked blocks: {summary.leaked_blocks}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun(args)
    from executor.pipeline.demo import run_pp_demo, workload_options
    from executor.pipeline.launch import RankFailed, RankLost

    try:
        summary = run_pp_demo(
            stages=args.pp,
            **workload_options(args),
            device=args.device,
            fail_host_tier_on_ranks=frozenset(args.fail_host_tier_on_rank),
            timeout_s=args.timeout,
            micro_batches=args.micro_batches,
            compare_lockstep=args.compare_lockstep,
        )
    except (RankLost, RankFailed) as err:
        print(inert(f"python -m executor.pipeline: error: {err}"), file=sys.stderr)
        return 2
    _print(summary)
    return summary.exit_code


def _torchrun(args: argparse.Namespace) -> int:
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, demo_engine_config, random_workload
    from executor.engine import Engine
    from executor.pipeline.config import PipelineConfig
    from executor.pipeline.demo import workload_options
    from executor.pipeline.launch import torchrun_main

    options = workload_options(args)
    requests = options.pop("requests")  # the rest configures the engine
    engine_config = demo_engine_config(**options, device=args.device)
    config = PipelineConfig(
        engine=engine_config,
        timeout_s=args.timeout,
        micro_batches=args.micro_batches,
        fail_host_tier_on_ranks=frozenset(args.fail_host_tier_on_rank),
    )
    work = random_workload(
        requests,
        args.seed,
        DEMO_PROMPT_LEN,
        DEMO_MAX_NEW_TOKENS,
        vocab=engine_config.model.vocab_size,
        max_tokens=args.gpu_blocks * args.block_size,
    )
    result = torchrun_main(config, work)
    print(
        f"rank {result.rank}: layers {list(result.layers)}, {result.iterations} iterations, host tier "
        f"{result.host_tier}, {len(result.trace)} trace lines"
    )
    if result.rank != 0:
        return 0
    oracle_config = replace(engine_config, trace_path=None, scheduler=replace(engine_config.scheduler, host_blocks=0))
    with Engine(oracle_config) as oracle:
        differ = [
            rid
            for rid, reason in result.done_reasons.items()
            if reason == "finished"
            and result.outputs[rid] != oracle.reference(work[rid][0], work[rid][1], request_id=rid)
        ]
    print(f"rank 0: {len(result.outputs)} requests, totals {result.totals}")
    print(
        f"OUTPUT EQUIVALENCE: {'PASS' if not differ else f'FAIL {differ[:10]}'}; leaked blocks: {result.leaked_blocks}"
    )
    return 0 if not differ and not result.leaked_blocks else 1


if __name__ == "__main__":
    sys.exit(main())
