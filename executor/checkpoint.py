"""Which loader a checkpoint path takes: a directory is a Hugging Face Llama (`executor.hf`), a file is a GGUF
checkpoint (`executor.gguf_llama`). `EngineConfig(checkpoint=PATH)` loads through `load_checkpoint`."""

from __future__ import annotations

from pathlib import Path

import torch

from executor.checkpoint_files import CheckpointError
from executor.gguf_llama import load_gguf_llama
from executor.hf import load_hf_llama
from executor.model import LlamaModel


def load_checkpoint(path: str | Path, *, dtype: torch.dtype, device: str | torch.device) -> LlamaModel:
    """The `LlamaModel` of the checkpoint at `path` (a directory or a GGUF file), read from local files only."""
    path = Path(path)
    if path.is_dir():
        return load_hf_llama(path, dtype=dtype, device=device)
    if path.exists():
        return load_gguf_llama(path, dtype=dtype, device=device)
    raise CheckpointError(
        "does not exist; pass a Hugging Face Llama directory (config.json, model.safetensors) or a GGUF file",
        path=path,
    )
