"""A chat template cannot hang the process or exhaust its memory: each hostile template is refused with one line
naming the file and the field, and a template within the limits still renders.

Each hostile template is rendered in a child process with a timeout and a cap on its address space, so that a
regression fails the test (a traceback, a `MemoryError`, a timeout) instead of hanging or exhausting the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jinja2")  # an optional dependency (the smollm2 extra)

from executor.chat import render_chat
from executor.chat_sandbox import MAX_ITEMS, MAX_TEXT_CHARS, BoundedSandbox, TemplateRefused, budget
from executor.checkpoint_files import CheckpointError

CHILD_TIMEOUT_S = 30  # a guard against a hang, far above what a refusal takes
CHILD_ADDRESS_SPACE = 2 << 30  # bytes: a template that builds gigabytes fails with MemoryError instead
MOST_MEMORY_MB = 200

HOSTILE = {
    "nested-ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested-lists": "{% set l = range(60000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
    "power": "{% set x = 10**(10**9) %}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "string-times-1e9": "{% set x = 'a' * 10**9 %}",
    "string-times-1e11": "{{ 'a' * 10**11 }}",
    "list-times-1e9": "{{ [0] * 10**9 }}",
    "list-doubling": "{% set ns = namespace(x=[0]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
    "percent-width": "{{ '%999999999s' % 'x' }}",
    "percent-star-width": "{{ '%*s' % (999999999, 'x') }}",
    "percent-precision": "{{ '%.999999999f' % 1.0 }}",
    "format-width": "{{ '{:999999999}'.format('x') }}",
    "format-filter": "{{ '%999999999s'|format('x') }}",
    "center-filter": "{{ 'x'|center(999999999) }}",
    "center-method": "{{ 'x'.center(999999999) }}",
    "indent-filter": "{{ ('\n' * 100000)|indent(100000) }}",
    "replace-filter": "{{ ('a' * 100000)|replace('', 'b' * 100000) }}",
    "replace-method": "{{ ('a' * 100000).replace('', 'b' * 100000) }}",
    "join-filter": "{{ ['a' * 1000000] * 1000|join }}",
    "join-method": "{{ ('x' * 1000000).join(['a', 'b', 'c']) }}",
    "concat-doubling": (
        "{% set ns = namespace(x='a') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}"
    ),
    "recursive-macro": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "nested-parentheses": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
}

CHILD = """
import json, resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from executor.chat import render_chat
from executor.checkpoint_files import CheckpointError
try:
    render_chat(sys.stdin.read(), [{{"role": "user", "content": "hi"}}], bos_token="", eos_token="",
                source=Path("model.gguf"))
    outcome = "rendered"
except CheckpointError as err:
    outcome = str(err)
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))  # reset by exec, not ru_maxrss
print(json.dumps({{"outcome": outcome, "rss_mb": int(peak.split()[1]) // 1024}}))
"""


@pytest.mark.parametrize("template", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_template_is_one_line_naming_file_and_field(template: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(limit=CHILD_ADDRESS_SPACE)],
        input=template,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    message = result["outcome"]
    assert message.startswith("model.gguf: field 'chat_template': cannot be rendered"), message
    assert "\n" not in message and len(message) < 400, message
    assert result["rss_mb"] < MOST_MEMORY_MB, result


def render(template: str) -> str:
    turns = [{"role": "user", "content": "hi"}]
    return render_chat(template, turns, bos_token="<s>", eos_token="</s>", source=Path("t"))


def test_templates_within_the_limits_still_render() -> None:
    assert render("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}") == "<s>[user] hi"
    assert len(render(f"{{{{ 'a' * {MAX_TEXT_CHARS} }}}}")) == MAX_TEXT_CHARS
    assert render(f"{{{{ ([0] * {MAX_ITEMS})|length }}}}") == str(MAX_ITEMS)
    assert render("{{ '%5s|%-3s|%.2f' % ('a', 'b', 1.5) }}{{ '{:>4}'.format('x') }}") == "    a|b  |1.50   x"
    assert render("{{ 'ab'|center(6) }}{{ 2 ** 100 }}{{ 'x' ~ 'y' }}") == "  ab  " + str(2**100) + "xy"


def test_one_past_each_limit_is_refused() -> None:
    for template in (f"{{{{ 'a' * {MAX_TEXT_CHARS + 1} }}}}", f"{{{{ ([0] * {MAX_ITEMS + 1})|length }}}}"):
        with pytest.raises(CheckpointError, match="more than"):
            render(template)


def test_the_line_budget_stops_a_loop() -> None:
    compiled = BoundedSandbox().from_string("{% for i in range(5000) %}{% endfor %}")
    compiled.render()  # within the default budget
    with pytest.raises(TemplateRefused, match="more than 1000 lines"), budget(lines=1000):
        compiled.render()
