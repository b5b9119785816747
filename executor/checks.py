"""Workloads and the checks every run must pass: output equivalence against the oracle, and no leaked block.

Used by `kvstate demo` and the tests. Every workload is seeded.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

from executor.engine import Engine
from executor.sampler import SamplingParams


DEMO_PROMPT_LEN = (8, 96)  # the demo workload's prompt lengths (single process and pipeline)
DEMO_MAX_NEW_TOKENS = (8, 64)


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB, one decimal above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def random_workload(count: int, seed: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int], *,
                    vocab: int = 512, max_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """`count` (prompt, max_new_tokens) pairs with lengths drawn uniformly from the inclusive ranges; with
    `max_tokens`, each pair is clipped so prompt + max_new_tokens <= max_tokens (it fits the GPU tier alone)."""
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        prompt, new = rng.randint(*prompt_len), rng.randint(*new_tokens)
        if max_tokens is not None and prompt + new > max_tokens:
            prompt = max(1, min(prompt, max_tokens // 2))
            new = max(1, max_tokens - prompt)
        work.append(([rng.randrange(vocab) for _ in range(prompt)], new))
    return work


def submit_all(engine: Engine, work: list[tuple[list[int], int]],
               sampling: SamplingParams | None = None) -> list[Hashable]:
    """Submit every pair of `work`; returns the request ids in order."""
    extra = {} if sampling is None else {"sampling": sampling}
    return [engine.add_request(prompt, new, **extra) for prompt, new in work]


def mismatches(engine: Engine,
               outputs: dict[Hashable, list[int]] | None = None) -> dict[Hashable, tuple[list[int], list[int]]]:
    """{id: (output, reference)} for every request that finished by budget or stop token and whose output
    differs from `Engine.reference` (cancelled and aborted requests are skipped: their output is partial)."""
    outputs = engine.outputs() if outputs is None else outputs
    finished = [rid for rid, r in engine.scheduler.finished.items() if r.done_reason == "finished"]
    references = engine.reference_outputs(finished)
    return {rid: (outputs.get(rid), ref) for rid, ref in references.items() if outputs.get(rid) != ref}


def leaked_blocks(engine: Engine) -> int:
    """Blocks of either tier not free once no request is active (0 after a clean run), plus in-flight copies."""
    usage = engine.scheduler.pool.usage()
    return (usage["gpu_capacity"] - usage["gpu_free"]) + (usage["host_capacity"] - usage["host_free"]) + \
        len(engine.scheduler.pool.in_flight)
