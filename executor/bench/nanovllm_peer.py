"""nano-vllm's real scheduler as a benchmark peer: `NanoVLLMDriver` steps it through a `stepping.Workload`.

nano-vllm is not on PyPI. Get a checkout (``git clone https://github.com/GeeeekExplorer/nano-vllm``) and point the
bench at it (``kvstate bench --nano-vllm DIR``, DIR holding ``nanovllm/engine/``). `load` runs its own
``engine/scheduler.py``, ``engine/block_manager.py`` and ``engine/sequence.py`` and its ``sampling_params.py``
from there, as they are. Two things are left out: ``nanovllm/__init__.py`` (it imports the model runner: torch
with CUDA, flash-attn, the Qwen model) is not run, and ``nanovllm.config.Config`` is stubbed (the real one reads a
Hugging Face model directory through ``AutoConfig``; the stub carries the five fields its scheduler reads). Its
block manager imports ``xxhash`` and ``numpy`` (``pip install xxhash``). The modules are loaded under private
names, so an installed ``nanovllm`` package is neither used nor disturbed.

The driver runs the scheduler as nano-vllm's ``LLMEngine.step`` does, without the model: ``schedule()``, then
``postprocess(seqs, token_ids, is_prefill)`` with one sampled token per scheduled sequence. nano-vllm schedules a
pass of prefills (admissions and readmissions) or a pass of decodes, never both, and preempts by recompute only
(the victim goes back to the head of the waiting queue, its blocks freed). Its prefix cache cannot be switched
off, so every sequence gets token values of its own (the same prompt lengths as the workload's): sequences with
equal tokens would share blocks, which vLLM's run (prefix caching off) and ours never do. A readmitted sequence
may still find its own freed blocks in that cache, as nano-vllm would.
"""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.bench.stepping import BLOCK_SIZE, CLOCK, Driver, Workload

WHERE = "https://github.com/GeeeekExplorer/nano-vllm"
_PACKAGE = "nanovllm"
_MODULES = ("nanovllm.sampling_params", "nanovllm.engine.sequence", "nanovllm.engine.scheduler")


class NanoVLLMUnavailable(ImportError):
    """The checkout given is not a nano-vllm checkout, or its scheduler cannot be imported; the message says
    what to do."""


@dataclass(frozen=True, slots=True)
class Config:
    """The stub of ``nanovllm.config.Config``: the fields nano-vllm's `Scheduler` reads."""

    max_num_seqs: int
    max_num_batched_tokens: int
    eos: int
    kvcache_block_size: int
    num_kvcache_blocks: int


@dataclass(frozen=True, slots=True)
class NanoVLLM:
    """nano-vllm's scheduler classes, loaded from a checkout (`load`), and the checkout's commit if known."""

    Scheduler: Any
    Sequence: Any
    SamplingParams: Any
    source: str


def load(checkout: str | Path) -> NanoVLLM:
    """nano-vllm's scheduler from `checkout` (a directory holding ``nanovllm/engine/scheduler.py``). Raises
    `NanoVLLMUnavailable` naming the file or the missing module."""
    root = Path(checkout).expanduser()
    package = root / _PACKAGE
    if not (package / "engine" / "scheduler.py").is_file():
        raise NanoVLLMUnavailable(
            f"{root} is not a nano-vllm checkout (no {package / 'engine' / 'scheduler.py'}); "
            f"git clone {WHERE} and pass its directory"
        )
    with _private_package(package):
        try:
            loaded = [importlib.import_module(name) for name in _MODULES]
        except ImportError as err:
            raise NanoVLLMUnavailable(
                f"nano-vllm's scheduler in {root} needs {err.name or err}: pip install xxhash numpy"
            ) from err
    sampling, sequence, scheduler = loaded
    return NanoVLLM(scheduler.Scheduler, sequence.Sequence, sampling.SamplingParams, _commit(root))


@contextmanager
def _private_package(package: Path):
    """``nanovllm`` and ``nanovllm.engine`` as bare packages over `package` (its ``__init__.py`` not run), with
    the stubbed ``nanovllm.config``, in `sys.modules` while the scheduler's modules import each other; every
    entry is put back as it was afterwards (the loaded modules live on in what imported them)."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == _PACKAGE}
    for name in saved:
        del sys.modules[name]
    stubs = {
        _PACKAGE: _bare(_PACKAGE, package),
        f"{_PACKAGE}.engine": _bare(f"{_PACKAGE}.engine", package / "engine"),
        f"{_PACKAGE}.config": types.ModuleType(f"{_PACKAGE}.config"),
    }
    stubs[f"{_PACKAGE}.config"].Config = Config  # type: ignore[attr-defined]
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == _PACKAGE]:
            del sys.modules[name]
        sys.modules.update(saved)


def _bare(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]  # a package whose submodules are found in `path`
    return module


def _commit(root: Path) -> str:
    """`root`'s git commit (from ``.git/HEAD``, without running git), or the directory when it is not known."""
    head = root / ".git" / "HEAD"
    try:
        ref = head.read_text(encoding="utf-8").strip()
        if ref.startswith("ref: "):
            ref = (root / ".git" / ref[5:]).read_text(encoding="utf-8").strip()
    except OSError:
        return str(root)
    return f"commit {ref[:12]}"


class NanoVLLMDriver(Driver):
    """nano-vllm's scheduler on a workload, settled into its regime; every `step()` is one full iteration
    (`stepping.Driver`): ``schedule()`` and ``postprocess()``, the model's reply built outside the timed calls."""

    def __init__(self, workload: Workload, nano: NanoVLLM) -> None:
        self.workload = workload
        nano.Sequence.block_size = BLOCK_SIZE  # a class attribute, as nano-vllm's LLMEngine sets it
        self.scheduler = nano.Scheduler(
            Config(
                max_num_seqs=workload.size,
                max_num_batched_tokens=workload.token_budget,
                eos=-1,
                kvcache_block_size=BLOCK_SIZE,
                num_kvcache_blocks=workload.gpu_blocks,
            )
        )
        params = nano.SamplingParams(max_tokens=workload.max_new_tokens, ignore_eos=True)
        self._tokens: dict[int, int] = {}  # seq_id -> the token value of that sequence (prefix cache: see module)
        for n, prompt in enumerate(workload.prompts):
            seq = nano.Sequence([n + 1] * len(prompt), params)
            self._tokens[seq.seq_id] = n + 1
            self.scheduler.add(seq)
        self.settle()

    def step(self) -> None:
        scheduler = self.scheduler
        waiting = len(scheduler.waiting)
        start = CLOCK()
        seqs, is_prefill = scheduler.schedule()
        scheduled = CLOCK()
        tokens = [self._tokens[seq.seq_id] for seq in seqs]
        replied = CLOCK()
        scheduler.postprocess(seqs, tokens, is_prefill)
        end = CLOCK()
        # a decode pass only ever adds to the waiting queue (its victims); a prefill pass preempts nobody
        preempted = 0 if is_prefill else len(scheduler.waiting) - waiting
        self.record(scheduled - start, (scheduled - start) + (end - replied), len(seqs), preempted)


__all__ = ["WHERE", "NanoVLLM", "NanoVLLMDriver", "NanoVLLMUnavailable", "load"]
