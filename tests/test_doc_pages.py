"""The Python blocks of the documentation pages listed here run as written.

Each block is a complete program: it runs in a fresh namespace, in order, and
must finish without an exception."""

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ("docs/tutorials/bring-your-own-model.md", "docs/concepts/learning-rules.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for k, match in enumerate(_BLOCK.finditer(text)):
            found.append((page, k, match.group(1)))
    return found


@pytest.mark.parametrize(("page", "index", "code"), _blocks(), ids=lambda v: str(v)[:40])
def test_documentation_block_runs(page: str, index: int, code: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{page}[block {index}]", "exec"), {"__name__": "__doc_block__"})
    assert out.getvalue() or "print" not in code
