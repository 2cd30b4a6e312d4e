"""Every Python block in README.md and docs/ runs as written, or is visibly marked.

A page's blocks run in order in one namespace, as a reader following the page
would run them, with JAX's standard dtype promotion (the suite's strict promotion
is a test setting, not what users run). Two kinds of block are not run:

- a *fragment*, whose first line is a ``# fragment: …`` comment saying what it
  assumes (visible in the rendered page);
- a block made only of ``--8<--`` snippet includes, whose source file is an
  example that its own test runs (listed in `INCLUDED`).

A ``text`` block right after an ``<!-- output -->`` comment (invisible in the
rendered page) is the output of the last Python block before it, and must be
what that block prints (source paths shortened to ``.../etrax/``).
"""

import contextlib
import io
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
INCLUDED = {"examples/custom_op.py": "tests/test_custom_op_tutorial.py"}
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::[^"]*)?"$')
_OUTPUT = re.compile(r"^<!-- output -->\n```text\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INSTALL = re.compile(r"\S*/etrax/")


def _printed(text: str) -> str:
    """Output as a page shows it: paths into the installation shortened, and no
    trailing blanks at line ends or at the end."""
    lines = [_INSTALL.sub(".../etrax/", line).rstrip() for line in text.splitlines()]
    return "\n".join(lines).strip("\n")


def _kind(code: str) -> str:
    lines = [line for line in code.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("# fragment:"):
        return "fragment"
    if lines and all(_SNIPPET.match(line) for line in lines):
        return "included"
    return "program"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run(page: str) -> None:
    text = (ROOT / page).read_text()
    namespace = {"__name__": "__doc_block__"}
    shown = {m.start(): m.group(1) for m in _OUTPUT.finditer(text)}
    blocks = list(_BLOCK.finditer(text))
    checked = 0
    for k, match in enumerate(blocks):
        code = match.group(1)
        kind = _kind(code)
        if kind == "fragment":
            continue
        if kind == "included":
            for line in code.strip().splitlines():
                found = _SNIPPET.match(line)
                assert found is not None
                source = found.group(1)
                assert source in INCLUDED, f"{page}[block {k}] includes {source}, run by no test"
                assert (ROOT / INCLUDED[source]).exists()
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
            exec(compile(code, f"{page}[block {k}]", "exec"), namespace)
        assert out.getvalue() or "print(" not in code, f"{page}[block {k}] printed nothing"
        end = blocks[k + 1].start() if k + 1 < len(blocks) else len(text)
        for at, expected in shown.items():
            if match.end() <= at < end:
                assert _printed(out.getvalue()) == _printed(expected), f"{page}[block {k}]"
                checked += 1
    assert checked == len(shown), f"{page}: an output block follows no Python block"


def test_every_page_is_collected() -> None:
    assert "README.md" in PAGES and "docs/concepts/online-learning.md" in PAGES
    blocks = sum(len(_BLOCK.findall((ROOT / p).read_text())) for p in PAGES)
    assert blocks >= 25, blocks
