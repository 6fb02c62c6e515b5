"""The Python in the pages listed in PAGES (docs/) runs, and prints what the page says it prints.

Every ```python block is executed, in order, in one namespace. A ```text block that comes
right after a ```python block (only blank lines between) is that block's expected stdout,
compared exactly. Every ```text block must follow a Python block, so no output on the page
goes unchecked.
"""

import contextlib
import io
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = ["ir.md", "passes.md", "guide.md"]

# A fenced block: the opening fence with its language, the body, the closing fence alone on a line.
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def doc_blocks(text: str) -> list[tuple[str, str, int, str]]:
    """(language, body, 1-based line of the opening fence, text between the previous block and this one)."""
    blocks, previous_end = [], 0
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        blocks.append((m.group(1), m.group(2), line, text[previous_end:m.start()]))
        previous_end = m.end()
    return blocks


def examples(text: str) -> list[tuple[str, int, str | None]]:
    """(python source, its line, expected stdout or None) for every Python block, in order."""
    blocks = doc_blocks(text)
    out = []
    for i, (lang, body, line, before) in enumerate(blocks):
        if lang == "text":
            if i == 0 or blocks[i - 1][0] != "python" or before.strip():
                raise AssertionError(f"line {line}: a text block must directly follow a python block")
            continue
        if lang != "python":
            continue
        expected = None
        if i + 1 < len(blocks) and blocks[i + 1][0] == "text" and not blocks[i + 1][3].strip():
            expected = blocks[i + 1][1]
        out.append((body, line, expected))
    return out


def test_doc_block_extraction():
    text = "a\n```python\nprint(1)\n```\n\n```text\n1\n```\n```sh\nls\n```\n```python\nx = 2\n```\n"
    assert examples(text) == [("print(1)\n", 2, "1\n"), ("x = 2\n", 12, None)]
    with pytest.raises(AssertionError, match="must directly follow"):
        examples("```python\nx = 1\n```\nprose\n```text\n1\n```\n")


@pytest.mark.parametrize("page", PAGES)
def test_doc_examples_run_and_print_what_the_page_shows(page):
    doc = DOCS / page
    cases = examples(doc.read_text(encoding="utf-8"))
    assert cases, f"docs/{page} has no python blocks"
    namespace = {"__name__": "docs_" + page[:-3]}
    for source, line, expected in cases:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = compile("\n" * line + source, str(doc), "exec")  # tracebacks point at the page's lines
            exec(code, namespace)
        if expected is not None:
            assert stdout.getvalue() == expected, f"docs/{page}:{line}: printed output differs from the page"
