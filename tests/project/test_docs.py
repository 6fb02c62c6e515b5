"""The Python in the pages listed in PAGES (docs/) runs, and prints what the page says it prints.

Every ```python block is executed, in order, in one namespace. A ```text block that comes
right after a ```python block (only blank lines between) is that block's expected stdout,
compared exactly. Every ```text block must follow a Python block, so no output on the page
goes unchecked.
"""

import contextlib
import io

import pytest

from doc_examples import DOCS, examples

PAGES = ["ir.md", "passes.md", "guide.md"]


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
