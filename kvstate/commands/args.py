"""Argument checks shared by the subcommands, all done before any work starts (and before torch is imported).

`argparse` types (`positive_int`, `non_negative_int`, `positive_multiple_of`, `positive_float`, `seconds`,
`device_name`) refuse a bad value with argparse's one-line usage error (exit 2), which `OptionParser` starts with
the option's flag (``--block-size must be a positive integer, got 0``). Every count has an upper bound
(`maximum`, required, and named in the error: a count far past anything the command can do is refused at once,
never discovered as a run that stalls while its memory grows); values are echoed as a short prefix.

The path checks (`input_file`, `input_dir`, `output_file`, `output_dir`) raise `UsageError`, which the command
line prints as one line with exit status 2. One rule holds for every output path: its parent directory exists,
or the command was given `--mkdir` (`add_mkdir_option`), which creates the missing directories at once; the error
names the path and what to do. The output checks leave nothing else behind: they probe writability with a
temporary entry that they remove at once.

Options several commands share are added by one function each, so they read the same everywhere:
`add_spec_option` (``--spec PATH``), `add_device_option` (``--device``, default ``auto``), `add_dtype_option`
(``--dtype``, default ``auto``: the engine's default for the device, float64 on the CPU and float32 on CUDA;
a command that prints text rather than proving equality defaults to float32),
`add_lifecycle_option` and `add_mkdir_option`. `check_cuda_driver` refuses ``--device cuda`` before torch is
imported on a machine without a GPU driver.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kvstate.errors import KVStateError
from kvstate.untrusted import shown

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# Files a GPU driver torch can use provides on Linux: NVIDIA's, ROCm's (torch.cuda runs on HIP) and WSL's.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
DTYPES = ("auto", "float64", "float32", "bfloat16", "float16")

# Upper bounds of the counts the commands take (each is named in the error that refuses a larger one).
MAX_REQUESTS = 100_000  # far past what a demo or a soak is for (their defaults: 48 and 2,000)
MAX_BLOCKS = 1 << 20  # blocks per tier
MAX_BLOCK_SIZE = 1 << 12  # tokens per block
MAX_TOKENS = 1 << 16  # tokens in a chunk, a prompt or a request's budget
MAX_HIDDEN_SIZE = 1 << 14
MAX_STAGES = 64  # pipeline stages or micro-batches in flight
MAX_SEED = (1 << 63) - 1  # torch seeds are 64-bit
MAX_STATES = 10**9  # states of one model-checking search


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


class OptionParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose error about one option's value starts with the option's flag
    (``--block-size must be a positive integer, got 0``), as the user typed it; argparse's own form is
    ``argument --block-size: must be ...``. Its subparsers are option parsers too."""

    def error(self, message: str) -> NoReturn:
        super().error(option_first(message))


def option_first(message: str) -> str:
    """`message` with argparse's ``argument FLAG: `` prefix turned into the flag itself: ``FLAG must be ...`` when
    the rest says what the value must be, ``FLAG: ...`` otherwise (a rest that already names the flag is kept)."""
    found = re.fullmatch(r"argument (\S+): (.*)", message, flags=re.DOTALL)
    if found is None:
        return message
    flags, rest = found.group(1).split("/"), found.group(2)
    if any(rest.startswith(f"{flag} ") for flag in flags):
        return rest
    flag = flags[-1]
    return f"{flag} {rest}" if rest.startswith("must be") else f"{flag}: {rest}"


class UsageError(KVStateError, ValueError):
    """A command-line value cannot be used; the message names the option and says what to pass instead."""


class BoundedInt:
    """An argparse type: an integer in [`minimum`, `maximum`] that `step` divides; `words` says what it must be
    ("a positive integer") and `name`, when given, is the setting named in the error."""

    def __init__(self, minimum: int, maximum: int, words: str, name: str | None, step: int = 1) -> None:
        self.minimum, self.maximum, self.words, self.name, self.step = minimum, maximum, words, name, step

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than Python reads
            raise argparse.ArgumentTypeError(f"expected {self.words}, got {shown(text)}") from None
        prefix = f"{self.name} must be" if self.name else "must be"
        if value < self.minimum or value % self.step:
            raise argparse.ArgumentTypeError(f"{prefix} {self.words}, got {shown(value)}")
        if value > self.maximum:
            raise argparse.ArgumentTypeError(
                f"{prefix} at most {self.maximum}, got {shown(value)}; this bound keeps a run within what the "
                "machine can do"
            )
        return value


def positive_int(name: str | None = None, *, maximum: int) -> BoundedInt:
    """An argparse type: an integer from 1 to `maximum` (`name`, when given, is the setting named in the error)."""
    return BoundedInt(1, maximum, "a positive integer", name)


