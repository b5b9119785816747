"""The `kvstate` command line. Each subcommand lives in its own module with a `register(subparsers)`: the core's
torch-free ones under `kvstate.commands`, and those of layers above the core (the executor's `demo`, `generate`,
`soak` and `bench`, in `executor.commands`) named in the `kvstate.commands` entry-point group of an installed
distribution, so that the core never imports the executor. Importing a command module imports no torch.

A bad command line never prints a traceback: argparse refuses malformed options with the subcommand's own usage,
each command checks its values and paths before it starts work (and before torch is imported), and an expected
error (`KVStateError`, an `OSError` on a path the user named, an optional dependency that is not installed, named
with the extra that installs it: `kvstate.extras`) is one line on stderr. All of these exit with 2. An interruption
(Ctrl-C) is one line too, saying where the run stopped and what had completed, with exit status 130. Listing the
commands (`kvstate --help`) imports no torch, so it works where only the core is installed.
A warning raised while a command runs (the engine's `HostTierFallbackWarning`, say) is one line of its own on
stderr, ``kvstate COMMAND: warning: ...``, never Python's default display with a source line. Everything printed
here is inert text (`kvstate.terminal.inert`): a message cannot carry terminal control sequences.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType

from kvstate.commands import check, diagram, export, report, spec_summary, validate
from kvstate.commands.args import OptionParser
from kvstate.errors import KVStateError
from kvstate.extras import missing_extra
from kvstate.terminal import inert

CORE_COMMANDS = {
    "check": check,
    "diagram": diagram,
    "export": export,
    "report": report,
    "spec": spec_summary,
    "validate": validate,
}
COMMAND_GROUP = "kvstate.commands"  # the entry-point group of the commands other layers contribute

USAGE_ERROR = 2
INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(
        prog="kvstate",
        description="A formally specified request lifecycle for paged KV caches with a GPU tier and a host tier.",
    )
    parser.add_argument("--version", action="version", version=f"kvstate {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for _, module in sorted(command_modules().items()):  # `--help` lists them by name
        module.register(subparsers)
    for subparser in subparsers.choices.values():
        subparser.set_defaults(subparser=subparser)  # unknown options are then reported with its usage
    return parser


def command_modules() -> dict[str, ModuleType]:
    """Every subcommand's module by command name: the core's, then each one an installed distribution names in the
    `kvstate.commands` entry-point group. Raises `KVStateError` when a contributed command takes a core command's
    name, or when its module cannot be imported (the message names the entry point and its module)."""
    modules: dict[str, ModuleType] = dict(CORE_COMMANDS)
    for entry in metadata.entry_points(group=COMMAND_GROUP):
        if entry.name in CORE_COMMANDS:
            raise KVStateError(
                f"entry point {entry.name} = {entry.value} ({COMMAND_GROUP}) takes the name of a core command; "
                "rename it in the distribution that declares it"
            )
        try:
            modules[entry.name] = entry.load()
        except ImportError as err:
            raise KVStateError(
                f"the {entry.name!r} command's module {entry.value} cannot be imported ({err}); reinstall kvstate "
                "(pip install .) from a complete source tree"
            ) from err
    return modules


def version() -> str:
    """The installed distribution's version ("unknown" when kvstate runs from a source tree it was not installed
    from)."""
    try:
        return metadata.version("kvstate")
    except metadata.PackageNotFoundError:
        return "unknown"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse `argv`; argparse errors raise `SystemExit(2)` after printing the right subcommand's usage."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (2 for every usage error, with one line on stderr)."""
    try:
        args = parse(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already printed by argparse
        return exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
    except KVStateError as err:  # a contributed command that cannot be registered
        print(inert(f"kvstate: error: {err}"), file=sys.stderr)
        return USAGE_ERROR
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; an expected error is one line on stderr (exit 2), an interruption exit 130."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(args.command)
            return int(args.run(args) or 0)
    except KVStateError as err:
        return _error(args.command, str(err))
    except OSError as err:  # a path named on the command line failed while the command was using it
        where = f"{err.filename}: " if err.filename else ""
        return _error(args.command, f"{where}{err.strerror or err}")
    except ModuleNotFoundError as err:  # an optional dependency that `pip install .` leaves out
        message = missing_extra(err)
        if message is None:
            raise
        return _error(args.command, message)
    except KeyboardInterrupt as err:
        print(inert(f"kvstate {args.command}: {interrupted(err)}"), file=sys.stderr)
        return INTERRUPTED


def interrupted(err: KeyboardInterrupt) -> str:
    """The one line that reports an interruption: the notes the layers it crossed added (where it stopped, what had
    completed, what it left broken), without their "kvstate: " prefixes, after "interrupted" unless the first note
    already starts with it."""
    notes = [str(note).removeprefix("kvstate: ") for note in getattr(err, "__notes__", ())]
    if not notes or not notes[0].startswith("interrupted"):
        notes.insert(0, "interrupted")
    return "; ".join(notes)


def _error(command: str, message: str) -> int:
    print(inert(f"kvstate {command}: error: {message}", keep="\n"), file=sys.stderr)
    return USAGE_ERROR


def _warning_printer(command: str):
    """A `warnings.showwarning` that prints a warning as one line of its own on stderr."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(inert(f"kvstate {command}: warning: {message}"), file=sys.stderr)

    return show


if __name__ == "__main__":
    raise SystemExit(main())
