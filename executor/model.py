"""A Llama-style decoder with paged attention: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.`` prefix (``embed_tokens``,
``layers.{i}.self_attn.q_proj``, ..., ``norm``, ``lm_head``), so checkpoints map one to one (`executor.hf`).

Two forward paths share every kernel:
* `forward_paged(batch, cache)`: a flattened batch of prefill chunks and decode tokens from many requests. Each
  token's K and V are written into its request's block table slot, then each request attends over its whole
  context gathered from the cache. Returns logits only for the rows that sample.
* `forward_dense(tokens)`: one sequence, no cache (the reference the paged path is tested against).

Invariants kept:
* a token's rotary angle depends only on its position, and attention of a request reads only its own blocks,
  so a request's logits do not depend on which other requests share the batch, nor on how its prompt was
  chunked (up to float rounding; the float64 default keeps that far below any argmax margin);
* `SeqChunk.block_table` must cover ``start + len(tokens)`` positions (the scheduler allocates before computing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of the decoder. The defaults are a tiny model that runs fast on two CPU cores."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """What one request computes in a forward pass: `tokens` at positions ``start ..``, KV in `block_table`."""

    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    sample: bool = True  # produce logits for its last token


@dataclass(frozen=True, slots=True)
class _SeqView:
    begin: int  # row range in the flattened batch
    end: int
    start: int  # position of its first token
    table: torch.Tensor  # the blocks covering positions 0 .. start + (end - begin) - 1


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """A flattened token batch: per-token ids, positions and cache slots; per-request views; sampling rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    seqs: tuple[_SeqView, ...]
    logits_indices: torch.Tensor

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu") -> PagedBatch:
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        seqs: list[_SeqView] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            n = len(chunk.tokens)
            end_pos = chunk.start + n
            needed = -(-end_pos // block_size)
            if n == 0 or len(chunk.block_table) < needed:
                raise ValueError(f"chunk of {n} tokens at {chunk.start} needs {needed} blocks, table has "
                                 f"{len(chunk.block_table)}; allocate before computing")
            begin = len(ids)
            ids.extend(chunk.tokens)
            for pos in range(chunk.start, end_pos):
                positions.append(pos)
                blocks.append(chunk.block_table[pos // block_size])
                offsets.append(pos % block_size)
            table = torch.tensor(chunk.block_table[:needed], dtype=torch.long, device=device)
            seqs.append(_SeqView(begin, begin + n, chunk.start, table))
            if chunk.sample:
                sample_rows.append(begin + n - 1)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(tensor(ids), tensor(positions), tensor(blocks), tensor(offsets), tuple(seqs), tensor(sample_rows))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, head_dim]`` for each position (angles computed in float64, then cast)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` (the rotate-half convention of Hugging Face Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Queries ``[n, Hq, D]`` at positions ``q_start ..`` over keys/values ``[S, Hkv, D]`` at positions ``0 .. S-1``.

    Query i sees keys ``0 .. q_start + i``. Query head h uses KV head ``h // (Hq // Hkv)`` (grouped-query).
    """
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * (1.0 / math.sqrt(head_dim))  # [H, n, S]
    if n > 1 or q_start + n < k.shape[0]:
        key_pos = torch.arange(k.shape[0], device=q.device)
        query_pos = torch.arange(q_start, q_start + n, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v.transpose(0, 1))  # [H, n, D]
    return out.transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: PagedBatch | None, cache: object | None) -> torch.Tensor:
        t = h.shape[0]
        q = apply_rotary(self.q_proj(h).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(h).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(h).view(t, self.num_kv_heads, self.head_dim)
        if batch is None:  # dense: one sequence starting at position 0
            out = causal_attention(q, k, v, 0)
        else:
            keys, values = cache.layer_keys(self.layer), cache.layer_values(self.layer)
            keys[batch.slot_blocks, batch.slot_offsets] = k
            values[batch.slot_blocks, batch.slot_offsets] = v
            parts = []
            for seq in batch.seqs:
                context = seq.start + seq.end - seq.begin
                seq_k = keys[seq.table].flatten(0, 1)[:context]
                seq_v = values[seq.table].flatten(0, 1)[:context]
                parts.append(causal_attention(q[seq.begin:seq.end], seq_k, seq_v, seq.start))
            out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, batch, cache):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The decoder. Build with `LlamaModel.from_seed(config, seed)` or `executor.load_hf_llama(path)`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.requires_grad_(False)

    @classmethod
    def from_seed(cls, config: ModelConfig | None = None, seed: int = 0, *, dtype: torch.dtype = torch.float64,
                  device: str | torch.device = "cpu") -> LlamaModel:
        """Seeded weights (a `torch.Generator` with `seed`; drawn in float64 on the CPU, so every device and
        dtype gets the same values up to rounding). Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
        norm weights ~ 1 + N(0, 0.1^2)."""
        config = config or ModelConfig()
        model = cls(config)
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
            elif name == "embed_tokens.weight":
                value = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            else:
                value = torch.randn(param.shape, generator=generator, dtype=torch.float64) / math.sqrt(param.shape[1])
            param.data = value
        return model.to(device=device, dtype=dtype).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | None,
                cache: object | None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, cache)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.T

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, cache: object) -> torch.Tensor:
        """Write every token's K/V into the cache and return logits ``[len(batch.logits_indices), vocab]``."""
        hidden = self._decode(batch.input_ids, batch.positions, batch, cache)
        return self.logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward of one sequence from position 0; logits ``[len(tokens), vocab]``."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        return self.logits(self._decode(ids, positions, None, None))
