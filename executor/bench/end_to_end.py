"""End to end on the real executor: decode speed against `transformers`, and the value of the host tier.

* The `transformers` group: decode tokens/s of `executor.Engine` beside `transformers.LlamaForCausalLM.generate`
  at batch 1, 8, 32 and 64, on the same weights (the default model written as a Hugging Face checkpoint with
  `executor.save_hf_llama`), the same batch of equal-length prompts, float32, greedy, one intra-op thread; the
  greedy outputs of both are compared per request. Decode time starts after the step that
  prefills and samples the first token (for `generate`: at the first logits-processor call) and ends with
  the last token, so both rates are (batch x (new tokens - 1)) / decode seconds; on the CPU the seconds are
  this thread's CPU time.
* Tokens/s and tokens recomputed on one pressured workload (the demo's shape) with host tiers of 0, a few
  and enough blocks for every victim: what suspension saves over recompute-pause.
* Tokens/s of the engine on the demo's workload with the lifecycle fired through the `transitions` machine (the
  default) beside the compiled table, under pressure and with a GPU tier large enough for every request.
torch and transformers are imported inside the run functions.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from executor.bench.results import Row, Section
from executor.bench.timing import interleaved, median
from kvstate.config import SchedulerConfig
from kvstate.pool import ceil_div

HOST_SIZES = {"none": 0, "small": 8, "large": 256}


@dataclass(frozen=True)
class DecodeShape:
    """What the `transformers` group decodes: batch sizes, equal prompt lengths, new tokens, interleaved repeats."""

    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    repeats: int


FULL_DECODE = DecodeShape(batches=(1, 8, 32, 64), prompt_len=32, new_tokens=64, repeats=5)
QUICK_DECODE = DecodeShape(batches=(1, 8), prompt_len=16, new_tokens=16, repeats=2)
DECODE_RATIO_TARGET = 1.15  # the engine's decode tokens/s >= 1.15x generate, outputs equal
NOT_INSTALLED = "transformers generate: not installed (pip install '.[test]')"


def decode_section(
    *, shape: DecodeShape = FULL_DECODE, device: str = "cpu", seed: int = 0, lifecycle: str = "machine", progress=None
) -> Section:
    """Decode tokens/s of the engine beside `generate` at every batch size, greedy outputs compared; without
    transformers the engine is still measured and the rows say "not installed". `data["per_batch"]` also holds the
    engine's decode step and its part outside the forward pass (`step_share_section`)."""
    batches, prompt_len, new_tokens = shape.batches, shape.prompt_len, shape.new_tokens
    model, hf, peer, missing = models(device, seed)
    dev = model.device
    section = Section(
        "decode",
        data={
            "batches": list(batches),
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "repeats": shape.repeats,
            "peer": peer,
            "missing": missing,
            "device": dev.type,
            "per_batch": {},
        },
    )
    rng = random.Random(seed)
    for n, batch in enumerate(batches, 1):
        if progress is not None:
            progress(f"batch {batch} ({n}/{len(batches)})")
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
        seconds, outputs = _decode_runs(
            model, hf, prompts, new_tokens=new_tokens, repeats=shape.repeats, dev=dev, seed=seed, lifecycle=lifecycle
        )
        tokens = batch * (new_tokens - 1)
        ours = tokens / median(seconds["engine"][1:])  # the first call of each was the warmup
        theirs = tokens / median(seconds["transformers"][1:]) if hf is not None else None
        agree = (
            sum(a == b for a, b in zip(outputs["engine"], outputs["transformers"], strict=True))
            if hf is not None
            else None
        )
        steps = new_tokens - 1
        step_us = median(seconds["engine"][1:]) / steps * 1e6
        outside_us = (
            median([a - b for a, b in zip(seconds["engine"], seconds["forward"], strict=True)][1:]) / steps * 1e6
        )
        section.data["per_batch"][batch] = {
            "engine": ours,
            "transformers": theirs,
            "outputs_equal": agree,
            "step_us": step_us,
            "outside_forward_us": outside_us,
        }
        met = None if theirs is None else ours / theirs >= DECODE_RATIO_TARGET and agree == batch
        section.rows.append(
            Row(
                group="transformers",
                name=f"decode tokens/s, batch {batch}, {prompt_len}+{new_tokens} tokens, float32",
                value=ours,
                unit="tok/s",
                baseline_name=peer,
                baseline=theirs,
                target=f"ratio >= {DECODE_RATIO_TARGET}, outputs equal",
                met=met,
                note="no peer to compare outputs with"
                if agree is None
                else f"greedy outputs equal for {agree}/{batch}",
            )
        )
    if hf is not None:
        section.data["attn_implementation"] = hf.config._attn_implementation
    return section


