"""Progress a person can read while the suite runs: every so often, one line saying which test directories are
running and how many tests are done and left.

pytest's own `console_output_style = "count"` (pyproject.toml) ends each line of dots with the tests done of all;
these lines add which part of the suite is running. With pytest-xdist the plugin runs in the controller, which
receives every worker's reports. `-p no:kvstate-progress` turns it off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import PurePosixPath

import pytest

__all__ = ["PLUGIN_NAME", "ProgressLines"]

PLUGIN_NAME = "kvstate-progress"
INTERVAL_S = 30.0


class ProgressLines:
    """Counts each test once, at its teardown report, and keeps the directory each worker reported last; at the
    first report `interval_s` seconds or more after the last line (or the start), writes one line."""

    def __init__(
        self,
        write_line: Callable[[str], None],
        total: Callable[[], int] | None = None,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write_line, self.interval_s, self.clock = write_line, interval_s, clock
        self.collected = 0
        self.total = total or (lambda: self.collected)
        self.started = self.last_line = clock()
        self.done = 0
        self.directory_of: dict[str, str] = {}  # worker id ("main" without xdist) -> the directory it reported last

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = len(session.items)  # after deselection

    @pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self.collected = len(ids)  # every worker collects the whole suite

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        self.done += 1
        gateway = getattr(getattr(report, "node", None), "gateway", None)  # set on a report from an xdist worker
        self.directory_of[getattr(gateway, "id", "main")] = str(PurePosixPath(report.nodeid.split("::")[0]).parent)
        now = self.clock()
        if now - self.last_line >= self.interval_s:
            self.last_line = now
            self.write_line(self.line(now))

    def line(self, now: float) -> str:
        total = self.total()
        elapsed = int(now - self.started)
        running = ", ".join(sorted(set(self.directory_of.values())))
        return (
            f"-- {self.done:,} of {total:,} tests done, {max(total - self.done, 0):,} left, "
            f"{elapsed // 60} min {elapsed % 60:02d} s in; running: {running}"
        )


def register(config: pytest.Config, interval_s: float = INTERVAL_S) -> None:
    """Registers the plugin where the terminal is: in the main process, never in an xdist worker."""
    if hasattr(config, "workerinput"):
        return

    def write_line(text: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")  # registered after conftests configure
        if reporter is None:
            return
        reporter.ensure_newline()  # after a file's results (without xdist)
        if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):  # after a worker's dots (xdist)
            reporter.write("\n")
        reporter.write_line(text)

    config.pluginmanager.register(ProgressLines(write_line, interval_s=interval_s), PLUGIN_NAME)
