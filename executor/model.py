"""A Llama-style decoder with paged attention: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.`` prefix (``embed_tokens``,
``layers.{i}.self_attn.o_proj``, ..., ``norm``, ``lm_head``), except that each layer stores its q/k/v projections
as one matrix (``self_attn.qkv_proj``) and its gate/up projections as one (``mlp.gate_up_proj``), so each is one
matmul; `LlamaModel.hf_state_dict` and `LlamaModel.load_hf_state_dict` map to and from Hugging Face's names
(`executor.hf` reads and writes checkpoints through them; only the fused matrices are stored).

Two forward paths share every kernel:
* `forward_paged(batch, cache)`: a flattened batch of prefill chunks and decode tokens from many requests
  (`executor.batch.PagedBatch`). Each token's K and V are written into its request's block table slot, then each
  request attends over its whole context gathered from the cache: one padded and masked
  `scaled_dot_product_attention` per attention group of the batch (decode requests, multi-token chunks), reading
  the group's blocks with one `index_select`, or the keys and values a kept decode plan holds (the batch's
  `decode_kv`, `executor.decode_kv`). The rotary factors are computed once per forward and shared by all layers.
  Returns logits only for the rows that sample.
* `forward_dense(tokens)`: one sequence, no cache (the reference the paged path is tested against).

Invariants kept:
* a token's rotary angle depends only on its position, and attention of a request reads only its own blocks,
  so a request's logits do not depend on which other requests share the batch, nor on how its prompt was
  chunked (up to float rounding; the float64 default keeps that far below any argmax margin);
* RMSNorm normalizes in float32 at least (float16/bfloat16 activations are widened first, as Hugging Face does);
* batched attention reads only the blocks of each request's own table and masks every position past its context
  with -inf, so padding contributes exactly zero, provided the cache holds finite values (it starts zeroed and
  only ever receives K/V the model computed: the slots past a request's context in its last block may hold a
  previous owner's K/V, which a NaN/inf there would propagate).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from executor.batch import AttentionGroup, PagedBatch, gather_blocks


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
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class LayerCache(Protocol):
    """What the attention layers read of a paged KV cache: per layer, views of its keys and values shaped
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` that writes go through (`PagedKVCache` is one)."""

    def layer_keys(self, layer: int) -> torch.Tensor: ...

    def layer_values(self, layer: int) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized in float32 at least (float64 stays float64), as Hugging Face does: squaring a float16 or
        bfloat16 activation of magnitude ~300 in its own dtype overflows or loses the mean."""
        if x.dtype in (torch.float16, torch.bfloat16):
            wide = x.float()
            return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        # Hugging Face's formula, op for op (so bit for bit its result): on the CPU this costs less than
        # F.rms_norm, whose composite runs the same steps with more dispatch around them. On the CPU torch's mean
        # is the sum divided by the count, written out here (the same float; a sum dispatches in less than half
        # the time of a mean)
        squares = x * x
        if x.device.type == "cpu":
            variance = torch.sum(squares, -1, keepdim=True).div_(x.shape[-1])
        else:
            variance = torch.mean(squares, -1, keepdim=True)
        variance += self.eps
        return self.weight * (x * variance.rsqrt_())


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` in float64 (computed once per shape and device; never mutated)."""
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, max_positions: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary factors of each position for `apply_rotary`, ``[T, 1, head_dim]`` each (broadcast over heads):
    cos, and sin with its first half negated (the sign of Hugging Face's ``rotate_half``). Angles are computed in
    float64, then cast. Computed once per forward pass and shared by every layer. With `max_positions` (every
    position is below it) the factors are read from a table of all of them (`_rotary_table`, made once): the
    same values, two lookups instead of computing them again."""
    if max_positions is not None:
        cos, sin = _rotary_table(head_dim, theta, dtype, positions.device, max_positions)
        return cos.index_select(0, positions), sin.index_select(0, positions)
    angles = positions.to(torch.float64)[:, None, None] * _inv_freq(head_dim, theta, positions.device)
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


