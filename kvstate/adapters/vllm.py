"""A `kvstate.testing.SchedulerAdapter` around vLLM 0.33.0's real v1 `Scheduler` and its real KV cache manager.

Importing this module needs vLLM (`scripts/install-peers` installs it without touching torch); without it the
import fails with an `ImportError` that says so. It selects vLLM's CPU platform unless a device platform is already
selected (also when an earlier import, SGLang's for one, left vLLM's platform unspecified), and sets
`HF_HUB_OFFLINE=1` unless set: the "model" is a tiny Llama `config.json` written to a temporary directory, nothing
is downloaded and no weights exist. Only the scheduler runs; the model runner is replaced by a slot-level KV
simulation (below), so a step costs milliseconds.

How a step runs: `Scheduler.schedule()`; every scheduled chunk writes its tokens (the request's own token ids, as
vLLM's model runner feeds them) into the slots of the GPU blocks its block table names; a request whose every
known token now has KV "samples" `kvstate.sim.next_token` of the context *read back from those slots*; the result
goes back through `Scheduler.update_from_output(ModelRunnerOutput(...))`. Tokens are thus a deterministic function
of (request, position) when vLLM's KV bookkeeping is right, and any bookkeeping error (a wrong prefix-cache hit, a
block reused while still held, stale computed-token counts after a preemption) changes the context and so the
output, which the conformance machine reports as OUT-EQUIV. `reference()` is `kvstate.sim.reference_output`.

Mapping of vLLM's `RequestStatus` onto the spec (one table, `_ROLE_OF_STATUS`; states found by role):

| vLLM | spec role (`kvstate.roles`) | packaged spec state |
|---|---|---|
| `WAITING` | queued | `waiting` |
| `RUNNING`, never preempted or caught up | active | `running` |
| `RUNNING` after a preemption, no token sampled since it | recomputing | `replaying` |
| `PREEMPTED` | dropped | `recompute_paused` |
| `FINISHED_*` (stopped, length-capped, aborted, ...) | ended | `done` |

Differences from the spec by design (none is reported as a violation unless stated):

* **No host tier.** vLLM v1 preempts only by recompute: `suspended` never appears, `block_usage()` reports a host
  capacity of 0 and `set_host_capacity` returns False. No pipeline consensus either: `awaiting_consensus` never
  appears.
* **Replaying is derived.** vLLM has no replay status: a preempted request is readmitted as `RUNNING` with
  prompt + output to recompute. It is `replaying` until it samples a token again: the spec's replay completes with
  the chunk that samples the next token (`catch_up`), so a chunk that stops one token short of that leaves it
  `replaying`, and the pass that computes the rest lists it in `replay`.
* **A replay may reuse KV.** With prefix caching, a readmitted request hits the blocks it freed when it was
  preempted (still cached until evicted), so a replay can finish at once; the spec's recompute-pause drops the KV
  everywhere and STATS-COUNT counts no replayed token as a cache hit.
* **Shared blocks.** With prefix caching, full blocks are shared and reference-counted, so OWN-EXCL (at most one
  owner) holds only without prefix caching; with it, `check_invariants` checks that every block's reference count
  equals the number of block tables holding it. Freed cached blocks stay in the free queue and count as free.
  vLLM's null block (block 0) is never allocated and is left out of the capacity.
* **Victims and admissions** follow vLLM's own policy, declared as `policy = "vllm"` (`kvstate.declared.PRESETS`)
  and checked on every pass (`take_passes`): the tail of the running queue (admission = position in it), possibly
  the request being scheduled itself, even one whose next token is its last (no `about_to_finish` exclusion:
  VICTIM-NOT-FINAL concerns a request whose final step is already under way, which synchronous scheduling never
  has); a pass that preempted admits nothing; a victim goes back to the head of the waiting queue.
* **Refusals.** vLLM's own input validation (its `InputProcessor`) refuses an empty prompt, a prompt of at least
  `max_model_len` tokens, token ids outside the vocabulary and `max_tokens < 1`; the adapter passes every
  submission through it. vLLM *accepts* a request whose prompt + max_tokens exceeds `max_model_len` and stops it
  there (`FINISHED_LENGTH_CAPPED`, a shorter output), where the spec refuses it (LIVE-REFUSE). With
  `refuse_capped=True` (the default) the adapter refuses those itself, as a front end that does not want silently
  shortened outputs would; `refuse_capped=False` submits them as vLLM's engine does (docs/vllm-findings.md).
* `done` reasons: `FINISHED_ABORTED` (what `cancel` sets) is cancelled; every other finished status is finished.

Invariants kept by the adapter itself: ids are the strings "0", "1", ... in submission order; every request ever
submitted stays in `states()`/`outputs()` after vLLM forgets it; `block_usage()` counts from vLLM's block pool
(free = its free queue, held = blocks whose reference count is positive).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Hashable, Mapping, Sequence

from kvstate import roles
from kvstate.config import RequestRejected
from kvstate.declared import Listed, ObservedPass, PassOutput
from kvstate.errors import InvariantViolation, KVStateError
from kvstate.policy import PassRecord, PassSnapshot, RequestSnapshot, Victim
from kvstate.sim import DEFAULT_VOCAB, next_token, reference_output
from kvstate.spec import Spec, default_spec

VLLM_VERSION = "0.33.0"

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM imports huggingface_hub: nothing is downloaded
try:
    import vllm
except ImportError as _err:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        f"kvstate.adapters.vllm drives vLLM {VLLM_VERSION}'s scheduler, but vllm is not installed: run "
        "scripts/install-peers in this environment (it installs vllm without replacing torch)"
    ) from _err
if vllm.__version__ != VLLM_VERSION:
    raise ImportError(
        f"kvstate.adapters.vllm is written against vLLM {VLLM_VERSION}'s scheduler internals, but vllm "
        f"{vllm.__version__} is installed: run scripts/install-peers to install {VLLM_VERSION}"
    )

import torch  # noqa: E402  (vLLM's KV cache spec names a dtype)
import vllm.platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

_platform = vllm.platforms._current_platform
if _platform is None or not getattr(_platform, "device_type", ""):
    # None: not detected yet; no device type: detected as unspecified by an earlier import of vLLM's modules (SGLang
    # imports some) on a machine without a GPU. vLLM declares `_current_platform = None` without an annotation, so
    # its inferred type admits only None; the ignore is unused where vllm is not installed (its imports are then Any).
    vllm.platforms._current_platform = CpuPlatform()  # type: ignore[assignment, unused-ignore]

from vllm.config import CacheConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.config import SchedulerConfig as _VLLMSchedulerConfig  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.input_processor import InputProcessor  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

__all__ = ["VLLM_VERSION", "VLLMAdapter"]

# The one mapping of vLLM statuses onto spec roles. RUNNING maps to RECOMPUTING from a preemption until the
# request samples a token again (see `VLLMAdapter._state`).
_ROLE_OF_STATUS: Mapping[RequestStatus, str] = {
    RequestStatus.WAITING: roles.QUEUED,
    RequestStatus.RUNNING: roles.ACTIVE,
    RequestStatus.PREEMPTED: roles.DROPPED,
    **{status: roles.ENDED for status in RequestStatus if RequestStatus.is_finished(status)},
}

# Spec invariants `check_invariants` checks on vLLM's internals; each must exist in the spec.
_DEEP_INVARIANTS = ("OWN-EXCL", "RES-STATE", "RESET-PROMPT", "RESET-CLEARED")

_LAYER = "layer"  # the one attention layer of the KV cache spec


class VLLMInternalsError(KVStateError, RuntimeError):
    """vLLM's scheduler reached a status or structure this adapter does not map (another vLLM version?)."""


