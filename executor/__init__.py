"""executor: the torch side of kvstate — paged KV cache with a device and a host tier, a small Llama-style
model with paged attention, a deterministic sampler, and the engine loop that carries out the scheduler's plan;
and the commands that run them (`executor.commands`: `kvstate demo`, `soak`, `generate`).

`import kvstate` never imports this package (or torch). The names below are loaded on first use
(`lazy_loader.attach_stub`, from the names and modules `__init__.pyi` declares): `import executor`, and its
torch-free modules (`executor.commands`, `executor.faults`), import no torch; `executor.Engine` does.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
