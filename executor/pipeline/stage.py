"""One pipeline stage's share of the model and of the KV cache.

Every rank builds the same full weights from the seed (`LlamaModel.from_seed`) and keeps only its slice, so the
stages together compute exactly what the single-process model computes (OUT-EQUIV across the pipeline).

Invariants kept:
* stage s holds layers `stage_layers(L, N, s)` and a `PagedKVCache` with exactly those layers; the cache is
  addressed by the model's global layer index through `StageCache` (local index = global - first layer);
* block ids are the scheduler's (rank 0's pool): every stage stores block b's K/V for its layers in its own
  `device_cache[b]`, so every stage carries out the same migration plans on its own blocks;
* the first stage embeds tokens; the last stage applies the final norm and the LM head to the sampling rows only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.batch import PagedBatch
from executor.kv_cache import PagedKVCache
from executor.model import LlamaModel, RMSNorm, rotary_cos_sin
from executor.pipeline.config import stage_layers


class StageCache:
    """A `PagedKVCache` of a layer slice, seen through the model's global layer numbers."""

    def __init__(self, cache: PagedKVCache, first_layer: int) -> None:
        self.cache = cache
        self.first_layer = first_layer

    def _local(self, layer: int) -> int:
        local = layer - self.first_layer
        if not 0 <= local < self.cache.num_layers:
            raise IndexError(
                f"layer {layer} is not held by this stage (layers {self.first_layer}.."
                f"{self.first_layer + self.cache.num_layers - 1})"
            )
        return local

    def layer_keys(self, layer: int) -> torch.Tensor:
        return self.cache.layer_keys(self._local(layer))

    def layer_values(self, layer: int) -> torch.Tensor:
        return self.cache.layer_values(self._local(layer))


class StageModel(nn.Module):
    """The slice of a `LlamaModel` one stage runs: [embedding] + layers[begin:end] + [norm, LM head]."""

    def __init__(self, full: LlamaModel, stage: int, stages: int) -> None:
        super().__init__()
        self.config = full.config
        self.stage, self.stages = stage, stages
        self.layer_range = stage_layers(full.config.num_layers, stages, stage)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.layers = nn.ModuleList(full.layers[i] for i in self.layer_range)
        tied = full.config.tie_word_embeddings
        self.embed_tokens: nn.Embedding | None = full.embed_tokens if self.is_first or (self.is_last and tied) else None
        self.norm: RMSNorm | None = full.norm if self.is_last else None
        self.lm_head: nn.Linear | None = full.lm_head if self.is_last else None
        self.requires_grad_(False)

    @classmethod
    def from_seed(
        cls, config, seed: int, stage: int, stages: int, *, dtype: torch.dtype, device: torch.device
    ) -> StageModel:
        """Build the full seeded model on the CPU, keep this stage's slice, move only that to `device`."""
        full = LlamaModel.from_seed(config, seed, dtype=dtype, device="cpu")
        return cls(full, stage, stages).to(device).eval()

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.get_parameter("layers.0.input_layernorm.weight").dtype

    def make_cache(self, gpu_blocks: int, block_size: int, device: torch.device) -> PagedKVCache:
        """A paged cache of `gpu_blocks` blocks holding only this stage's layers."""
        return PagedKVCache.for_model(
            self, gpu_blocks, block_size=block_size, device=device, num_layers=len(self.layer_range)
        )

    @torch.inference_mode()
    def forward_stage(self, batch: PagedBatch, cache: StageCache, hidden: torch.Tensor | None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for the next stage, or, on the last stage, logits of the sampling rows.
        The first stage takes token ids from `batch`; the others take the previous stage's `hidden`."""
        if self.is_first:
            h = F.embedding(batch.input_ids, self._embedding().weight)
        else:
            if hidden is None:
                raise ValueError(f"stage {self.stage} needs the hidden states of stage {self.stage - 1}")
            h = hidden
        cos, sin = rotary_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer.forward(h, cos, sin, batch, cache)  # DecoderLayer: parts called directly
        if not self.is_last:
            return h
        if self.norm is None:
            raise ValueError(f"stage {self.stage} is the last stage but holds no final norm; build it with StageModel")
        h = self.norm.forward(h[batch.logits_indices])
        weight = self._embedding().weight if self.lm_head is None else self.lm_head.weight
        return h @ weight.T

    def _embedding(self) -> nn.Embedding:
        """The token embedding (first stage, and last stage with tied weights); raises on a stage without one."""
        if self.embed_tokens is None:
            raise ValueError(
                f"stage {self.stage} of {self.stages} holds no token embedding: only the first stage and, with "
                "tie_word_embeddings, the last stage do"
            )
        return self.embed_tokens
