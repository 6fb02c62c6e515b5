"""The Python examples of the docs/ pages: what tests/project/test_docs.py runs, and the pages'
own tests (tests/passes/test_weight_update_sharding.py for docs/weight_update_sharding.md) too."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"

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