@functools.lru_cache(maxsize=16)
def _rotary_table(
    head_dim: int, theta: float, dtype: torch.dtype, device: torch.device, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_cos_sin` of positions ``0 .. max_positions - 1`` (made once per shape, dtype and device; never
    mutated)."""
    with torch.inference_mode(False):  # normal tensors, usable outside inference mode too
        return rotary_cos_sin(torch.arange(max_positions, device=device), head_dim, theta, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by the factors of `rotary_cos_sin`: Hugging Face Llama's
    ``x * cos + rotate_half(x) * sin``, written as ``x * cos + roll(x, half) * signed sin`` (``roll`` swaps the
    halves; ``-x2 * s`` and ``x2 * -s`` are the same float, so the result is bit for bit the same)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


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
        # q, k and v projections as one matrix (rows: q, then k, then v): one matmul per layer
        self.qkv_proj = nn.Linear(
            config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=False
        )
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None, cache: LayerCache | None
    ) -> torch.Tensor:
        t, heads = h.shape[0], self.num_heads + self.num_kv_heads
        qkv = F.linear(h, self.qkv_proj.weight).view(
            t, heads + self.num_kv_heads, self.head_dim
        )  # q heads, k heads, v heads
        q, k = apply_rotary(qkv[:, :heads], cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, heads:]
        if batch is None:  # dense: one sequence starting at position 0
            out = causal_attention(q, k, v, 0)
        else:
            if cache is None:
                raise ValueError("a paged batch indexes cache blocks: pass the cache its block tables refer to")
            keys, values = cache.layer_keys(self.layer), cache.layer_values(self.layer)
            slots = (batch.slot_blocks, batch.slot_offsets)
            keys.index_put_(slots, k)
            values.index_put_(slots, v)
            if batch.groups is None:
                out = self._attend_per_sequence(q, keys, values, batch)
            else:
                cached, new = (keys, values), (k, v)
                parts = [
                    self._attend_group(q, self._gathered(cached, group, batch, new), group) for group in batch.groups
                ]
                out = torch.cat(parts) if len(parts) > 1 else parts[0]
                if batch.out_order is not None:
                    out = out.index_select(0, batch.out_order)
        return F.linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj.weight)

    def _gathered(
        self,
        cached: tuple[torch.Tensor, torch.Tensor],
        group: AttentionGroup,
        batch: PagedBatch,
        new: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks `group` attends over, from this layer's `cached` keys and values: kept by the plan's
        `DecodeKV` (updated with this step's `new` keys and values of the group's rows) when the batch has one and
        this is its decode group (the first: rows ``row_start ..``, after a batch's prefill chunks), else gathered."""
        if batch.decode_kv is None or batch.groups is None or group is not batch.groups[0]:
            return gather_blocks(cached, group)
        start = group.row_start
        positions = batch.positions
        if start:  # a batch with prefill chunks first: the decode rows' keys, values and positions
            end = start + group.num_seqs
            new = (new[0][start:end], new[1][start:end])
            positions = positions[start:end]
        return batch.decode_kv.read(self.layer, cached, group, new, positions)

    def _attend_group(
        self, q: torch.Tensor, gathered: tuple[torch.Tensor, torch.Tensor], group: AttentionGroup
    ) -> torch.Tensor:
        """One batched attention over the requests of `group`, whose blocks `gathered` holds (`gather_blocks`); returns
        ``[rows, num_heads, head_dim]``."""
        b, nq, dim = group.num_seqs, group.num_queries, self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if group.query_rows is None:
            gq = q if q.shape[0] == b * nq else q[group.row_start : group.row_start + b * nq]
        else:
            gq = q.index_select(0, group.query_rows)
        gk, gv = gathered  # head-major: [B, Hkv, span, D]
        span, read = gk.shape[2], group.num_keys
        if read < span:  # nobody's context reaches the last slots
            gk, gv = gk[:, :, :read], gv[:, :, :read]
        if nq == 1:  # decode: the query heads sharing a KV head are that head's query rows, [B, Hkv, H / Hkv, D]
            out = F.scaled_dot_product_attention(
                gq.reshape(b, kv_heads, heads // kv_heads, dim), gk, gv, attn_mask=group.mask
            )
            return out.reshape(b, heads, dim)
        gq = gq.view(b, nq, heads, dim).transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            gq, gk, gv, attn_mask=group.mask, enable_gqa=heads != kv_heads
        )  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(b * nq, heads, dim)
        return out if group.valid is None else out.index_select(0, group.valid)

    @staticmethod
    def _attend_per_sequence(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: PagedBatch
    ) -> torch.Tensor:
        """The unbatched path (a `PagedBatch` built without `groups`): one `causal_attention` per request."""
        parts = []
        for seq in batch.seqs:
            context = seq.start + seq.end - seq.begin
            table = torch.tensor(seq.table, dtype=torch.long, device=q.device)
            seq_k = keys[table].flatten(0, 1)[:context]
            seq_v = values[table].flatten(0, 1)[:context]
            parts.append(causal_attention(q[seq.begin : seq.end], seq_k, seq_v, seq.start))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # gate and up projections as one matrix (rows: gate, then up): one matmul
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


class DecoderLayer(nn.Module):
    """One decoder layer. Its forward, and the model's, call their parts' `forward` directly (and the linear
    layers' weights through `F.linear`): `nn.Module.__call__` adds a fixed cost to every call (hooks, tracing
    state), paid by every step whatever its batch. No hooks are registered on these modules (the project registers
    none), so calling `forward` directly changes nothing else."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, batch, cache):
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, batch, cache)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


def _split_layer_name(name: str) -> tuple[str, str]:
    """``"layers.3.mlp.down_proj.weight"`` -> ``("layers.3", "mlp.down_proj.weight")``; others -> ``("", name)``."""
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3:
        return f"layers.{parts[1]}", parts[2]
    return "", name


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ``[out, in]`` with the same values, stored column by column: its transpose ``[in, out]`` is
    contiguous, so ``F.linear(x, weight)`` multiplies ``x`` by a contiguous matrix, which the CPU's matrix
    product runs faster at decode batch sizes than by the transpose of a row-major one."""
    return weight.t().contiguous().t()


class LlamaModel(nn.Module):
    """The decoder. Build with `LlamaModel.from_seed(config, seed)` or `executor.load_hf_llama(path)`.

    Every weight a forward multiplies through (`_multiplied_weights`) is stored column-major (`column_major`)
    from construction on: loading copies values into the parameters, and moving them to another dtype or device
    keeps their strides, so every loader gets the layout without doing anything; the parameters keep Hugging
    Face's shapes, so state dicts and checkpoints are unchanged."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        for matrix in self._multiplied_weights():
            matrix.weight = nn.Parameter(column_major(matrix.weight))
        self.requires_grad_(False)

    def _multiplied_weights(self) -> list[nn.Linear | nn.Embedding]:
        """The modules whose weight a forward multiplies activations through (`F.linear`): every linear layer, and
        the embedding when it is also the vocabulary projection (tied)."""
        modules: list[nn.Linear | nn.Embedding] = [m for m in self.modules() if isinstance(m, nn.Linear)]
        if self.lm_head is None:
            modules.append(self.embed_tokens)
        return modules

    @classmethod
    def from_seed(
        cls,
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
    ) -> LlamaModel:
        """Seeded weights (a `torch.Generator` with `seed`; drawn in float64 on the CPU, so every device and
        dtype gets the same values up to rounding). Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
        norm weights ~ 1 + N(0, 0.1^2)."""
        config = config or ModelConfig()
        model = cls(config).to(torch.float64)
        generator = torch.Generator().manual_seed(seed)
        state = {}
        for name, param in model.hf_state_dict().items():  # drawn in Hugging Face's parameter order
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
            elif name == "embed_tokens.weight":
                value = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            else:
                value = torch.randn(param.shape, generator=generator, dtype=torch.float64) / math.sqrt(param.shape[1])
            state[name] = value
        model.load_hf_state_dict(state)
        return model.to(device=device, dtype=dtype).eval()

    def _fused_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Per fused parameter suffix: its Hugging Face parts (suffix, rows), in the order its rows stack."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        return {
            "self_attn.qkv_proj.weight": (
                ("self_attn.q_proj.weight", q),
                ("self_attn.k_proj.weight", kv),
                ("self_attn.v_proj.weight", kv),
            ),
            "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)),
        }

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters under Hugging Face's names (without ``model.``), in its order; the parts of a fused
        matrix are views of it."""
        fused_parts = self._fused_parts()
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            layer, suffix = _split_layer_name(name)
            parts = fused_parts.get(suffix)
            if parts is None:
                out[name] = tensor
                continue
            for (part, _), view in zip(parts, tensor.split([rows for _, rows in parts]), strict=True):
                out[f"{layer}.{part}"] = view
        return out

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load parameters given under Hugging Face's names (exactly those of `hf_state_dict`), concatenating
        the parts of each fused matrix; each value is cast into the model's dtype."""
        fused_state = dict(state)
        for layer in range(self.config.num_layers):
            for fused, parts in self._fused_parts().items():
                names = [f"layers.{layer}.{part}" for part, _ in parts]
                if all(name in fused_state for name in names):
                    fused_state[f"layers.{layer}.{fused}"] = torch.cat([fused_state.pop(name) for name in names])
        self.load_state_dict(fused_state)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | None, cache: LayerCache | None
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_tokens.weight)
        c = self.config
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype, c.max_position_embeddings)
        for layer in self.layers:
            h = layer.forward(h, cos, sin, batch, cache)  # DecoderLayer: parts called directly
        return self.norm.forward(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, cache: LayerCache) -> torch.Tensor:
        """Write every token's K/V into the cache and return logits ``[len(batch.logits_indices), vocab]``."""
        hidden = self._decode(batch.input_ids, batch.positions, batch, cache)
        if batch.logits_indices.shape[0] == hidden.shape[0]:  # every row samples (a decode step): rows in order
            return self.logits(hidden)
        return self.logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward of one sequence from position 0; logits ``[len(tokens), vocab]``."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        return self.logits(self._decode(ids, positions, None, None))
