"""hlo_tools.xla.xla_bridge: XLA's parser, printers and proto conversion behind one module."""

import pytest

from hlo_tools.xla import xla_bridge

ADD = """HloModule add_module

ENTRY main {
  p = f32[4]{0} parameter(0)
  ROOT sum = f32[4]{0} add(p, p)
}
"""

# The same computation as ADD with other instruction names and XLA's '%' style.
ADD_RENAMED = """HloModule add_module

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x"}
  ROOT %doubled = f32[4]{0} add(f32[4]{0} %x, f32[4]{0} %x)
}
"""

MULTIPLY = ADD.replace("add(p, p)", "multiply(p, p)")


def test_xla_parse_returns_xla_module():
    module = xla_bridge.xla_parse(ADD)
    assert module.name == "add_module"


def test_xla_parse_error_carries_xla_message():
    with pytest.raises(xla_bridge.XlaBridgeError, match=r"expects '=' in instruction"):
        xla_bridge.xla_parse("HloModule m\nENTRY e {\n  ROOT p parameter(0)\n}\n")


def test_xla_parse_rejects_bytes():
    with pytest.raises(TypeError):
        xla_bridge.xla_parse(ADD.encode())


def test_canonical_text_ignores_names_and_metadata():
    assert xla_bridge.canonical_text(ADD) == xla_bridge.canonical_text(ADD_RENAMED)
    assert "tmp_0" in xla_bridge.canonical_text(ADD)


def test_same_meaning():
    assert xla_bridge.same_meaning(ADD, ADD_RENAMED)
    assert not xla_bridge.same_meaning(ADD, MULTIPLY)


def test_proto_round_trip():
    proto = xla_bridge.text_to_proto(ADD)
    assert isinstance(proto, bytes) and proto
    text = xla_bridge.proto_to_text(proto)
    assert "ROOT %sum = f32[4]{0} add(%p, %p)" in text
    assert xla_bridge.same_meaning(text, ADD)
    assert xla_bridge.proto_to_text(proto, canonical=True) == xla_bridge.canonical_text(ADD)


def test_proto_to_text_rejects_garbage():
    with pytest.raises(xla_bridge.XlaBridgeError, match="module proto"):
        xla_bridge.proto_to_text(b"\xff\x00 not a proto")
