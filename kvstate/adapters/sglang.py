"""A `kvstate.testing.SchedulerAdapter` around SGLang 0.5.23's real scheduling classes and KV memory pools, on the CPU.

Importing this module needs SGLang (`scripts/install-peers` installs it without touching torch; the import takes
30-80 s); without it the import fails with an `ImportError` that says so. SGLang imports `torchvision` at module
level, whose PyPI wheels do not load against a CPU build of torch: where the real one does not import, the
project's own inert stand-in (`kvstate.adapters._vision_standin`) is used. No model runs and nothing is downloaded.

What runs is SGLang's own: `ReqToTokenPool`, `MHATokenToKVPool` and `TokenToKVPoolAllocator` on the CPU (page size
1: a "block" is one token slot), a `RadixCache` with caching off, `SchedulePolicy("fcfs")`, `PrefillAdder`
(admission, with SGLang's reservation of future tokens by `NewTokenRatioTracker`), `ScheduleBatch` (`init_new`,
`prepare_for_extend`, `merge_batch`, `filter_batch`, `check_decode_mem`, `retract_decode`, `prepare_for_decode`),
`Req.update_finish_state` and `release_kv_cache`. `step()` is one iteration of SGLang's event loop
(`Scheduler.get_next_batch_to_run` without overlap): merge the last prefill batch into the running batch, admit
from the waiting queue into a new prefill batch, else decode the running batch, retracting requests when its memory
check fails (retracted requests go back to the end of the waiting queue and later prefill prompt + outputs). The
forward pass is simulated on the KV slots SGLang allocates: every computed token is written into the slot its
`req_to_token` row names, and the next token is `kvstate.sim.next_token` of the context *read back* from those
slots, so any bookkeeping error in SGLang's pools changes the output (OUT-EQUIV).

Mapping of SGLang's requests onto the spec (roles, `kvstate.roles`):

| SGLang | spec role | packaged spec state |
|---|---|---|
| in the waiting queue, never run | queued | `waiting` |
| in the waiting queue after a retraction (`is_retracted`) | dropped | `recompute_paused` |
| in the running batch or the prefill batch | active | `running` |
| finished (length, stop token, abort) | ended | `done` |

Differences from the spec by design:

* **No host tier.** HiCache's host copies exist only on CUDA/XPU, so retraction is recompute-only: `suspended`
  never appears, `block_usage()` reports a host capacity of 0 and `set_host_capacity` returns False.
* **Admission reserves little.** SGLang reserves min(max_new_tokens, `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`)
  future tokens per request; the adapter sets that variable to 2 unless it is set (it is read when SGLang is
  imported), so that requests share a small pool and decode passes retract.
* **Replays prefill in one pass.** Chunked prefill is off (`chunked_prefill_size=None`), so a retracted request
  re-prefills prompt + outputs in one pass and is `running` again by the end of it (recompute_paused -> replaying
  -> running in one step).
* **Victims** follow SGLang's declared policy, `policy = "sglang"` (`kvstate.declared.PRESETS`), checked on every
  pass (`take_passes`): the running request with the fewest output tokens, ties the longest prompt, then the latest
  in the batch; retraction happens in decode passes, which admit nothing; the last request left is never retracted.
  A retraction has no requester (SGLang checks the whole decode batch): victims are reported as `DECODE_BATCH`'s.
* **Refusals.** An empty prompt, token ids outside the vocabulary, and prompt + max_new_tokens of `gpu_tokens` or
  more are refused by the adapter (in a server SGLang's tokenizer manager and scheduler validate and clip
  lengths): `PrefillAdder` admits a request only while prompt + max_new_tokens + a per-request overhead (1) is
  *below* the free slots, so `gpu_token_capacity` is `gpu_tokens - 2`; a larger one would wait forever.

Invariants kept by the adapter itself: ids are the strings "0", "1", ... in submission order; every request ever
submitted stays in `states()`/`outputs()`; `block_usage()` counts SGLang's allocator (free = its available size).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Hashable, Sequence
from types import SimpleNamespace

from kvstate import roles
from kvstate.adapters._vision_standin import install_if_missing
from kvstate.config import RequestRejected
from kvstate.declared import Listed, ObservedPass, PassOutput
from kvstate.errors import KVStateError
from kvstate.policy import PassRecord, PassSnapshot, RequestSnapshot, Victim
from kvstate.sim import DEFAULT_VOCAB, next_token, reference_output
from kvstate.spec import Spec, default_spec

SGLANG_VERSION = "0.5.23"
DECODE_BATCH = "<decode batch>"  # the requester of a retraction: SGLang checks the decode batch as a whole

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# PrefillAdder reserves min(max_new_tokens, this) future tokens per running request (x SGLang's new-token ratio); at
# its default (4096) a small pool admits requests one at a time and never retracts: clipped, it retracts
os.environ.setdefault("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "2")
try:
    import sglang
except ImportError as _err:  # pragma: no cover - exercised only without SGLang
    raise ImportError(
        f"kvstate.adapters.sglang drives SGLang {SGLANG_VERSION}'s scheduler, but sglang is not installed: run "
        "scripts/install-peers in this environment (it installs sglang without replacing torch)"
    ) from _err
if sglang.__version__ != SGLANG_VERSION:
    raise ImportError(
        f"kvstate.adapters.sglang is written against SGLang {SGLANG_VERSION}'s scheduler internals, but sglang "
        f"{sglang.__version__} is installed: run scripts/install-peers to install {SGLANG_VERSION}"
    )
VISION_STANDIN = install_if_missing()  # before SGLang's modules import torchvision

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

__all__ = ["DECODE_BATCH", "SGLANG_VERSION", "VISION_STANDIN", "SGLangAdapter"]

_SERVER_ARGS: list[ServerArgs] = []  # published once per process (SGLang reads them through global getters)


def _publish_server_args() -> None:
    if not _SERVER_ARGS:
        _SERVER_ARGS.append(ServerArgs(model_path="dummy", device="cpu"))
        set_global_server_args_for_scheduler(_SERVER_ARGS[0])


class SGLangInternalsError(KVStateError, RuntimeError):
    """SGLang's classes reached a structure this adapter does not map (another SGLang version?)."""


