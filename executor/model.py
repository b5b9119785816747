"""A Llama-style decoder with paged attention: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.`` prefix (``embed_tokens``,
``layers.{i}.self_attn.q_proj``, ..., ``norm``, ``lm_head``), so checkpoints map one to one (`executor.hf`).

Two forward paths share every kernel:
* `forward_paged(batch, cache)`: a flattened batch of prefill chunks and decode tokens from many requests. Each
  token's K and V are written into its request's block table slot, then each request attends over its whole
  context gathered from the cache: batched, one padded and masked `scaled_dot_product_attention` for all decode
  requests and one for all multi-token chunks, each reading its requests' blocks with one `index_select`; the
  plan (block ids, masks, row maps) is built once per forward by `PagedBatch.build` and shared by all layers.
  Returns logits only for the rows that sample.
* `forward_dense(tokens)`: one sequence, no cache (the reference the paged path is tested against).

Invariants kept:
* a token's rotary angle depends only on its position, and attention of a request reads only its own blocks,
  so a request's logits do not depend on which other requests share the batch, nor on how its prompt was
  chunked (up to float rounding; the float64 default keeps that far below any argmax margin);
* `SeqChunk.block_table` must cover ``start + len(tokens)`` positions (the scheduler allocates before computing);
* batched attention reads only the blocks of each request's own table (padding repeats its first block) and
  masks every position past its context with -inf, so padding contributes exactly zero, provided the cache holds
  finite values (it starts zeroed and only ever receives K/V the model computed: the slots past a request's
  context in its last block may hold a previous owner's K/V, which a NaN/inf there would propagate).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

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


class _SeqView(NamedTuple):  # a tuple: built once per request per forward pass, cheaper than a dataclass
    begin: int  # row range in the flattened batch
    end: int
    start: int  # position of its first token
    table: tuple[int, ...]  # the blocks covering positions 0 .. start + (end - begin) - 1


@dataclass(frozen=True, slots=True)
class _AttnGroup:
    """Requests whose attention runs as one batched call: ``B`` requests, queries padded to ``Q`` rows each, keys
    padded to ``K = num_blocks * block_size`` positions each. Built once per forward, shared by every layer.

    Padding never changes a request's result: a padded query row repeats one of the request's real rows (and is
    dropped afterwards); a padded key (a slot past the request's context, or a whole padding block, which is
    the request's own first block again) is masked to -inf before the softmax, so its probability is exactly 0.
    """

    num_seqs: int  # B
    num_queries: int  # Q
    num_blocks: int  # blocks gathered per request
    query_rows: torch.Tensor | None  # [B * Q] rows of the flattened batch; None: rows row_start .. + B * Q
    row_start: int
    blocks: torch.Tensor  # [B * num_blocks] block ids (index_select over a layer's blocks)
    mask: torch.Tensor | None  # [B, 1, Q, K] bool, True = attend; None when every key is attended
    valid: torch.Tensor | None  # [rows] indices of the real query rows in ``B * Q``; None: all are real


def _group(views: Sequence[_SeqView], block_size: int, device: torch.device | str) -> tuple[_AttnGroup, list[int]]:
    """The batched-attention plan of `views` and the flattened-batch rows of its outputs, in output order."""
    num_queries = max(v.end - v.begin for v in views)
    num_blocks = max(len(v.table) for v in views)
    blocks: list[int] = []
    for v in views:
        blocks.extend(v.table)
        blocks.extend(v.table[:1] * (num_blocks - len(v.table)))
    if num_queries == 1:  # decode requests: one query each, nothing to pad
        rows = [v.begin for v in views]
        query_pos = [v.start for v in views]
        valid = list(range(len(views)))
        full = all(v.start + 1 == num_blocks * block_size for v in views)
    else:
        rows, query_pos, valid = [], [], []  # per (request, query slot); padding repeats the request's last row
        for i, v in enumerate(views):
            n = v.end - v.begin
            for j in range(num_queries):
                r = min(j, n - 1)
                rows.append(v.begin + r)
                query_pos.append(v.start + r)
                if j < n:
                    valid.append(i * num_queries + j)
        full = False  # causal within the chunk
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    mask = None
    if not full:
        key_pos = torch.arange(num_blocks * block_size, device=device)
        mask = (key_pos <= tensor(query_pos)[:, None]).view(len(views), 1, num_queries, -1)
    group = _AttnGroup(len(views), num_queries, num_blocks, None if contiguous else tensor(rows), rows[0],
                       tensor(blocks), mask, None if len(valid) == len(rows) else tensor(valid))
    return group, [rows[k] for k in valid]


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """A flattened token batch: per-token ids, positions and cache slots; per-request views; sampling rows;
    and the batched-attention plan (`groups`, `out_order`) that every layer shares."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    seqs: tuple[_SeqView, ...]
    logits_indices: torch.Tensor
    # decode requests (one token) form one group, multi-token chunks another; None: attend request by request
    groups: tuple[_AttnGroup, ...] | None = None
    out_order: torch.Tensor | None = None  # row t of the output is row out_order[t] of the groups' outputs

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
            if n == 1:
                positions.append(chunk.start)
                blocks.append(chunk.block_table[chunk.start // block_size])
                offsets.append(chunk.start % block_size)
            else:
                for pos in range(chunk.start, end_pos):
                    positions.append(pos)
                    blocks.append(chunk.block_table[pos // block_size])
                    offsets.append(pos % block_size)
            seqs.append(_SeqView(begin, begin + n, chunk.start, tuple(chunk.block_table[:needed])))
            if chunk.sample:
                sample_rows.append(begin + n - 1)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        groups: list[_AttnGroup] = []
        order: list[int] = []  # flattened-batch row of each output row of the groups, concatenated
        for members in ([s for s in seqs if s.end - s.begin == 1], [s for s in seqs if s.end - s.begin > 1]):
            if members:
                group, rows = _group(members, block_size, device)
                groups.append(group)
                order.extend(rows)
        out_order = None
        if order != list(range(len(order))):
            inverse = [0] * len(order)
            for k, row in enumerate(order):
                inverse[row] = k
            out_order = tensor(inverse)
        return cls(tensor(ids), tensor(positions), tensor(blocks), tensor(offsets), tuple(seqs), tensor(sample_rows),
                   tuple(groups), out_order)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` in float64 (computed once per shape and device; never mutated)."""
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, head_dim]`` for each position (angles computed in float64, then cast)."""
    angles = positions.to(torch.float64)[:, None] * _inv_freq(head_dim, theta, positions.device)[None, :]
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
        q = self.q_proj(h).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(t, self.num_kv_heads, self.head_dim)
        qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)  # one rotation of every query and key head
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = self.v_proj(h).view(t, self.num_kv_heads, self.head_dim)
        if batch is None:  # dense: one sequence starting at position 0
            out = causal_attention(q, k, v, 0)
        else:
            keys, values = cache.layer_keys(self.layer), cache.layer_values(self.layer)
            keys[batch.slot_blocks, batch.slot_offsets] = k
            values[batch.slot_blocks, batch.slot_offsets] = v
            if batch.groups is None:
                out = self._attend_per_sequence(q, keys, values, batch)
            else:
                parts = [self._attend_group(q, keys, values, group) for group in batch.groups]
                out = torch.cat(parts) if len(parts) > 1 else parts[0]
                if batch.out_order is not None:
                    out = out.index_select(0, batch.out_order)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _attend_group(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      group: _AttnGroup) -> torch.Tensor:
        """One batched attention over the requests of `group`; returns ``[rows, num_heads, head_dim]``."""
        b, nq, heads, dim = group.num_seqs, group.num_queries, self.num_heads, self.head_dim
        if group.query_rows is None:
            gq = q[group.row_start:group.row_start + b * nq]
        else:
            gq = q.index_select(0, group.query_rows)
        gq = gq.view(b, nq, heads, dim).transpose(1, 2)  # [B, H, Q, D]
        span = group.num_blocks * keys.shape[1]
        gk = keys.index_select(0, group.blocks).view(b, span, self.num_kv_heads, dim).transpose(1, 2)
        gv = values.index_select(0, group.blocks).view(b, span, self.num_kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=group.mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(b * nq, heads, dim)
        return out if group.valid is None else out.index_select(0, group.valid)

    @staticmethod
    def _attend_per_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             batch: PagedBatch) -> torch.Tensor:
        """The unbatched path (a `PagedBatch` built without `groups`): one `causal_attention` per request."""
        parts = []
        for seq in batch.seqs:
            context = seq.start + seq.end - seq.begin
            table = torch.tensor(seq.table, dtype=torch.long, device=q.device)
            seq_k = keys[table].flatten(0, 1)[:context]
            seq_v = values[table].flatten(0, 1)[:context]
            parts.append(causal_attention(q[seq.begin:seq.end], seq_k, seq_v, seq.start))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


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