def step_share_section(decode: Section) -> Section:
    """Per batch of a `decode_section`: the engine's decode step outside the forward pass
    (`LlamaModel.forward_paged`) against the whole step, i.e. the share of its fixed cost (scheduling, batch
    planning, sampling, completion). Only on the CPU: on CUDA the forward's kernels run asynchronously, so the
    time spent in it is not what its calls take."""
    section = Section("decode_step", data={"device": decode.data["device"]})
    if decode.data["device"] != "cpu":
        return section
    for batch, figures in decode.data["per_batch"].items():
        section.rows.append(
            Row(
                group="transformers",
                name=f"engine decode step outside the forward pass, batch {batch}",
                value=figures["outside_forward_us"],
                unit="µs",
                baseline_name="the whole decode step",
                baseline=figures["step_us"],
                better="lower",
                note="schedule, batch planning, sampling, completion: the ratio is their share of the step",
            )
        )
    return section


def models(device: str, seed: int):
    """(the engine's default model in float32 on `device`, the same weights as transformers'
    `LlamaForCausalLM` or None, the peer's name, why it is missing or None)."""
    import torch

    from executor import LlamaModel, ModelConfig, save_hf_llama

    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    try:
        import transformers
    except ImportError as err:
        return model, None, NOT_INSTALLED, str(err)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as checkpoint:
        save_hf_llama(model, checkpoint)
        hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        # typeshed's functools.wraps types the wrapped method `PreTrainedModel.to` unbound (self first)
        hf = hf.to(dev).eval()  # type: ignore[arg-type]
    return model, hf, f"transformers {transformers.__version__} generate", None


