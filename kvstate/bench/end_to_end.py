"""End to end on the real executor: decode speed against `transformers`, and the value of the host tier.

* Decode tokens/s of `executor.Engine` beside `transformers.LlamaForCausalLM.generate` on the same weights
  (our tiny model written as a Hugging Face checkpoint with `executor.save_hf_llama`), the same batch of
  equal-length prompts, the same dtype, greedy, one intra-op thread. Decode time starts after the step that
  prefills and samples the first token (for `generate`: at the first logits-processor call) and ends with
  the last token, so both rates are (batch x (new tokens - 1)) / decode seconds.
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

from kvstate.bench.results import Row, Section
from kvstate.bench.timing import interleaved, median

HOST_SIZES = {"none": 0, "small": 8, "large": 256}


def decode_section(*, quick: bool, device: str = "cpu", seed: int = 0, lifecycle: str = "machine") -> Section:
    import torch
    import transformers

    from executor import Engine, EngineConfig, LlamaModel, ModelConfig, save_hf_llama

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    batch, prompt_len, new_tokens, repeats = (4, 16, 16, 2) if quick else (8, 32, 64, 5)
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    with tempfile.TemporaryDirectory() as checkpoint:
        save_hf_llama(model, checkpoint)
        hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(dev).eval()
    rng = random.Random(seed)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    decode_seconds: dict[str, list[float]] = {"engine": [], "transformers": []}
    outputs: dict[str, list[list[int]]] = {}

    def engine_run() -> None:
        blocks = batch * -(-(prompt_len + new_tokens) // 16)
        config = EngineConfig(device=dev.type, dtype="float32", gpu_blocks=blocks, block_size=16,
                              max_batch_size=batch, max_num_tokens=batch * prompt_len, prefill_chunk_size=prompt_len,
                              lifecycle=lifecycle)
        with Engine(config, model=model) as engine:
            ids = [engine.add_request(p, new_tokens) for p in prompts]
            engine.step()  # prefill and the first token of every request
            start = time.perf_counter()
            out = engine.run()
            decode_seconds["engine"].append(time.perf_counter() - start)
        outputs["engine"] = [out[i] for i in ids]

    class _Clock(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.first: float | None = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    def hf_run() -> None:
        clock = _Clock()
        ids = torch.tensor(prompts, device=dev)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              logits_processor=transformers.LogitsProcessorList([clock]))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        decode_seconds["transformers"].append(time.perf_counter() - clock.first)
        outputs["transformers"] = out[:, prompt_len:].tolist()

    interleaved({"engine": engine_run, "transformers": hf_run}, repeats=repeats, warmup=1, seed=seed)
    tokens = batch * (new_tokens - 1)
    ours = tokens / median(decode_seconds["engine"][1:])  # the first call of each was the warmup
    theirs = tokens / median(decode_seconds["transformers"][1:])
    agree = sum(a == b for a, b in zip(outputs["engine"], outputs["transformers"]))
    row = Row(group="end-to-end", name=f"decode tokens/s, batch {batch}, {prompt_len}+{new_tokens} tokens, float32",
              value=ours, unit="tok/s", baseline_name=f"transformers {transformers.__version__} generate",
              baseline=theirs, target="ratio >= 1.0", met=ours / theirs >= 1.0,
              note=f"greedy outputs equal for {agree}/{batch}")
    return Section("decode", [row], {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                                     "tokens_per_s": {"engine": ours, "transformers": theirs},
                                     "attn_implementation": hf.config._attn_implementation,
                                     "outputs_equal": agree})


def host_tier_section(*, quick: bool, device: str = "cpu", seed: int = 0, lifecycle: str = "machine") -> Section:
    import torch

    from executor import Engine, EngineConfig, LlamaModel, ModelConfig
    from executor.checks import random_workload

    requests, repeats = (16, 1) if quick else (48, 3)
    gpu_blocks, block_size = 32, 8
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    work = random_workload(requests, seed, (8, 96), (8, 64), vocab=model.config.vocab_size,
                           max_tokens=gpu_blocks * block_size)
    results: dict[str, list[dict]] = {name: [] for name in HOST_SIZES}

    def variant(name: str):
        def call() -> None:
            config = EngineConfig(device=dev.type, dtype="float32", gpu_blocks=gpu_blocks, block_size=block_size,
                                  host_blocks=HOST_SIZES[name], prefill_chunk_size=64, max_num_tokens=256, seed=seed,
                                  lifecycle=lifecycle)
            with Engine(config, model=model) as engine:
                for prompt, new in work:
                    engine.add_request(prompt, new)
                start = time.perf_counter()
                engine.run()
                wall = time.perf_counter() - start
            t = engine.totals
            results[name].append({"wall": wall, "generated": t.generated_tokens, "recomputed": t.recomputed_tokens,
                                  "suspensions": t.suspensions, "recompute_pauses": t.recompute_pauses,
                                  "steps": t.steps, "blocks_migrated": t.blocks_migrated})
        return call

    interleaved({name: variant(name) for name in HOST_SIZES}, repeats=repeats, warmup=0, seed=seed)
    summary = {}
    for name, runs in results.items():
        wall = median([r["wall"] for r in runs])
        summary[name] = {**runs[-1], "wall": wall, "tokens_per_s": runs[-1]["generated"] / wall}
    base = summary["none"]
    section = Section("host_tier", data={"requests": requests, "gpu_blocks": gpu_blocks, "block_size": block_size,
                                         "host_blocks": HOST_SIZES, "runs": summary})
    for name in ("small", "large"):
        s = summary[name]
        section.rows.append(Row(group="end-to-end", name=f"host tier {HOST_SIZES[name]} blocks: tokens/s",
                                value=s["tokens_per_s"], unit="tok/s", baseline_name="no host tier (recompute only)",
                                baseline=base["tokens_per_s"],
                                note=f"{s['suspensions']} suspends, {s['recompute_pauses']} recompute-pauses"))
        section.rows.append(Row(group="end-to-end", name=f"host tier {HOST_SIZES[name]} blocks: tokens recomputed",
                                value=s["recomputed"], unit="tokens", baseline_name="no host tier (recompute only)",
                                baseline=base["recomputed"], better="lower",
                                note=f"baseline: {base['recompute_pauses']} recompute-pauses"))
    return section


def lifecycle_section(*, quick: bool, device: str = "cpu", seed: int = 0) -> Section:
    import torch

    from executor import Engine, EngineConfig, LlamaModel, ModelConfig
    from executor.checks import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT_LEN, random_workload

    requests, repeats = (16, 2) if quick else (48, 9)  # runs vary by +-30% here: many interleaved repeats
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_seed(ModelConfig(), seed, dtype=torch.float32, device=dev)
    regimes = {"pressure": (32, 16), "steady": (requests * 20, 0)}  # (gpu blocks of 8 tokens, host blocks)
    work = random_workload(requests, seed, DEMO_PROMPT_LEN, DEMO_MAX_NEW_TOKENS, vocab=model.config.vocab_size,
                           max_tokens=32 * 8)
    rates: dict[str, list[float]] = {}

    def variant(regime: str, lifecycle: str):
        def call() -> None:
            gpu, host = regimes[regime]
            config = EngineConfig(device=dev.type, dtype="float32", gpu_blocks=gpu, host_blocks=host, block_size=8,
                                  prefill_chunk_size=64, max_num_tokens=256, seed=seed, lifecycle=lifecycle)
            with Engine(config, model=model) as engine:
                for prompt, new in work:
                    engine.add_request(prompt, new)
                start = time.perf_counter()
                engine.run()
                rates.setdefault(f"{regime} {lifecycle}", []).append(
                    engine.totals.generated_tokens / (time.perf_counter() - start))
        return call

    variants = {f"{r} {k}": variant(r, k) for r in regimes for k in ("machine", "compiled")}
    interleaved(variants, repeats=repeats, warmup=1, seed=seed)
    rates = {name: values[1:] for name, values in rates.items()}  # the first run of each was the warmup
    tokens_per_s = {name: median(values) for name, values in rates.items()}
    section = Section("lifecycle_engine", data={"requests": requests, "tokens_per_s": tokens_per_s})
    for regime in regimes:
        machine, compiled = tokens_per_s[f"{regime} machine"], tokens_per_s[f"{regime} compiled"]
        section.rows.append(Row(group="end-to-end", name=f"engine tokens/s, demo workload, {regime}: transitions "
                                "machine (default)", value=machine, unit="tok/s", baseline_name="compiled table",
                                baseline=compiled, target="ratio >= 0.97", met=machine / compiled >= 0.97))
    return section


def run(*, quick: bool = False, device: str = "cpu", seed: int = 0, lifecycle: str = "machine") -> list[Section]:
    return [decode_section(quick=quick, device=device, seed=seed, lifecycle=lifecycle),
            host_tier_section(quick=quick, device=device, seed=seed, lifecycle=lifecycle)]