class SGLangAdapter:
    """`SchedulerAdapter` over SGLang's scheduling classes (no overlap, no chunked prefill, caching off), reporting
    every pass for the policy check (`kvstate.testing.PassReporting`, policy `"sglang"`).

    Args:
        gpu_tokens: KV token slots of the pool (page size 1, so also its blocks); the largest request it admits alone
            is two tokens smaller (`gpu_token_capacity`).
        max_running_requests: the most requests in the running batch.
        max_prefill_tokens: the token budget of one prefill batch.
        vocab_size: token ids are below it.
        spec: the spec whose states are reported (default: the packaged one).
    """

    policy = "sglang"
    block_size = 1

    def __init__(
        self,
        *,
        gpu_tokens: int = 32,
        max_running_requests: int = 4,
        max_prefill_tokens: int = 64,
        vocab_size: int = DEFAULT_VOCAB,
        spec: Spec | None = None,
    ) -> None:
        if gpu_tokens < 2 or max_running_requests < 1:
            raise ValueError(f"gpu_tokens={gpu_tokens} must be >= 2 and max_running_requests >= 1")
        _publish_server_args()
        self.spec = spec if spec is not None else default_spec()
        self._state_of_role = {role: self.spec.role(role) for role in (roles.QUEUED, roles.ACTIVE, roles.DROPPED)}
        self._ended = self.spec.role(roles.ENDED)
        self.gpu_tokens, self.vocab_size = gpu_tokens, vocab_size
        self.max_running, self.max_prefill_tokens = max_running_requests, max_prefill_tokens
        self._r2t = ReqToTokenPool(
            size=max_running_requests, max_context_len=gpu_tokens + 1, device="cpu", enable_memory_saver=False
        )
        kv = MHATokenToKVPool(
            size=gpu_tokens,
            page_size=1,
            dtype=torch.float32,
            head_num=1,
            head_dim=1,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        self._alloc = TokenToKVPoolAllocator(gpu_tokens, torch.float32, "cpu", kv, need_sort=False)
        self._tree = RadixCache(
            CacheInitParams(
                disable=True, req_to_token_pool=self._r2t, token_to_kv_pool_allocator=self._alloc, page_size=1
            )
        )
        self._policy = SchedulePolicy("fcfs", self._tree, False, False, None)
        self._model = SimpleNamespace(vocab_size=vocab_size, is_encoder_decoder=False)
        self._ratio = NewTokenRatioTracker.from_config()
        self._running = self._batch([])
        # PrefillAdder admits a request only while prompt + max_new_tokens + its per-request overhead is *below* the
        # free slots: the largest request that fits alone is that much smaller than the pool
        self.gpu_token_capacity = gpu_tokens - 1 - self._adder().per_req_token_overhead
        self._last_extend: ScheduleBatch | None = None
        self._waiting: list[Req] = []
        self._requests: dict[str, Req] = {}
        self._slots = [-1] * (gpu_tokens + 1)  # the token each KV slot holds (-1: never written)
        self._passes: list[ObservedPass] = []
        self._retractions: dict[str, int] = {}
        self._retraction_count = 0

    def __repr__(self) -> str:
        return f"SGLangAdapter(gpu_tokens={self.gpu_tokens}, max_running_requests={self.max_running})"

    # ------------------------------------------------------------------------------------ protocol
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Hashable:
        if not prompt or max_new_tokens < 1:
            raise RequestRejected("an empty prompt or max_new_tokens < 1 is refused")
        if len(prompt) + max_new_tokens > self.gpu_token_capacity:
            raise RequestRejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
                f"{self.gpu_token_capacity}, the most SGLang admits alone into a pool of {self.gpu_tokens} KV slots"
            )
        if any(not 0 <= t < self.vocab_size for t in (*prompt, *stop_token_ids)):
            raise RequestRejected(f"a token id is outside the vocabulary [0, {self.vocab_size})")
        rid = str(len(self._requests))
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop_token_ids))
        params.normalize(None)
        req = Req(rid, "", array("q", prompt), params, vocab_size=self.vocab_size, eos_token_ids=set())
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def step(self) -> None:
        before, record = self._snapshot(), PassRecord()
        if self._last_extend is not None:  # get_next_batch_to_run: the last prefill batch joins the running batch
            self._last_extend.filter_batch()
            if not self._last_extend.is_empty():
                if self._running.is_empty():
                    self._running = self._last_extend
                else:
                    self._running.merge_batch(self._last_extend)
            self._last_extend = None
        self._running.filter_batch()
        batch, kind = self._prefill_batch(), ""
        if batch is not None:
            self._sampled(batch.reqs, self._extend(batch))
            self._last_extend = batch
            kind = "context"
        elif not self._running.is_empty():
            self._decode(record)
            kind = "generation"
        self._passes.append(ObservedPass(before, record, self._pass_output(before, record, batch, kind)))

    def cancel(self, request_id: Hashable) -> None:
        req = self._requests.get(str(request_id)) if isinstance(request_id, str) else None
        if req is None:
            raise LookupError(f"no request {request_id!r} was submitted to this adapter")
        if req.finished():
            return
        req.finished_reason = FINISH_ABORT("cancelled")
        if req in self._waiting:
            self._waiting.remove(req)
        elif req.kv.req_pool_idx is not None:
            release_kv_cache(req, self._tree, checkpoint=False)
        self._running.filter_batch()

    def states(self) -> dict[Hashable, str]:
        return {rid: self._state(req) for rid, req in self._requests.items()}

    def outputs(self) -> dict[Hashable, list[int]]:
        return {rid: list(req.output_ids) for rid, req in self._requests.items()}

    def block_usage(self) -> dict[str, int]:
        free = self._alloc.available_size()
        return {
            "gpu_capacity": self.gpu_tokens,
            "gpu_free": free,
            "gpu_held": self.gpu_tokens - free,
            "gpu_fenced": 0,
            **dict.fromkeys(("host_capacity", "host_free", "host_held", "host_fenced"), 0),
        }

    def check_invariants(self) -> None:
        pass  # the conformance machine's block and output checks read SGLang's allocator and slots

    def set_host_capacity(self, blocks: int) -> bool:
        return False  # no host tier on the CPU

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        return reference_output(prompt, max_new_tokens, stop_token_ids, self.vocab_size)

    def take_passes(self) -> list[ObservedPass]:
        passes, self._passes = self._passes, []
        return passes

    # ------------------------------------------------------------------------------------- a pass
    def _batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(
            reqs, self._r2t, self._alloc, self._tree, self._model, False, SpeculativeAlgorithm.NONE
        )

    def _adder(self) -> PrefillAdder:
        return PrefillAdder(
            1,
            self._tree,
            self._alloc,
            self._running,
            self._ratio.current,
            self.max_prefill_tokens,
            None,
            max_prefill_bs=0,
            max_running_requests=self.max_running,
        )

    def _prefill_batch(self) -> ScheduleBatch | None:
        """SGLang's admission (`Scheduler._get_new_batch_prefill_raw` without chunking): the waiting queue in FCFS
        order through a `PrefillAdder`, stopping at the first request it does not take."""
        if not self._waiting:
            return None
        self._policy.calc_priority(self._waiting, self._running)
        adder = self._adder()
        room = min(self.max_running - self._running.batch_size(), self._r2t.available_size())
        for req in self._waiting:
            if adder.budget_state() == AddReqResult.OTHER or len(adder.can_run_list) >= room:
                break
            req.init_next_round_input(self._tree)
            if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
                break
        chosen = list(adder.can_run_list)
        if not chosen:
            return None
        self._waiting = [req for req in self._waiting if req not in chosen]
        batch = self._batch(chosen)
        batch.prepare_for_extend()
        return batch

    def _decode(self, record: PassRecord) -> None:
        """SGLang's `update_running_batch`: retract when the decode memory check fails, then decode one token."""
        running = self._running
        if not running.check_decode_mem():
            retracted, ratio, aborted = running.retract_decode()
            self._ratio.current = ratio
            for req in retracted:
                record.decisions.append(Victim(DECODE_BATCH, req.rid, "recompute_pause"))
                self._retraction_count += 1
                self._retractions[req.rid] = self._retraction_count
                self._waiting.append(req)  # _add_request_to_queue(req, is_retracted=True)
            for req in aborted:
                req.update_finish_state()
        else:
            self._ratio.decay_step()
        if running.is_empty():
            return
        running.prepare_for_decode()
        locs = running.out_cache_loc.tolist()
        tokens = []
        for req, loc in zip(running.reqs, locs, strict=True):
            self._slots[loc] = req.output_ids[-1]
            tokens.append(self._next(req, len(req.origin_input_ids) + len(req.output_ids)))
        self._sampled(running.reqs, tokens)

    def _extend(self, batch: ScheduleBatch) -> list[int]:
        """The prefill forward pass: write each chunk's tokens into its new slots, then sample from the slots."""
        locs = iter(batch.out_cache_loc.tolist())
        for req in batch.reqs:
            for position in range(req.prefix_len, req.prefix_len + req.extend_len):
                self._slots[next(locs)] = req.full_untruncated_fill_ids[position]
        return [self._next(req, req.prefix_len + req.extend_len) for req in batch.reqs]

    def _next(self, req: Req, length: int) -> int:
        table = self._r2t.req_to_token[req.kv.req_pool_idx, :length].tolist()
        context = [self._slots[slot] for slot in table]
        if -1 in context:
            raise SGLangInternalsError(f"request {req.rid} reads a KV slot never written: {table}")
        return next_token(context, self.vocab_size)

    def _sampled(self, reqs: list[Req], tokens: list[int]) -> None:
        for req, token in zip(reqs, tokens, strict=True):
            req.output_ids.append(token)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self._tree, checkpoint=False)

    # ------------------------------------------------------------------------------------- reports
    def _state(self, req: Req) -> str:
        if req.finished():
            return self._ended
        if req in self._waiting:
            return self._state_of_role[roles.DROPPED if req.is_retracted else roles.QUEUED]
        return self._state_of_role[roles.ACTIVE]

    def _snapshot(self) -> PassSnapshot:
        """What the policy reads now; admission = position in the running batch (SGLang's tie-break)."""
        position = {req.rid: i for i, req in enumerate(self._running.reqs)}
        if self._last_extend is not None:
            position |= {req.rid: len(position) + i for i, req in enumerate(self._last_extend.reqs)}
        requests = tuple(
            RequestSnapshot(
                rid,
                state,
                arrival=int(rid),
                admission=position.get(rid, -1),
                about_to_finish=len(req.output_ids) + 1 >= req.sampling_params.max_new_tokens,
                kv_tokens=len(req.origin_input_ids) + len(req.output_ids),
                num_output_tokens=len(req.output_ids),
                prompt_tokens=len(req.origin_input_ids),
                last_preemption=self._retractions.get(rid, -1),
            )
            for rid, req in self._requests.items()
            if (state := self._state(req)) != self._ended
        )
        return PassSnapshot(requests, max_batch_size=self.max_running, max_num_tokens=self.max_prefill_tokens)

    def _pass_output(self, before: PassSnapshot, record: PassRecord, batch, kind: str) -> PassOutput:
        was = {r.request_id: r.state for r in before.requests}
        dropped = self._state_of_role[roles.DROPPED]
        computed = list(batch.reqs) if batch is not None else list(self._running.reqs) if kind == "generation" else []
        listed = [Listed(req.rid, self._state(req)) for req in computed]
        victims = [
            Listed(d.victim, self._state(self._requests[str(d.victim)]))
            for d in record.decisions
            if isinstance(d, Victim)
        ]
        replays = tuple(x for x in listed if was.get(x.request_id) == dropped)
        others = tuple(x for x in listed if was.get(x.request_id) != dropped)
        return PassOutput(
            context=others if kind == "context" else (),
            generation=others if kind == "generation" else (),
            replay=replays,
            recompute_paused=tuple(victims),
            chunk_tokens={x.request_id: 1 for x in listed},
        )
