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
_OWN_LINE = re.compile(r"(\.\.\./etrax/\S+?\.py):\d+:\d+")


def _printed(text: str) -> str:
    """Output as a page shows it: paths into the installation shortened, and no
    trailing blanks at line ends or at the end."""
    lines = [_INSTALL.sub(".../etrax/", line).rstrip() for line in text.splitlines()]
    return "\n".join(lines).strip("\n")


def _comparable(text: str) -> str:
    """`_printed` output with the line and column of etrax's own source locations
    masked: a page quoting a report (``.../etrax/nn/_rnn.py:123:27``) stays right
    when an edit shifts those lines, while the file, the function and every other
    character are still compared."""
    return _OWN_LINE.sub(r"\1:LINE:COL", _printed(text))


def _kind(code: str) -> str:
    lines = [line for line in code.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("# fragment:"):
        return "fragment"
    if lines and all(_SNIPPET.match(line) for line in lines):
        return "included"
    return "program"


@pytest.mark.slow
# brainstate 0.5.4's event layers use brainevent 0.2's deprecated names; Python hides
# such warnings from a reader's script (they come from library code)
@pytest.mark.filterwarnings("ignore:brainevent.* is deprecated:DeprecationWarning")
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
                assert _comparable(out.getvalue()) == _comparable(expected), f"{page}[block {k}]"
                checked += 1
    assert checked == len(shown), f"{page}: an output block follows no Python block"


def test_every_page_is_collected() -> None:
    assert "README.md" in PAGES and "docs/concepts/online-learning.md" in PAGES
    blocks = sum(len(_BLOCK.findall((ROOT / p).read_text())) for p in PAGES)
    assert blocks >= 25, blocks


def test_quoted_locations_inside_etrax_ignore_line_numbers_only() -> None:
    """A page's quoted report survives edits that shift etrax's own lines, and
    nothing else is masked: the file, a user's own locations and the text around."""
    shown = "etp_matmul at .../etrax/nn/_rnn.py:123:27 (GRUCell.update): traced"
    shifted = "etp_matmul at /site-packages/etrax/nn/_rnn.py:131:9 (GRUCell.update): traced"
    assert _comparable(shifted) == _comparable(shown)
    for other in (
        shown.replace("_rnn.py", "_lif.py"),
        shown.replace("traced", "instantaneous"),
        shown.replace("GRUCell", "LSTMCell"),
    ):
        assert _comparable(other) != _comparable(shown), other
    user = "etp_matmul at /home/me/model.py:12:3 (Net.update)"
    assert _comparable(user) != _comparable(user.replace(":12:3", ":13:3"))