def positive_multiple_of(step: int, name: str | None = None, *, maximum: int) -> BoundedInt:
    """An argparse type: a positive integer up to `maximum` that `step` divides."""
    return BoundedInt(step, maximum, f"a positive multiple of {step}", name, step)


def non_negative_int(name: str | None = None, *, maximum: int) -> BoundedInt:
    """An argparse type: an integer from 0 to `maximum`."""
    return BoundedInt(0, maximum, "an integer >= 0", name)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {shown(text)}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {shown(text)}")
    return value


def seconds(minimum: float, maximum: float) -> Callable[[str], float]:
    """An argparse type: a duration in seconds from `minimum` to `maximum` (finite, so timers never overflow)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {shown(text)}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum:g} and {maximum:g} seconds, got {shown(text)}")
        return value

    return parse


def device_name(text: str) -> str:
    """An argparse type: `auto`, `cpu`, `cuda` or `cuda:N` (whether CUDA is usable is checked once torch loads)."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {shown(text)}")
    return text


def check_cuda_driver(device: str | None) -> None:
    """Refuse ``--device cuda`` (or ``cuda:N``) at once on a Linux machine that has none of the files a GPU driver
    provides (`GPU_DRIVER_FILES`: NVIDIA, ROCm, WSL): torch could not use CUDA there, and importing torch to find
    that out takes seconds. Elsewhere, or where a driver is present, torch decides once it is imported."""
    if device is None or not device.startswith("cuda") or not sys.platform.startswith("linux"):
        return
    if any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return
    raise UsageError(
        f"--device {device}: this machine has no GPU driver (none of {', '.join(GPU_DRIVER_FILES)} exists), "
        "so torch cannot use CUDA; use 'cpu' or 'auto'"
    )


def add_device_option(parser: argparse.ArgumentParser, *, default: str | None = "auto", what: str = "") -> None:
    """`--device`: auto (CUDA if available), cpu, cuda or cuda:N."""
    parser.add_argument(
        "--device",
        type=device_name,
        default=default,
        help=f"auto (CUDA if available), cpu, cuda or cuda:N{what} (default {default or 'auto'})",
    )


def add_dtype_option(parser: argparse.ArgumentParser, what: str = "", default: str = "auto") -> None:
    """`--dtype`: the model and cache dtype (`default` unless given); `auto` is the engine's default for the
    device."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default,
        help=f"model and cache dtype; auto = float64 on the CPU, float32 on CUDA{what} (default %(default)s)",
    )


def dtype_setting(dtype: str) -> str | None:
    """The `EngineConfig.dtype` a `--dtype` value names (None: the engine's default for the device)."""
    return None if dtype == "auto" else dtype


def add_spec_option(parser: argparse.ArgumentParser) -> None:
    """`--spec PATH`: the specification to work on instead of the packaged one."""
    parser.add_argument("--spec", metavar="PATH", default=None, help="a spec TOML file (default: the packaged spec)")


def add_mkdir_option(parser: argparse.ArgumentParser) -> None:
    """`--mkdir`: create the missing parent directories of the command's output paths."""
    parser.add_argument(
        "--mkdir",
        action="store_true",
        help="create missing parent directories of the output paths (default: their parent must exist)",
    )


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


def output_file(path: str | os.PathLike, option: str, *, mkdir: bool = False) -> Path:
    """A file can be written at `path`: it is an existing writable regular file, or it can be created in its
    parent directory, which exists (or, with `mkdir`, is created now)."""
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
    _probe_creatable(_parent(path, option, mkdir), option, path)
    return path


def output_dir(path: str | os.PathLike, option: str, *, mkdir: bool = False) -> Path:
    """A directory at `path` can hold new files: it exists and is writable, or it can be created in its parent
    directory, which exists (or, with `mkdir`, is created now)."""
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
    _probe_creatable(_parent(path, option, mkdir), option, path)
    return path


def _parent(path: Path, option: str, mkdir: bool) -> Path:
    """The directory `path` would be created in; it must exist, unless `mkdir` creates it (with its parents)."""
    parent = path.absolute().parent
    if not parent.exists() and mkdir:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(
                f"{option} {path}: cannot create the directory {parent} ({err.strerror}); pass a path under a "
                "writable directory"
            ) from None
    if not parent.exists():
        raise UsageError(
            f"{option} {path}: the directory {parent} does not exist; create it first, or pass --mkdir to create it"
        )
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a directory; pass a path under a directory")
    return parent


def _probe_creatable(directory: Path, option: str, path: Path) -> None:
    """Entries can be created in the existing `directory` (probed, then removed)."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=directory))
    except OSError as err:
        raise UsageError(
            f"{option} {path}: cannot create entries in {directory} ({err.strerror}); "
            "pass a path under a writable directory"
        ) from None
