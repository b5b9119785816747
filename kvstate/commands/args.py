"""Argument checks shared by the subcommands, all done before any work starts (and before torch is imported).

`argparse` types (`positive_int`, `non_negative_int`, `positive_float`, `device_name`) refuse a bad value with
argparse's one-line usage error (exit 2). The path checks (`input_file`, `input_dir`, `output_file`,
`output_dir`) raise `UsageError`, which the command line prints as one line with exit status 2. The output
checks leave nothing behind: they probe writability with a temporary entry that they remove at once.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstate.errors import KVStateError

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def add_lifecycle_option(parser: argparse.ArgumentParser, what: str) -> None:
    """`--lifecycle {machine,compiled}`: which implementation fires the lifecycle's transitions in `what`."""
    from kvstate.config import LIFECYCLES

    parser.add_argument(
        "--lifecycle",
        choices=LIFECYCLES,
        default=LIFECYCLES[0],
        help=(
            f"what fires the lifecycle's transitions in {what}: the transitions machine built from the spec "
            "(default) or the table compiled from the same spec; a differential test proves both give "
            "byte-identical traces"
        ),
    )


class UsageError(KVStateError, ValueError):
    """A command-line value cannot be used; the message names the option and says what to pass instead."""


def _integer(minimum: int, words: str, name: str | None, step: int = 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None
        if value < minimum or value % step:
            prefix = f"{name} must be" if name else "must be"
            raise argparse.ArgumentTypeError(f"{prefix} {words}, got {value}")
        return value

    return parse


def positive_int(name: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= 1 (`name`, when given, is the setting named in the error)."""
    return _integer(1, "a positive integer", name)


def positive_multiple_of(step: int, name: str | None = None) -> Callable[[str], int]:
    """An argparse type: a positive integer that `step` divides."""
    return _integer(step, f"a positive multiple of {step}", name, step)


def non_negative_int(name: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= 0."""
    return _integer(0, "an integer >= 0", name)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def device_name(text: str) -> str:
    """An argparse type: `auto`, `cpu`, `cuda` or `cuda:N` (whether CUDA is usable is checked once torch loads)."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def input_file(path: str | os.PathLike, option: str) -> Path:
    """`path` names an existing regular file that can be read."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; pass a file")
    if not path.exists():
        raise UsageError(f"{option} {path} does not exist; pass an existing file")
    if not path.is_file() or not os.access(path, os.R_OK):
        raise UsageError(f"{option} {path} is not a readable regular file")
    return path


def input_dir(path: str | os.PathLike, option: str) -> Path:
    """`path` names an existing directory that can be read."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{option} {path} does not exist; pass an existing directory")
    if not path.is_dir():
        raise UsageError(f"{option} {path} is not a directory; pass a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{option} {path} cannot be read")
    return path


def output_file(path: str | os.PathLike, option: str) -> Path:
    """A file can be written at `path`: it is an existing writable regular file, or it can be created."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; pass a file name")
    if path.exists():
        if not path.is_file():
            raise UsageError(f"{option} {path} exists and is not a regular file; pass another file name")
        try:
            with path.open("ab"):
                pass
        except OSError as err:
            raise UsageError(f"{option} {path} cannot be written ({err.strerror}); pass a writable file") from None
        return path
    _probe_creatable(path.parent, option, path)
    return path


def output_dir(path: str | os.PathLike, option: str) -> Path:
    """A directory at `path` can hold new files: it exists and is writable, or it can be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} exists and is not a directory; pass a directory")
    if path.is_dir():
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as err:
            raise UsageError(f"{option} {path} is not writable ({err.strerror}); pass a writable directory") from None
        return path
    _probe_creatable(path, option, path)
    return path


def _probe_creatable(directory: Path, option: str, path: Path) -> None:
    """Directories up to `directory` can be created under its nearest existing ancestor (probed, then removed)."""
    ancestor = directory.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{option} {path}: {ancestor} is not a directory; pass a path under a writable directory")
    try:
        os.rmdir(tempfile.mkdtemp(dir=ancestor))
    except OSError as err:
        raise UsageError(
            f"{option} {path}: cannot create entries in {ancestor} ({err.strerror}); "
            "pass a path under a writable directory"
        ) from None
