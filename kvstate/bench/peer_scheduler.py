"""The peer baseline: a minimal continuous-batching scheduler in the nano-vllm design (DESIGN §6).

Two deques (waiting, running), a free-block count, and LIFO preemption back to waiting (recompute): no tiers,
no lifecycle machine, no statistics. `schedule()` does for a steady decode step what a careful pure-Python
scheduler must do at least, so `kvstate.Scheduler.schedule()` measured beside it shows our overhead.
"""

from __future__ import annotations

from collections import deque


class PeerSeq:
    __slots__ = ("num_tokens", "num_blocks")

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.num_blocks = 0


class PeerScheduler:
    """nano-vllm's scheduling loop: prefill waiting sequences if room, else decode every running one."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.free_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[PeerSeq] = deque()
        self.running: deque[PeerSeq] = deque()

    def add(self, seq: PeerSeq) -> None:
        self.waiting.append(seq)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def schedule(self) -> tuple[list[PeerSeq], bool]:
        scheduled: list[PeerSeq] = []
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self._blocks(seq.num_tokens)
            if need > self.free_blocks:
                break
            self.free_blocks -= need
            seq.num_blocks = need
            scheduled.append(self.waiting.popleft())
            self.running.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while seq.num_tokens % self.block_size == 0 and self.free_blocks == 0:  # needs a new block
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                if seq.num_tokens % self.block_size == 0:
                    self.free_blocks -= 1
                    seq.num_blocks += 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def _preempt(self, seq: PeerSeq) -> None:
        self.free_blocks += seq.num_blocks
        seq.num_blocks = 0
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[PeerSeq]) -> None:
        for seq in seqs:
            seq.num_tokens += 1