@functools.cache
def _model_dir(vocab_size: int) -> str:
    """A directory holding a tiny Llama `config.json` (no weights, no tokenizer), removed at exit."""
    path = tempfile.mkdtemp(prefix="kvstate-vllm-model-")
    atexit.register(shutil.rmtree, path, True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": vocab_size,
        "max_position_embeddings": 1 << 16,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file)
    return path


@functools.cache
def _model_config(vocab_size: int, max_model_len: int) -> ModelConfig:
    """Built once per process and shape: vLLM's `ModelConfig` takes seconds (it inspects the architecture)."""
    return ModelConfig(
        model=_model_dir(vocab_size), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32"
    )


@functools.cache
def _block_hasher(hash_algo: str, block_size: int):
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def _spec_invariants(spec: Spec) -> dict[str, str]:
    by_id = {inv.id: inv.statement for inv in spec.invariants}
    missing = [i for i in _DEEP_INVARIANTS if i not in by_id]
    if missing:
        raise ValueError(
            f"spec {spec.name!r} ({spec.source}) lacks invariants {', '.join(missing)} that "
            "VLLMAdapter.check_invariants checks; add them to the spec or use the packaged one"
        )
    return {i: by_id[i] for i in _DEEP_INVARIANTS}


class VLLMAdapter:
    """`SchedulerAdapter` over vLLM's v1 `Scheduler` (synchronous scheduling, one full-attention KV group), reporting
    every pass for the policy check (`kvstate.testing.PassReporting`, policy `"vllm"`).

    Args:
        gpu_blocks: KV blocks requests can hold (vLLM adds its null block); with `block_size` it sets
            `gpu_token_capacity` and vLLM's `max_model_len` unless `max_model_len` is given.
        block_size: tokens per block.
        prefix_caching: vLLM's `enable_prefix_caching`.
        max_num_batched_tokens: the token budget of one step; below a prompt's length, prefills are chunked.
        max_num_seqs: the most running requests.
        vocab_size: token ids are below it (the conformance machine draws prompts from it).
        refuse_capped: refuse prompt + max_new_tokens > max_model_len, which vLLM would accept and cut short (see
            the module docstring); False submits them unchanged.
        spec: the spec whose states are reported (default: the packaged one).
        deep_checks: let `check_invariants` check vLLM's block tables and reference counts.
        max_model_len: the most tokens (prompt + output) one request may have, at most gpu_blocks × block_size
            (the default); lower it when many requests share a GPU tier far larger than one needs (the benchmark).
    """

    def __init__(  # noqa: PLR0913 - keyword-only, one per vLLM setting the conformance tests vary
        self,
        *,
        gpu_blocks: int = 8,
        block_size: int = 16,
        prefix_caching: bool = False,
        max_num_batched_tokens: int = 32,
        max_num_seqs: int = 8,
        vocab_size: int = DEFAULT_VOCAB,
        refuse_capped: bool = True,
        spec: Spec | None = None,
        deep_checks: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        if gpu_blocks < 1 or block_size < 1:
            raise ValueError(f"gpu_blocks={gpu_blocks}, block_size={block_size}: both must be at least 1")
        if max_model_len is not None and not 1 <= max_model_len <= gpu_blocks * block_size:
            raise ValueError(
                f"max_model_len={max_model_len} must be between 1 and gpu_blocks × block_size = "
                f"{gpu_blocks * block_size}; leave it out to use the whole GPU tier"
            )
        self.spec = spec if spec is not None else default_spec()
        self._invariants = _spec_invariants(self.spec)
        self._state_of_role = {role: self.spec.role(role) for role in {*_ROLE_OF_STATUS.values(), roles.RECOMPUTING}}
        self.block_size = block_size
        self.gpu_token_capacity = max_model_len or gpu_blocks * block_size
        self.vocab_size = vocab_size
        self.prefix_caching = prefix_caching
        self.refuse_capped = refuse_capped
        self.deep_checks = deep_checks
        num_blocks = gpu_blocks + 1  # + vLLM's null block
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
        cache.num_gpu_blocks = num_blocks
        scheduler = _VLLMSchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=self.gpu_token_capacity,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        )
        config = VllmConfig(
            model_config=_model_config(vocab_size, self.gpu_token_capacity),
            scheduler_config=scheduler,
            cache_config=cache,
        )
        kv_cache = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    [_LAYER], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
                )
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
        )
        self._inputs = InputProcessor(config)
        self._hasher = _block_hasher(cache.prefix_caching_hash_algo, block_size) if prefix_caching else None
        self._pool = self.scheduler.kv_cache_manager.block_pool
        self._requests: dict[str, Request] = {}
        self._slots: list[list[int]] = [[-1] * block_size for _ in range(num_blocks)]  # -1: never written
        self._passes: list[ObservedPass] = []
        self._record = PassRecord()
        self._preemptions: dict[str, int] = {}  # request id -> its latest preemption (`_preemption_count` then)
        self._output_at_preemption: dict[str, int] = {}  # request id -> its output length at its latest preemption
        self._preemption_count = 0
        self._asking: Request | None = None  # the request vLLM allocates blocks for (the requester of a preemption)
        self._observe_decisions()

    policy = "vllm"

    def __repr__(self) -> str:
        return (
            f"VLLMAdapter(gpu_blocks={self._pool.num_gpu_blocks - 1}, block_size={self.block_size}, "
            f"prefix_caching={self.prefix_caching})"
        )

    # ------------------------------------------------------------------------------------ protocol
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Hashable:
        if self.refuse_capped and len(prompt) + max_new_tokens > self.gpu_token_capacity:
            raise RequestRejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds vLLM's "
                f"max_model_len={self.gpu_token_capacity}; vLLM would stop it there with a shorter "
                "output, so it is refused: shorten the prompt or lower max_new_tokens"
            )
        request_id = str(len(self._requests))
        try:
            # ignore_eos: the tiny model's config would make token 2 (Llama's default EOS) a stop; the reference
            # stops only at `stop_token_ids` and `max_new_tokens`.
            params = SamplingParams(
                max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop_token_ids), ignore_eos=True
            )
            core_request = self._inputs.process_inputs(
                request_id, {"prompt_token_ids": list(prompt)}, params, ("generate",)
            )
        except VLLMValidationError as err:
            raise RequestRejected(f"vLLM refuses the request: {err}") from err
        request = Request.from_engine_core_request(core_request, self._hasher)
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        return request_id

    def step(self) -> None:
        before = self._snapshot()
        self._record = PassRecord()
        output = self.scheduler.schedule()
        self._passes.append(ObservedPass(before, self._record, self._pass_output(before, output)))
        ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in ids:
            request = self._requests[request_id]
            table = self._block_table(request_id)
            end = request.num_computed_tokens  # schedule() already advanced it past this step's chunk
            for position in range(end - output.num_scheduled_tokens[request_id], end):
                block, offset = divmod(position, self.block_size)
                self._slots[table[block]][offset] = request.all_token_ids[position]
            if end < request.num_tokens:
                sampled.append([])  # a prefill chunk that is not the last: nothing sampled
                continue
            context = [self._slots[table[p // self.block_size]][p % self.block_size] for p in range(end)]
            sampled.append([next_token(context, self.vocab_size)])
        self.scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )

    def cancel(self, request_id: Hashable) -> None:
        if request_id not in self._requests:
            raise LookupError(f"no request {request_id!r} was submitted to this adapter")
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)  # a finished one: no-op

    def states(self) -> dict[Hashable, str]:
        return {request_id: self._state(request) for request_id, request in self._requests.items()}

    def outputs(self) -> dict[Hashable, list[int]]:
        return {request_id: list(request.output_token_ids) for request_id, request in self._requests.items()}

    def block_usage(self) -> dict[str, int]:
        capacity = self._pool.num_gpu_blocks - 1  # the null block is never allocated
        held = sum(1 for block in self._pool.blocks if not block.is_null and block.ref_cnt > 0)
        return {
            "gpu_capacity": capacity,
            "gpu_free": self._pool.get_num_free_blocks(),
            "gpu_held": held,
            "gpu_fenced": 0,
            "host_capacity": 0,
            "host_free": 0,
            "host_held": 0,
            "host_fenced": 0,
        }

    def check_invariants(self) -> None:
        """vLLM's block tables against its block pool and the spec's reset rules (`_DEEP_INVARIANTS`)."""
        if not self.deep_checks:
            return
        holders: dict[int, list[str]] = {}
        for request_id, request in self._requests.items():
            blocks = self._blocks(request_id)
            if blocks and request.status != RequestStatus.RUNNING:
                self._violation(
                    "RES-STATE",
                    f"request {request_id!r} is {request.status} "
                    f"({self._state(request)}) yet holds blocks {[b.block_id for b in blocks]}",
                )
            for block in blocks:
                if not block.is_null:
                    holders.setdefault(block.block_id, []).append(request_id)
            if request.status == RequestStatus.PREEMPTED:
                # prompt_token_ids is None only for a prompt given as embeddings, which `submit` never sends
                replay = list(request.prompt_token_ids or ()) + list(request.output_token_ids)
                if list(request.all_token_ids) != replay:
                    self._violation(
                        "RESET-PROMPT",
                        f"preempted request {request_id!r} will recompute "
                        f"{list(request.all_token_ids)}, not prompt + generated {replay}",
                    )
                if request.num_computed_tokens:
                    self._violation(
                        "RESET-CLEARED",
                        f"preempted request {request_id!r} still counts {request.num_computed_tokens} computed tokens",
                    )
        for block in self._pool.blocks:
            if block.is_null:
                continue
            owners = holders.get(block.block_id, [])
            if block.ref_cnt != len(owners):
                self._violation(
                    "OWN-EXCL",
                    f"block {block.block_id} has reference count {block.ref_cnt} but is "
                    f"in the block tables of {owners}",
                )
            if len(owners) > 1 and not self.prefix_caching:
                self._violation(
                    "OWN-EXCL", f"block {block.block_id} is in the block tables of {owners} without prefix caching"
                )

    def set_host_capacity(self, blocks: int) -> bool:
        return False  # vLLM v1 has no host tier to resize

    def take_passes(self) -> list[ObservedPass]:
        passes, self._passes = self._passes, []
        return passes

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        return reference_output(prompt, max_new_tokens, stop_token_ids, self.vocab_size)

    # ------------------------------------------------------------------------------------- passes
    def _observe_decisions(self) -> None:
        """Record each preemption with its requester: vLLM preempts while it allocates blocks for a request."""
        manager, scheduler = self.scheduler.kv_cache_manager, self.scheduler
        allocate, preempt = manager.allocate_slots, scheduler._preempt_request

        def allocate_slots(request, *args, **kwargs):
            self._asking = request
            return allocate(request, *args, **kwargs)

        def preempt_request(request, *args, **kwargs):
            requester = self._asking.request_id if self._asking is not None else request.request_id
            self._record.decisions.append(Victim(requester, request.request_id, "recompute_pause"))
            self._preemption_count += 1
            self._preemptions[request.request_id] = self._preemption_count
            self._output_at_preemption[request.request_id] = len(request.output_token_ids)
            return preempt(request, *args, **kwargs)

        manager.allocate_slots = allocate_slots  # type: ignore[method-assign, unused-ignore]
        scheduler._preempt_request = preempt_request  # type: ignore[method-assign, unused-ignore]

    def _snapshot(self) -> PassSnapshot:
        """What the policy reads of vLLM's active requests now; admission = position in the running queue."""
        position = {request.request_id: i for i, request in enumerate(self.scheduler.running)}
        ended = self._state_of_role[roles.ENDED]
        requests = tuple(
            RequestSnapshot(
                request_id,
                state,
                arrival=int(request_id),
                admission=position.get(request_id, -1),
                prefilling=request.num_computed_tokens < request.num_prompt_tokens,
                about_to_finish=len(request.output_token_ids) + 1 >= request.max_tokens,
                kv_tokens=request.num_computed_tokens,
                gpu_blocks=len(self._blocks(request_id)),
                num_output_tokens=len(request.output_token_ids),
                prompt_tokens=request.num_prompt_tokens,
                last_preemption=self._preemptions.get(request_id, -1),
            )
            for request_id, request in self._requests.items()
            if (state := self._state(request)) != ended
        )
        config = self.scheduler.scheduler_config
        return PassSnapshot(
            requests,
            max_batch_size=config.max_num_seqs,
            max_num_tokens=config.max_num_batched_tokens,
            serve_order=tuple(request.request_id for request in self.scheduler.running),
        )

    def _pass_output(self, before: PassSnapshot, output) -> PassOutput:
        """vLLM's output in the spec's lists, each request in the list its state before the pass implies."""
        was = {r.request_id: r.state for r in before.requests}
        queued, dropped = self._state_of_role[roles.QUEUED], self._state_of_role[roles.DROPPED]
        recomputing = self._state_of_role[roles.RECOMPUTING]
        lists: dict[str, list[Listed]] = {"context": [], "replay": [], "generation": [], "recompute_paused": []}
        for request_id in output.num_scheduled_tokens:
            request = self._requests[request_id]
            listed = Listed(request_id, self._state(request))
            if was.get(request_id) in (dropped, recomputing):
                lists["replay"].append(listed)
            elif was.get(request_id) == queued or request.num_computed_tokens < request.num_tokens:
                lists["context"].append(listed)
            else:
                lists["generation"].append(listed)
        for d in (d for d in self._record.decisions if isinstance(d, Victim)):
            lists["recompute_paused"].append(Listed(d.victim, self._state(self._requests[str(d.victim)])))
        return PassOutput(
            **{name: tuple(found) for name, found in lists.items()}, chunk_tokens=dict(output.num_scheduled_tokens)
        )

    # ------------------------------------------------------------------------------------- helpers
    def _state(self, request: Request) -> str:
        role = _ROLE_OF_STATUS.get(request.status)
        if role is None:
            raise VLLMInternalsError(
                f"vLLM request {request.request_id!r} has status {request.status}, which "
                "kvstate.adapters.vllm does not map (it enables no feature that reaches it)"
            )
        if role == roles.ACTIVE and self._output_at_preemption.get(request.request_id) == len(request.output_token_ids):
            role = roles.RECOMPUTING  # preempted, and no token sampled since: still replaying
        return self._state_of_role[role]

    def _blocks(self, request_id: str) -> list:
        return self.scheduler.kv_cache_manager.coordinator.get_blocks(request_id)[0]

    def _block_table(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks(request_id)]

    def _violation(self, invariant_id: str, detail: str) -> None:
        raise InvariantViolation(invariant_id, f"{detail}. [{invariant_id}: {self._invariants[invariant_id]}]")