def _decode_runs(
    model, hf, prompts, *, new_tokens, repeats, dev, seed, lifecycle
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Decode seconds of every run of the engine and of `generate` (`hf`, None: not installed), interleaved,
    and the outputs of their last runs."""
    from executor import Engine, EngineConfig

    batch, prompt_len = len(prompts), len(prompts[0])
    # On the CPU, this thread's CPU time (torch runs single-threaded here): the machines are shared, and wall time
    # under contention would measure the neighbours. On CUDA the kernels run elsewhere: wall time, synchronized.
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    seconds: dict[str, list[float]] = {"engine": [], "forward": [], "transformers": []}
    outputs: dict[str, list[list[int]]] = {}
    forward = model.forward_paged

    def timed_forward(*args):  # the engine's forward passes, timed (the rest of a step is its fixed cost)
        start = clock()
        try:
            return forward(*args)
        finally:
            seconds["forward"][-1] += clock() - start

    def engine_run() -> None:
        blocks = batch * ceil_div(prompt_len + new_tokens, 16)
        scheduler = SchedulerConfig(
            gpu_blocks=blocks,
            block_size=16,
            max_batch_size=batch,
            max_num_tokens=batch * prompt_len,
            prefill_chunk_size=prompt_len,
            lifecycle=lifecycle,
        )
        config = EngineConfig(scheduler=scheduler, device=dev.type, dtype="float32", seed=seed)
        with Engine(config, model=model) as engine:
            ids = [engine.add_request(p, new_tokens) for p in prompts]
            engine.step()  # prefill and the first token of every request
            seconds["forward"].append(0.0)
            model.forward_paged = timed_forward  # this instance only, for the decode steps
            try:
                start = clock()
                out = engine.run()
                seconds["engine"].append(clock() - start)
            finally:
                del model.forward_paged
        outputs["engine"] = [out[i] for i in ids]

    variants = {"engine": engine_run}
    if hf is not None:
        variants["transformers"] = _generate_run(hf, prompts, new_tokens, dev, clock, (seconds, outputs))
    interleaved(variants, repeats=repeats, warmup=1, seed=seed)
    return seconds, outputs


def _generate_run(hf, prompts, new_tokens, dev, clock, kept) -> Callable[[], None]:
    """One timed run of `generate` on `hf` (decode time from its first logits on), appending to `seconds` and
    keeping its tokens in `outputs` (`kept`: the two), as `_decode_runs` times the engine."""
    import torch
    import transformers

    seconds, outputs = kept
    prompt_len = len(prompts[0])

    class _Clock(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.first: float | None = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = clock()
            return scores

    def hf_run() -> None:
        first_logits = _Clock()
        ids = torch.tensor(prompts, device=dev)
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                logits_processor=transformers.LogitsProcessorList([first_logits]),
            )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if first_logits.first is None:
            raise RuntimeError("generate() never called its logits processor: no decode time to measure")
        seconds["transformers"].append(clock() - first_logits.first)
        outputs["transformers"] = out[:, prompt_len:].tolist()

    return hf_run


def host_tier_section(*, quick: bool, device: str = "cpu", seed: int = 0, lifecycle: str = "machine") -> Section:
    import torch

    from executor import LlamaModel, ModelConfig
    from executor.checks import random_workload

    requests, repeats = (16, 1) if quick else (48, 3)
    gpu_blocks, block_size = 32, 8
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    work = random_workload(
        requests, seed, (8, 96), (8, 64), vocab=model.config.vocab_size, max_tokens=gpu_blocks * block_size
    )
    results: dict[str, list[dict]] = {name: [] for name in HOST_SIZES}

    def variant(name: str):
        def call() -> None:
            t, wall = _timed_run(
                model,
                work,
                gpu_blocks=gpu_blocks,
                host_blocks=HOST_SIZES[name],
                block_size=block_size,
                lifecycle=lifecycle,
                seed=seed,
            )
            results[name].append(
                {
                    "wall": wall,
                    "generated": t.generated_tokens,
                    "recomputed": t.recomputed_tokens,
                    "suspensions": t.suspensions,
                    "recompute_pauses": t.recompute_pauses,
                    "steps": t.steps,
                    "blocks_migrated": t.blocks_migrated,
                    "blocks_offloaded": t.blocks_offloaded,
                    "resumes": t.events["resume"],
                    "resumed_without_copy": t.resumed_without_copy,
                }
            )

        return call

    interleaved({name: variant(name) for name in HOST_SIZES}, repeats=repeats, warmup=0, seed=seed)
    summary = {}
    for name, runs in results.items():
        wall = median([r["wall"] for r in runs])
        summary[name] = {**runs[-1], "wall": wall, "tokens_per_s": runs[-1]["generated"] / wall}
    section = Section(
        "host_tier",
        data={
            "requests": requests,
            "gpu_blocks": gpu_blocks,
            "block_size": block_size,
            "host_blocks": HOST_SIZES,
            "runs": summary,
        },
    )
    _add_host_tier_rows(section, summary)
    return section


def _timed_run(model, work: list, *, gpu_blocks: int, host_blocks: int, block_size: int, lifecycle: str, seed: int):
    """One engine (float32, on `model`'s device, chunks of 64 tokens, 256 tokens a pass) runs `work` to the end;
    returns its totals and the wall time of `run()` alone (submission left out)."""
    from executor import Engine, EngineConfig

    scheduler = SchedulerConfig(
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        block_size=block_size,
        prefill_chunk_size=64,
        max_num_tokens=256,
        lifecycle=lifecycle,
    )
    device = next(model.parameters()).device.type
    with Engine(EngineConfig(scheduler=scheduler, device=device, dtype="float32", seed=seed), model=model) as engine:
        for prompt, new in work:
            engine.add_request(prompt, new)
        start = time.perf_counter()
        engine.run()
        wall = time.perf_counter() - start
    return engine.totals, wall


def _add_host_tier_rows(section: Section, summary: dict[str, dict]) -> None:
    """One throughput row and one recomputation row per host-tier size, against the run without a host tier."""
    base = summary["none"]
    for name in ("small", "large"):
        s = summary[name]
        section.rows.append(
            Row(
                group="end-to-end",
                name=f"host tier {HOST_SIZES[name]} blocks: tokens/s",
                value=s["tokens_per_s"],
                unit="tok/s",
                baseline_name="no host tier (recompute only)",
                baseline=base["tokens_per_s"],
                note=(
                    f"{s['suspensions']} suspends, {s['recompute_pauses']} recompute-pauses; "
                    f"{s['blocks_offloaded']} blocks offloaded, {s['resumed_without_copy']} of {s['resumes']} "
                    "resumes without a copy"
                ),
            )
        )
        section.rows.append(
            Row(
                group="end-to-end",
                name=f"host tier {HOST_SIZES[name]} blocks: tokens recomputed",
                value=s["recomputed"],
                unit="tokens",
                baseline_name="no host tier (recompute only)",
                baseline=base["recomputed"],
                better="lower",
                note=f"baseline: {base['recompute_pauses']} recompute-pauses",
            )
        )


def lifecycle_section(*, quick: bool, device: str = "cpu", seed: int = 0) -> Section:
    import torch

    from executor import LlamaModel, ModelConfig
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, random_workload

    requests, repeats = (16, 2) if quick else (48, 9)  # runs vary by +-30% here: many interleaved repeats
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    regimes = {"pressure": (32, 16), "steady": (requests * 20, 0)}  # (gpu blocks of 8 tokens, host blocks)
    work = random_workload(
        requests, seed, DEMO_PROMPT_LEN, DEMO_MAX_NEW_TOKENS, vocab=model.config.vocab_size, max_tokens=32 * 8
    )
    rates: dict[str, list[float]] = {}

    def variant(regime: str, lifecycle: str):
        def call() -> None:
            gpu, host = regimes[regime]
            totals, wall = _timed_run(
                model, work, gpu_blocks=gpu, host_blocks=host, block_size=8, lifecycle=lifecycle, seed=seed
            )
            rates.setdefault(f"{regime} {lifecycle}", []).append(totals.generated_tokens / wall)

        return call

    variants = {f"{r} {k}": variant(r, k) for r in regimes for k in ("machine", "compiled")}
    interleaved(variants, repeats=repeats, warmup=1, seed=seed)
    rates = {name: values[1:] for name, values in rates.items()}  # the first run of each was the warmup
    tokens_per_s = {name: median(values) for name, values in rates.items()}
    section = Section("lifecycle_engine", data={"requests": requests, "tokens_per_s": tokens_per_s})
    for regime in regimes:
        machine, compiled = tokens_per_s[f"{regime} machine"], tokens_per_s[f"{regime} compiled"]
        section.rows.append(
            Row(
                group="end-to-end",
                name=f"engine tokens/s, demo workload, {regime}: transitions machine (default)",
                value=machine,
                unit="tok/s",
                baseline_name="compiled table",
                baseline=compiled,
                target="ratio >= 0.97",
                met=machine / compiled >= 0.97,
            )
        )
    return section


def run(*, quick: bool = False, device: str = "cpu", seed: int = 0, lifecycle: str = "machine") -> list[Section]:
    return [host_tier_section(quick=quick, device=device, seed=seed, lifecycle=lifecycle)]
