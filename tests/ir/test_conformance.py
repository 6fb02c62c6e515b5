"""Conformance with the OpenXLA test corpus (../shared/corpus/xla_tests), when it is present.

Valid modules parse, print back byte for byte, and regenerate to a print that
XLA reads as the same module.  Every module in ``parser_invalid/`` (XLA refuses
all of them) is refused by parse + verify with hlo_tools' own errors.
"""

import pytest

import hlo_tools
from hlo_tools.xla import xla_bridge
from support import CORPUS_DIR, first_difference, read_exact, unless_xla_dropped_the_opcode

if not CORPUS_DIR.is_dir():
    pytest.skip(f"no corpus at {CORPUS_DIR}", allow_module_level=True)

INVALID_DIR = "parser_invalid"
VALID = sorted(p for p in CORPUS_DIR.glob("*/*.hlo") if p.parent.name != INVALID_DIR)
INVALID = sorted((CORPUS_DIR / INVALID_DIR).glob("*.hlo"))


def corpus_id(path) -> str:
    return f"{path.parent.name}/{path.stem}"


@pytest.mark.parametrize("path", VALID, ids=corpus_id)
def test_valid_module_round_trips(path):
    text = read_exact(path)
    module = hlo_tools.parse_module(text)
    printed = module.to_text()
    assert printed == text, first_difference(text, printed)
    with unless_xla_dropped_the_opcode():
        assert xla_bridge.same_meaning(module.to_text(regenerate=True), text)


@pytest.mark.parametrize("path", INVALID, ids=corpus_id)
def test_invalid_module_is_refused(path):
    text = read_exact(path)
    with pytest.raises((hlo_tools.HloParseError, hlo_tools.HloVerifyError)):
        hlo_tools.verify(hlo_tools.parse_module(text))


def test_corpus_is_complete():
    assert len(VALID) == 364
    assert len(INVALID) == 67
