"""HLO text -> HloModule.

Accepts every form XLA prints (JAX's short form, TF's long form with operand shapes, dumps before and
after optimization, compact get-tuple-elements `%t#0`, scheduled modules, async shorthand, stack-frame
tables) and XLA's hand-written extensions (nested anonymous instructions, omitted shapes, comments
anywhere). Every error is an HloParseError with a 1-based line and column; nesting depth is bounded so
no input can exhaust the stack, and no value is materialised at parse time, so no input can allocate
without bound.

Each instruction, computation and the header remember their source span, which is how the printer
reproduces unmodified text byte for byte.
"""
from __future__ import annotations

import functools
import operator
import re

from hlo_tools.garbage_collection import garbage_collection_paused
from hlo_tools.ir import attributes as A
from hlo_tools.ir.attributes import COMPUTATION_ATTRS
from hlo_tools.ir.errors import HloParseError
from hlo_tools.ir.hlo import HloComputation, HloInstruction, HloModule
from hlo_tools.ir.literal import Literal
from hlo_tools.ir.opcodes import OPCODES, is_opcode
from hlo_tools.ir.shape import DTYPE_BITS, UNBOUNDED, Layout, Shape

BYTE_ORDER_MARK = "\ufeff"  # dropped at the start of the text
MAX_NESTING = 256  # deeper tuples/brackets than any real module; XLA's own parser crashes near 10k

_WS = re.compile(r"(?:\s+|/\*.*?\*/|//[^\n]*)*", re.S)
_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_ATTR_NAME = re.compile(r"([A-Za-z_][\w.\-]*)\s*=(?!=)")
_INT = re.compile(r"-?\d+")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_OUTER_CHUNK = re.compile(r'[^\s,(){}\[\]"]+')
_INNER_CHUNK = re.compile(r'[^(){}\[\]"]+')
_LEAF_GROUP = re.compile(r'\([^(){}\[\]"]*\)|\[[^(){}\[\]"]*\]|\{[^(){}\[\]"]*\}')
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_LAYOUT_SIMPLE = re.compile(r"\{\s*(\d+(?:\s*,\s*\d+)*)?\s*\}")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_SPACE = re.compile(r"\s*")
_UNCOMMENTED_ATTRS = frozenset({"metadata", "frontend_attributes", "backend_config"}) | A.QUOTED_ATTRS
_CLOSE = {")": "(", "]": "[", "}": "{"}
_FAST_OPCODES = frozenset(OPCODES)
_STACK_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_SHAPE_CACHE: dict[str, Shape] = {}
_ATTR_CACHE: dict[tuple[str, str], object] = {}
_LITERAL_CACHE: dict[tuple[Shape, str], Literal] = {}
_LITERAL_CACHE_LIMIT = 20_000
_SHORT_LITERAL = 200  # longer literals are parsed afresh (and not kept) each time
_SHAPE_RE = (r"[a-z][a-z0-9]*\[[^\]\n]*\](?:\{[^{}\n]*\})?"
             r"|\((?:[^()\n]|\((?:[^()\n]|\([^()\n]*\))*\))*\)")
# `ROOT %name = shape opcode(operands)` on one line, operands without nested parentheses.
_FAST_HEAD = re.compile(r"(ROOT[ \t]+)?(%?([A-Za-z_][\w.\-]*))[ \t]*=[ \t]*(" + _SHAPE_RE
                        + r")[ \t]+([a-z][a-z0-9\-]*)\(([^()\n]*)\)")
_OPERAND_RE = (r"\s*(?:/\*index=\d+\*/)?\s*(?:([a-z][a-z0-9]*\[[^\]]*\](?:\{[^{}]*\})?)\s+)?"
               r"%?([A-Za-z_][\w.\-]*)\s*")
_FAST_OPERAND = re.compile(_OPERAND_RE)
_ARRAY_RE = r"[a-z][a-z0-9]*\[[^\]\n]*\](?:\{[^{}\n]*\})?"
_FAST_SIGNATURE = re.compile(r"\(((?:[^()\n])*)\)[ \t]*->[ \t]*(" + _SHAPE_RE + r")")
_FAST_PARAM = re.compile(r"([A-Za-z_][\w.\-]*)[ \t]*:[ \t]*(" + _ARRAY_RE + r")")
# Possessive (`++`, `*+`): the same matches as plain repeats here, without retrying every split of a run
# of characters, which made attribute matching several times slower.
_STR_RE = r'"(?:[^"\\]++|\\.)*+"'
_BRACED_RE = (r"\{(?:[^{}\"]++|" + _STR_RE + r"|\{(?:[^{}\"]++|" + _STR_RE + r"|\{(?:[^{}\"]++|" + _STR_RE
              + r")*+\})*+\})*+\}")
# `, key=value` where value is a word, a string, or braces nested at most three deep.
_FAST_ATTR_RE = (r"[ \t]*,[ \t]*([A-Za-z_][\w.\-]*)=(" + _STR_RE + "|" + _BRACED_RE
                 + r"|[^\s,{}()\"\[\]]+)(?=[\s,)}]|$)")
_FAST_ATTR = re.compile(_FAST_ATTR_RE)
# One whole ordinary instruction line, preceded by its blank space (consumed by _fast_lines); the
# attributes run to the line's last non-blank character (greedy, then one step back: a lazy `*?` that
# tries the end-of-line lookahead at every character costs twice as much).
_FAST_LINE = re.compile(r"[ \t]*(?:\n[ \t]*)+((ROOT[ \t]+)?(%?([A-Za-z_][\w.\-]*))[ \t]*=[ \t]*(" + _SHAPE_RE
                        + r")[ \t]+([a-z][a-z0-9\-]*)\(([^()\n]*)\)((?:[^\n]*[^ \t\n])?))(?=[ \t]*\n)")
_FAST_ATTR_PIECE = re.compile("(" + _FAST_ATTR_RE.replace("([A-Za-z_]", "(?P<k>[A-Za-z_]", 1).replace("=(", "=(?P<v>", 1) + ")")
_FAST_ATTRS = re.compile("(?:" + _FAST_ATTR_RE.replace("([A-Za-z_]", "(?:[A-Za-z_]").replace("=(", "=(?:") + ")*")
_FAST_OPERAND_LIST = re.compile(_OPERAND_RE.replace("(?:([", "(?:(?:[").replace("%?([", "%?(?:[")
                                + "(?:," + _OPERAND_RE.replace("(?:([", "(?:(?:[").replace("%?([", "%?(?:[") + ")*")


_INTERNAL_ERRORS = (RecursionError, ValueError, IndexError, KeyError, TypeError, AttributeError, OverflowError)


def parse_module(text: str, *, lazy_bodies: bool = False) -> HloModule:
    """Parse HLO text into an HloModule; raises HloParseError (with .line/.column) on bad input.

    `lazy_bodies=True` parses only the entry computation's body now: every other computation
    keeps its body as text until something reads it (`comp.instructions`, `comp.root`, ...), and
    is printed as that text while unread. Its errors surface when it is read, as the same
    HloParseError. Made for text XLA printed, where each body ends at the first line starting
    with `}`; other text that cannot be cut that way is parsed eagerly (errors included). It
    saves most of the parse when a pass reads few computations (fusion bodies).
    """
    if not isinstance(text, str):
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise HloParseError(f"input is not UTF-8 text (byte {e.start})", 1, 1) from None
        else:
            raise TypeError(f"parse_module expects str, got {type(text).__name__}")
    text = text.removeprefix(BYTE_ORDER_MARK)  # editors on Windows start UTF-8 files with one
    parser = _Parser(text)
    try:
        with garbage_collection_paused():  # a parse allocates many long-lived objects
            return parser.module(lazy_bodies)
    except HloParseError:
        if lazy_bodies:  # not cut where XLA ends bodies (or wrong): the eager parse knows which
            return parse_module(text)
        raise
    except _INTERNAL_ERRORS as e:
        # A parser bug must still surface as the documented error type; "internal error" marks it.
        raise parser.error(f"internal error while parsing: {type(e).__name__}: {e}") from e


def parse_shape(text: str) -> Shape:
    """Parse a shape such as `f32[2,3]{1,0}` or `(f32[], s32[4])`."""
    p = _Parser(text)
    p.skip()
    shape = p.shape()
    p.skip()
    if p.pos != len(text):
        raise p.error("unexpected text after the shape")
    return shape


_first = operator.itemgetter(0)


def _fast_literal(shape: Shape, text: str) -> Literal | None:
    """The literal of a one-line `constant(text)`, shared with equal ones; None: the general path decides.

    Only text the general path would capture unchanged (no surrounding blank, no comment) is taken.
    """
    if not text or text[0].isspace() or text[-1].isspace() or "/*" in text:
        return None
    try:
        literal = Literal.parse(shape, text)
    except A.AttrError:
        return None  # the general path reports the error with its position
    if len(text) < _SHORT_LITERAL and len(_LITERAL_CACHE) < _LITERAL_CACHE_LIMIT:
        _LITERAL_CACHE[(shape, text)] = literal
    return literal


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.n = len(text)
        self.module_: HloModule | None = None
        self.pending_computation_refs = []  # (instr, attr name, names, position, braced)
        self._line_mark = (0, 1)
        self.computation_names: set[str] = set()
        self.computations_by_name: dict[str, HloComputation] = {}
        self.compact_gtes: dict[tuple[HloInstruction, int], HloInstruction] = {}  # (tuple, index) -> its `%t#i`
        self.saw = {"sigil": False, "operand_shape": False, "operands": False, "signature": False}

    # -- low-level scanning --------------------------------------------------------------------------
    def error(self, message: str, pos: int | None = None) -> HloParseError:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return HloParseError(message, line, column)

    def line_of(self, pos: int) -> int:
        """1-based line of `pos`; counts forward from the last query, so a whole parse stays linear."""
        last_pos, last_line = self._line_mark
        if pos >= last_pos:
            line = last_line + self.text.count("\n", last_pos, pos)
        else:
            line = self.text.count("\n", 0, pos) + 1
        self._line_mark = (pos, line)
        return line

    def skip(self):
        self.pos = _WS.match(self.text, self.pos).end()

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < self.n else ""

    def expect(self, char: str, what: str | None = None):
        self.skip()
        if self.text.startswith(char, self.pos):
            self.pos += len(char)
            return
        seen = self.text[self.pos:self.pos + 12].split("\n")[0] or "end of input"
        raise self.error(f"expects '{char}'{' ' + what if what else ''}, saw '{seen}'")

    def accept(self, char: str) -> bool:
        self.skip()
        if self.text.startswith(char, self.pos):
            self.pos += len(char)
            return True
        return False

    def name(self, what: str = "name") -> str:
        self.skip()
        m = _NAME.match(self.text, self.pos)
        if not m:
            seen = self.text[self.pos:self.pos + 12].split("\n")[0] or "end of input"
            raise self.error(f"expects {what}, saw '{seen}'")
        self.pos = m.end()
        return m.group(1)

    def keyword_ahead(self, word: str) -> bool:
        m = _NAME.match(self.text, self.pos)
        return bool(m) and m.group(0) == word

    def integer(self) -> int:
        self.skip()
        m = _INT.match(self.text, self.pos)
        if not m:
            raise self.error("expects integer")
        self.pos = m.end()
        return int(m.group(0))

    def capture_value(self) -> str:
        """The raw text of an attribute value: bracket-balanced, ending at a top-level ',' or space."""
        text, i, n = self.text, self.pos, self.n
        stack = []
        while i < n:
            c = text[i]
            if c == '"':
                m = _STRING.match(text, i)
                if not m:
                    raise self.error("unterminated string", i)
                i = m.end()
            elif c in "([{":
                if stack and len(stack) < MAX_NESTING:
                    m = _LEAF_GROUP.match(text, i)
                    if m is not None:  # a whole innermost group (`{0}`, `[256]`) in one step
                        i = m.end()
                        continue
                stack.append(c)
                if len(stack) > MAX_NESTING:
                    raise self.error("attribute value nested too deeply", i)
                i += 1
            elif c in ")]}":
                if not stack:
                    break
                if stack.pop() != _CLOSE[c]:
                    raise self.error(f"unbalanced '{c}' in attribute value", i)
                i += 1
                if not stack and c == "}" and text[self.pos] == "{":
                    break  # a braced value ends with its closing brace
            elif stack:
                m = _INNER_CHUNK.match(text, i)
                i = m.end() if m else i + 1
            elif c == "," or c.isspace():
                break
            else:
                m = _OUTER_CHUNK.match(text, i)
                i = m.end()
        if stack:
            raise self.error(f"unclosed '{stack[-1]}' in attribute value", self.pos)
        if i == self.pos:
            raise self.error("expects attribute value")
        if text.startswith(" {", i) and text.startswith("mesh[", self.pos):  # mesh['x'=2] {'x'} replica groups
            close = text.find("}", i)
            if close < 0:
                raise self.error("unclosed '{' in attribute value", i + 1)
            i = close + 1
        value = text[self.pos:i]
        self.pos = i
        return value

    def capture_until_close(self) -> str:
        """Raw text up to (not including) the ')' that closes the current group."""
        text, i, n, depth = self.text, self.pos, self.n, 0
        while i < n:
            c = text[i]
            if c in "([{":
                depth += 1
                if depth > MAX_NESTING:
                    raise self.error("literal nested too deeply", i)
            elif c in ")]}":
                if depth == 0:
                    if c != ")":
                        raise self.error(f"unexpected '{c}'", i)
                    break
                depth -= 1
            elif c == "/" and text.startswith("/*", i):
                end = text.find("*/", i + 2)
                if end < 0:
                    raise self.error("unterminated comment", i)
                i = end + 2
                continue
            i += 1
        if i >= n:
            raise self.error("expects ')'", self.pos)
        value = text[self.pos:i]
        self.pos = i
        return value

    # -- shapes ---------------------------------------------------------------------------------------
    def shape(self, depth: int = 0) -> Shape:
        self.skip()
        if depth > MAX_NESTING:
            raise self.error("shape nested too deeply")
        if self.peek() == "(":
            start = self.pos
            self.pos += 1
            elements = []
            self.skip()
            if self.peek() != ")":
                while True:
                    elements.append(self.shape(depth + 1))
                    self.skip()
                    if self.peek() == ",":
                        self.pos += 1
                        continue
                    break
            self.skip()
            if self.peek() != ")":
                raise self.error("expects ')' at the end of the tuple shape", self.pos if self.pos < self.n else start)
            self.pos += 1
            shape = Shape.tuple(elements)
            if len(_SHAPE_CACHE) < 100_000:  # e.g. the results of multi-output fusions, for the fast paths
                _SHAPE_CACHE.setdefault(self.text[start:self.pos], shape)
            return shape
        m = _ARRAY_SHAPE.match(self.text, self.pos)
        if not m:
            raise self.error("expected primitive type")
        start = self.pos
        dtype = m.group(1)
        self.pos = m.end()
        layout_text = ""
        if self.pos < self.n and self.text[self.pos] == "{":
            end = self.text.find("}", self.pos)
            if end < 0:
                raise self.error("unterminated layout")
            inner = self.text.find("{", self.pos + 1)
            if 0 <= inner < end:  # layouts hold no nested braces except in P(...) physical shapes
                end = self._balanced_end(self.pos)
            layout_text = self.text[self.pos:end + 1]
            self.pos = end + 1
        key = self.text[start:self.pos]
        cached = _SHAPE_CACHE.get(key)
        if cached is not None:
            return cached
        shape = self._array_shape(dtype, m.group(2), layout_text, start)
        if len(_SHAPE_CACHE) < 100_000:
            _SHAPE_CACHE[key] = shape
        return shape

    def _balanced_end(self, i: int) -> int:
        depth = 0
        while i < self.n:
            c = self.text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return i
            i += 1
        raise self.error("unterminated layout")

    def _array_shape(self, dtype: str, dims_text: str, layout_text: str, start: int) -> Shape:
        if dtype == "token":
            return Shape.token()
        if dtype == "opaque":
            return Shape("opaque")
        if dtype not in DTYPE_BITS:
            raise self.error(f"unknown primitive type '{dtype}'", start)
        dims, dynamic = [], []
        body = dims_text.strip()
        if body:
            for piece in body.split(","):
                p = piece.strip()
                if p == "?":
                    dims.append(UNBOUNDED)
                    dynamic.append(True)
                elif p.startswith("<="):
                    if not p[2:].strip().isdigit():
                        raise self.error(f"bad dimension '{p}'", start)
                    dims.append(int(p[2:]))
                    dynamic.append(True)
                elif p.isdigit():
                    dims.append(int(p))
                    dynamic.append(False)
                else:
                    raise self.error(f"bad dimension '{p}'", start)
        layout = None
        if layout_text:
            m = _LAYOUT_SIMPLE.fullmatch(layout_text)
            if m:
                body = m.group(1)
                layout = Layout(int(x) for x in body.split(",")) if body else Layout(())
            else:
                layout = self._layout(layout_text, start)
            if layout.minor_to_major and sorted(layout.minor_to_major) != list(range(len(dims))):
                raise self.error(f"layout {layout_text} does not match rank {len(dims)}", start)
        return Shape(dtype, dims, dynamic, layout)

    def _layout(self, text: str, start: int) -> Layout:
        body = text[1:-1]
        head, colon, extra = body.partition(":")
        head = head.strip()
        try:
            m2m = [int(x) for x in head.split(",")] if head else []
        except ValueError:
            raise self.error(f"bad layout '{text}'", start) from None
        if colon:
            dlt = re.match(r"\s*D\(([^)]*)\)", extra)
            if dlt and not all(t.strip().rstrip("+~") in ("D", "C", "S") for t in dlt.group(1).split(",")):
                raise self.error("expected a DimLevelType abbreviation (D, C, or S)", start)
            if "P(" in extra and not dlt:
                raise self.error(f"Layout has physical shape, but is not for a sparse array: {text}", start)
        return Layout(m2m, extra)

    # -- module ---------------------------------------------------------------------------------------
    def module(self, lazy: bool = False) -> HloModule:
        self.skip()
        if not self.keyword_ahead("HloModule"):
            raise self.error("expects 'HloModule'")
        header_start = self.pos
        self.pos += len("HloModule")
        name = self.name("module name")
        if self.peek() == ":":  # an old spelling: `HloModule name:`
            self.pos += 1
        module = HloModule(name)
        self.module_ = module
        module._source = self.text
        while True:
            save = self.pos
            self.skip()
            if self.peek() != ",":
                self.pos = save
                break
            self.pos += 1
            self.skip()
            key_pos = self.pos
            key = self.name("attribute name")
            self.expect("=")
            self.skip()
            value_pos = self.pos
            raw = self.capture_value()
            if key in module.attrs:
                raise self.error(f"attribute {key} already exists", key_pos)
            module.attrs[key] = self._module_attr(key, raw, value_pos)
        header_end = self.pos
        self.skip()
        if any(self.keyword_ahead(t) for t in _STACK_TABLES):
            tables_start = self.pos
            module.stack_frames = self._stack_frames()
            header_end = self.pos
            module.stack_frames_text = self.text[tables_start:header_end].rstrip()
            header_end = tables_start + len(module.stack_frames_text)
        self.pos = header_end
        module._header_span = (header_start, header_end)
        module._leading = self.text[:header_start]
        prev_end = self.pos
        entry_seen = False
        while True:
            self.skip()
            if self.pos >= self.n:
                break
            comp_start = self.pos
            comp = self.computation(module, lazy)
            if comp.is_entry:
                if entry_seen:
                    raise self.error("expects only one ENTRY", comp_start)
                entry_seen = True
            module._gaps[comp] = self.text[prev_end:comp_start]
            prev_end = self.pos
        module._trailing = self.text[prev_end:]
        if not module.computations:
            raise self.error("module has no computations")
        if module.entry is None:
            module.entry = module.computations[-1]
            module.entry.is_entry = True
            module.entry_implicit = True
        self._resolve_computation_refs(module)
        self._name_compact()
        saw = self.saw
        module.sigils = saw["sigil"]
        module.operand_shapes = saw["operand_shape"] if saw["operands"] else saw["sigil"]
        module.signatures = saw["signature"]
        return module

    def _module_attr(self, key: str, raw: str, pos: int):
        try:
            if key in ("replica_count", "num_partitions"):
                return A.parse_int(raw)
            if key in ("is_scheduled", "alias_passthrough_params"):
                return A.parse_bool(raw)
            if key == "input_output_alias":
                _check_alias(raw)
            elif key == "buffer_donor":
                _check_buffer_donor(raw)
            elif key == "frontend_attributes":
                return A.FrontendAttributes.parse(raw)
            elif key == "entry_computation_layout":
                self._check_layout_signature(raw, pos)
        except A.AttrError as e:
            raise self.error(e.message, pos + e.offset) from None
        return A.Raw(raw)

    def _check_layout_signature(self, raw: str, pos: int):
        sub = _Parser(raw)
        try:
            sub.expect("{")
            sub.expect("(")
            if not sub.accept(")"):
                while True:
                    sub.shape()
                    if sub.accept(")"):
                        break
                    sub.expect(",")
            sub.expect("->")
            sub.shape()
            sub.expect("}")
        except HloParseError as e:
            raise self.error("entry_computation_layout: " + e.message, pos + sub.pos) from None

    def _stack_frames(self) -> dict:
        tables = {}
        while any(self.keyword_ahead(t) for t in _STACK_TABLES):
            table = self.name()
            entries = {}
            while True:
                self.skip()
                m = _INT.match(self.text, self.pos)
                if not m or self.keyword_ahead("ENTRY"):
                    break
                self.pos = m.end()
                self.skip()
                if self.peek() == '"':
                    s = _STRING.match(self.text, self.pos)
                    if not s:
                        raise self.error("unterminated string")
                    value = A.unquote(s.group(0))
                    self.pos = s.end()
                elif self.peek() == "{":
                    value_pos = self.pos
                    raw = self.capture_value()
                    value = {}
                    for item in raw[1:-1].split():
                        k, eq, v = item.partition("=")
                        if not eq or not _INT.fullmatch(v):
                            raise self.error(f"malformed {table} entry", value_pos)
                        value[k] = int(v)
                else:
                    raise self.error(f"expects a string or '{{' in {table}")
                entries[int(m.group(0))] = value
            tables[table] = entries
            self.skip()
        return tables

    # -- computations ---------------------------------------------------------------------------------
    def computation(self, module: HloModule, lazy: bool = False) -> HloComputation:
        """One computation; with `lazy`, a non-entry one keeps its body as text until it is read."""
        if lazy:
            comp = self._unparsed_computation(module)
            if comp is not None:
                return comp
        start = self.pos
        is_entry = False
        if self.keyword_ahead("ENTRY"):
            is_entry = True
            self.pos += len("ENTRY")
        name_pos = self.pos
        name = self.name("computation name")
        if name in self.computation_names:
            raise self.error(f"computation already exists: {name}", name_pos)
        self.computation_names.add(name)
        line = self.line_of(start)
        module._names.add(name)
        self.skip()
        signature = None
        if self.peek() == "(":
            signature = self._signature()
            self.saw["signature"] = True
        self.expect("{", "to start the computation")
        body_start = self.pos
        if lazy and not is_entry:
            close = self.text.find("\n}", body_start) + 1
            if close == 0:
                raise self.error("expects '}' at the end of the computation", start)
            comp = self._defer_body(name, (start, name_pos, body_start, close), signature)
            self.pos = close
        else:
            comp = HloComputation(name, is_entry)
            symbols, pending_preds = {}, []
            prev_end = self._body_instructions(comp, symbols, pending_preds, start)
        comp.line = line
        comp.parent = module
        comp._head_span = (start, body_start)
        close = self.pos
        self.pos += 1
        save = self.pos
        self.skip()
        if self.peek() == ",":
            self.pos += 1
            key = self.name("attribute name")
            self.expect("=")
            self.skip()
            value_pos = self.pos
            raw = self.capture_value()
            if key != "execution_thread":
                raise self.error(f"unexpected computation attribute '{key}'", value_pos)
            try:
                comp.execution_thread = A.unquote(raw)
            except A.AttrError as e:
                raise self.error(e.message, value_pos) from None
        else:
            self.pos = save
        comp._span = (start, self.pos)
        if comp.parsed:
            comp._tail_span = (prev_end, self.pos)
            self._finish_body(comp, symbols, pending_preds, signature, name_pos, close)
        else:
            module._unclaimed.append(comp)
        if is_entry:
            module.entry = comp
        module.computations.append(comp)
        self.computations_by_name[name] = comp
        comp._dirty = False
        return comp

    def _unparsed_computation(self, module: HloModule) -> HloComputation | None:
        """The common case of a lazily parsed computation in one regex match: a non-entry header,
        a body up to the first line starting with `}`, nothing after that `}` on its line. None
        (and nothing consumed) for anything else, which the general path then parses."""
        text = self.text
        m = _UNPARSED_HEAD.match(text, self.pos)
        if m is None or m.group(1) in self.computation_names or m.group(1) == "ENTRY":
            return None
        body_start = m.end()
        close = text.find("\n}", body_start) + 1
        if close == 0 or text[close + 1:close + 2] not in ("\n", ""):
            return None
        start, name = self.pos, m.group(1)
        self.computation_names.add(name)
        module._names.add(name)
        if m.group(2) is not None:
            self.saw["signature"] = True
        signature = functools.partial(_read_signature, text, m.start(2)) if m.group(2) is not None else None
        comp = self._defer_body(name, (start, m.start(1), body_start, close), signature)
        comp.line = self.line_of(start)
        comp.parent = module
        comp._head_span = (start, body_start)
        self.pos = close + 1
        comp._span = (start, self.pos)
        module._unclaimed.append(comp)
        module.computations.append(comp)
        self.computations_by_name[name] = comp
        return comp

    def _defer_body(self, name: str, positions: tuple, signature) -> HloComputation:
        """A computation whose body (`positions`: start, name, body start, closing `}`) is parsed
        when first read; `signature` is the parsed header signature, or a function parsing it."""
        read_signature = signature if callable(signature) or signature is None else (lambda: signature)
        parse_body = functools.partial(_parse_unparsed_body, self.text, self.computations_by_name, positions,
                                       read_signature)
        return HloComputation.unparsed(name, self.text[positions[2]:positions[3]], parse_body, read_signature)

    def _body_instructions(self, comp: HloComputation, symbols: dict, pending_preds: list, start: int) -> int:
        """The instructions of a computation, up to its closing `}` (where it leaves `pos`); returns
        the end of the last one."""
        prev_end = self.pos
        while True:
            prev_end = self._fast_lines(comp, symbols, prev_end)
            self.skip()
            if self.peek() == "}":
                return prev_end
            if self.pos >= self.n:
                raise self.error("expects '}' at the end of the computation", start)
            instr_start = self.pos
            instr = self.instruction(comp, symbols, pending_preds, 0)
            comp._gaps[instr] = self.text[prev_end:instr_start]
            prev_end = self.pos

    def _finish_body(self, comp: HloComputation, symbols: dict, pending_preds: list, signature, name_pos: int,
                     close: int):
        """The root, control predecessors and declared signature of a parsed body."""
        if not comp.instructions:
            raise self.error("computation has no instructions", close)
        if comp.root is None:
            comp.root = comp.instructions[-1]
        for instr, names, pos in pending_preds:
            preds = []
            for n in names:
                if n not in symbols:
                    raise self.error(f"instruction '{n}' is not defined", pos)
                preds.append(symbols[n])
            dict.__setitem__(instr.attrs, "control-predecessors", tuple(preds))
        if signature is not None:
            self._check_signature(comp, signature, name_pos)

    def _fast_lines(self, comp: HloComputation, symbols: dict, prev_end: int) -> int:
        """Consume a run of ordinary one-line instructions, one regex match each.

        Stops at the first line that needs the general path (nested instructions, tuple constants,
        new shapes, anything unusual or wrong), which then parses it and reports any error.
        Returns the end of the last instruction consumed. (Hot: methods are bound to locals.)
        """
        text, module = self.text, self.module_
        gaps, instructions = comp._gaps, comp.instructions
        add_name, add_instruction = module._names.add, instructions.append
        shape_of, attr_of, literal_of = _SHAPE_CACHE.get, _ATTR_CACHE.get, _LITERAL_CACHE.get
        symbol, count_newlines = symbols.get, text.count
        known_computations = self.computations_by_name
        saw = self.saw
        sigil_seen = saw["sigil"]
        find_operands, find_attrs, match_line = _FAST_OPERAND.findall, _FAST_ATTR_PIECE.findall, _FAST_LINE.match
        pos = self.pos
        line = self.line_of(pos)
        while True:
            m = match_line(text, pos)
            if m is None:
                break
            root, full_name, name, shape_text, opcode, ops_text, attrs_text = m.group(2, 3, 4, 5, 6, 7, 8)
            if attrs_text and attrs_text[0] not in ", \t":
                break
            shape = shape_of(shape_text)
            if (shape is None or name in symbols or opcode not in _FAST_OPCODES
                    or (root and comp.root is not None)):
                break
            operands, parameter_number, literal = [], None, None
            if opcode == "parameter":
                if not ops_text.isdigit():
                    break
                parameter_number = int(ops_text)
            elif opcode == "constant":
                literal = literal_of((shape, ops_text))
                if literal is None:
                    literal = _fast_literal(shape, ops_text)
                    if literal is None:
                        break
            elif ops_text:
                if not saw["operands"]:
                    saw["operands"] = True
                    saw["operand_shape"] = bool(find_operands(ops_text)[0][0])
                if "[" in ops_text or "/" in ops_text:  # operand shapes or `/*index=N*/` comments
                    if "#" in ops_text:
                        break  # `%t#0`, which the operand regex would read as `%t`
                    for op_shape, op_name in find_operands(ops_text):
                        op = symbol(op_name)
                        if op is None or (op_shape and shape_of(op_shape) is not op.shape):
                            break
                        operands.append(op)
                    else:
                        op = True
                else:  # `%a, %b`: a name that is not a defined instruction's sends the line to the general path
                    for op_name in ops_text.split(","):
                        op_name = op_name.strip()
                        op = symbol(op_name[1:] if op_name[:1] == "%" else op_name)
                        if op is None:
                            break
                        operands.append(op)
                    else:
                        op = True
                if op is not True:
                    break
            attrs = {}
            if attrs_text:
                pieces = find_attrs(attrs_text)
                if sum(map(len, map(_first, pieces))) != len(attrs_text):
                    break  # something the simple attribute form does not cover
                for _, key, raw in pieces:
                    if key in attrs or key == "literal" or key == "control-predecessors":
                        attrs = None
                        break
                    if key in COMPUTATION_ATTRS:
                        callee = known_computations.get(raw.lstrip("%"))
                        if callee is None:
                            attrs = None
                            break
                        attrs[key] = callee
                        continue
                    value = attr_of((key, raw))
                    if value is None:
                        try:
                            value = self._typed_attr(key, raw, m.start(8))
                        except HloParseError:
                            attrs = None
                            break
                    attrs[key] = value
                if attrs is None:
                    break
            instr_start, end = m.span(1)
            line += count_newlines("\n", pos, instr_start)
            instr = HloInstruction(name, opcode, shape, operands, attrs, parameter_number, literal)
            instr.line = line
            for op in operands:
                users = op.users
                if not users or users[-1] is not instr:  # an operand used twice lists its user once
                    users.append(instr)
            instr.parent = comp
            add_instruction(instr)
            symbols[name] = instr
            add_name(name)
            instr._span = (instr_start, end)
            if root:
                instr._name_start = m.start(3)
                comp.root = instr
            else:
                instr._name_start = instr_start
            if not sigil_seen and full_name[0] == "%":
                sigil_seen = saw["sigil"] = True
            gaps[instr] = text[prev_end:instr_start]
            prev_end = pos = end
        self._line_mark = (pos, line)
        self.pos = pos
        return prev_end

    def _signature(self):
        """`(p0: f32[2], p1: s32[]) -> f32[2]` of a computation header."""
        m = _FAST_SIGNATURE.match(self.text, self.pos)
        if m is not None:
            params = []
            for pname, shape_text in _FAST_PARAM.findall(m.group(1)):
                shape = _SHAPE_CACHE.get(shape_text)
                if shape is None:
                    break
                params.append((pname, shape))
            else:
                result = _SHAPE_CACHE.get(m.group(2))
                if result is not None and len(params) == m.group(1).count(":"):
                    self.pos = m.end()
                    return params, result
        self.expect("(")
        params = []
        if not self.accept(")"):
            while True:
                pname = self.name("parameter name")
                self.expect(":")
                params.append((pname, self.shape()))
                if self.accept(")"):
                    break
                self.expect(",")
        self.expect("->")
        return params, self.shape()

    def _check_signature(self, comp: HloComputation, signature, pos: int):
        params, result = signature
        if not result.compatible(comp.root.shape):
            raise self.error(f"Shape of computation {comp.name}, {result}, is not compatible with that of its "
                             f"root instruction {comp.root.name}, {comp.root.shape}", pos)
        if len(params) != comp.num_parameters:
            raise self.error(f"computation {comp.name} declares {len(params)} parameters but has "
                             f"{comp.num_parameters}", pos)

    # -- instructions ---------------------------------------------------------------------------------
    def instruction(self, comp: HloComputation, symbols, pending_preds, depth: int,
                    anonymous_opcode: str | None = None, shape: Shape | None = None,
                    start: int | None = None) -> HloInstruction:
        """One instruction; with `anonymous_opcode`, a nested instruction used as an operand."""
        if depth > MAX_NESTING:
            raise self.error("instructions nested too deeply")
        text = self.text
        is_root = False
        fast = self._fast_head(symbols) if anonymous_opcode is None else None
        if fast is not None:
            start, is_root, name_start, name, shape, opcode, opcode_pos, operands, parameter_number = fast
            literal = None
            line = self.line_of(start)
        elif anonymous_opcode is None:
            start = self.pos
            if self.keyword_ahead("ROOT"):
                is_root = True
                self.pos += 4
                self.skip()
            name_start = self.pos
            m = _NAME.match(text, self.pos)
            if not m:
                seen = text[self.pos:self.pos + 12].split("\n")[0] or "end of input"
                raise self.error(f"expects instruction name, saw '{seen}'")
            name = m.group(1)
            self.pos = m.end()
            self.expect("=")
            self.skip()
            if self.peek() == "(" or (_ARRAY_SHAPE.match(text, self.pos) is not None):
                shape = self.shape()
                self.skip()
            opcode_pos = self.pos
            m = _NAME.match(text, self.pos)
            opcode = m.group(0) if m else ""
            if not m or not is_opcode(opcode) or text[m.end():m.end() + 1] not in "( \t\n":
                raise self.error("expects opcode", opcode_pos)
            self.pos = m.end()
        else:
            name_start = start
            opcode, opcode_pos = anonymous_opcode, self.pos
            name = None
        if fast is None:
            line = self.line_of(start)
            parameter_number, literal, operands = self._operand_list(comp, symbols, pending_preds, depth,
                                                                      opcode, opcode_pos, shape)
        attrs = {}
        comp_refs = []
        simple = _FAST_ATTRS.match(text, self.pos)
        pending = _FAST_ATTR.findall(text, self.pos, simple.end()) if simple.end() > self.pos else ()
        if pending:
            self.pos = simple.end()
        pending_index = 0
        while True:
            save = self.pos
            if pending_index < len(pending):
                key, raw = pending[pending_index]
                pending_index += 1
                if key == "literal":
                    raise self.error("a literal attribute needs a shape", save)
                key_pos = value_pos = None
            else:
                self.skip()
                if self.peek() != ",":
                    self.pos = save
                    break
                self.pos += 1
                self.skip()
                m = _ATTR_NAME.match(text, self.pos)
                if not m:
                    if anonymous_opcode is not None:  # the comma separates the enclosing operand list
                        self.pos = save
                        break
                    raise self.error("expects attribute name")
                key = m.group(1)
                key_pos = self.pos
                self.pos = m.end()
                self.skip()
                value_pos = self.pos
                if key == "literal":
                    if key in attrs:
                        raise self.error(f"attribute {key} already exists", key_pos)
                    attrs[key] = self._literal_attr()
                    continue
                raw = self.capture_value()
            if value_pos is None:  # fast path: find the exact position only to report an error
                if key in attrs:
                    raise self.error(f"attribute {key} already exists", self._locate_attr(key, raw, start))
                try:
                    self._store_attr(attrs, comp_refs, pending_preds, key, raw, start)
                except HloParseError:
                    self._store_attr(attrs, comp_refs, pending_preds, key, raw, self._locate_attr(key, raw, start))
                    raise
                continue
            if key in attrs:
                raise self.error(f"attribute {key} already exists", key_pos)
            self._store_attr(attrs, comp_refs, pending_preds, key, raw, value_pos)
        end = self.pos
        if shape is None:
            shape = self._infer_shape(opcode, operands, attrs, literal, opcode_pos)
        if name is None:
            name = self.module_.unique_name(f"{opcode}.anon") if self.module_ else f"{opcode}.anon"
        elif name in symbols:
            raise self.error(f"instruction '{name}' already exists in computation {comp.name}", name_start)
        instr = HloInstruction(name, opcode, shape, operands, None, parameter_number, literal)
        dict.update(instr.attrs, attrs)
        instr.line = line
        if pending_preds and pending_preds[-1][0] is None:
            pending_preds[-1] = (instr,) + pending_preds[-1][1:]
        for key, names, pos, braced in comp_refs:
            self.pending_computation_refs.append((instr, key, names, pos, braced))
        for op in operands:
            if instr not in op.users:
                op.users.append(instr)
        instr.parent = comp
        comp.instructions.append(instr)
        symbols[name] = instr
        if self.module_ is not None:
            self.module_._names.add(name)
        if anonymous_opcode is None:
            instr._span = (start, end)
            instr._name_start = name_start
            if text[name_start] == "%":
                self.saw["sigil"] = True
            if is_root:
                if comp.root is not None:
                    raise self.error("one computation should have only one ROOT", start)
                comp.root = instr
        return instr

    def _store_attr(self, attrs, comp_refs, pending_preds, key: str, raw: str, value_pos: int):
        if key in COMPUTATION_ATTRS:
            names = self._name_list(raw, value_pos)
            braced = raw.startswith("{")
            known = self.computations_by_name
            if all(n in known for n in names):  # callees usually come first: resolve now
                comps = tuple(known[n] for n in names)
                attrs[key] = comps if braced or len(comps) != 1 else comps[0]
            else:
                comp_refs.append((key, names, value_pos, braced))
                attrs[key] = None
        elif key == "control-predecessors":
            names = self._name_list(raw, value_pos)
            attrs[key] = ()
            pending_preds.append((None, names, value_pos))
        else:
            attrs[key] = self._typed_attr(key, raw, value_pos)

    def _locate_attr(self, key: str, raw: str, start: int) -> int:
        """Where `key=raw` sits in the instruction that starts at `start` (for error messages)."""
        i = self.text.find(f"{key}={raw}", start)
        return i + len(key) + 1 if i >= 0 else start

    def _operand_list(self, comp, symbols, pending_preds, depth, opcode, opcode_pos, shape):
        """`(...)` after the opcode: a parameter number, a literal, or operands."""
        self.expect("(", f"after {opcode}")
        parameter_number, literal, operands = None, None, []
        if opcode == "parameter":
            self.skip()
            parameter_number = self.integer()
            self.expect(")")
        elif opcode == "constant":
            self.skip()
            lit_pos = self.pos
            lit_text = self.capture_until_close()
            self.pos += 1
            if shape is None:
                raise self.error("a constant needs a shape", opcode_pos)
            try:
                literal = Literal.parse(shape, lit_text)
            except A.AttrError as e:
                raise self.error(e.message, lit_pos + e.offset) from None
        else:
            self.skip()
            if self.peek() != ")":
                while True:
                    operands.append(self.operand(comp, symbols, pending_preds, depth))
                    self.skip()
                    c = self.peek()
                    if c == ",":
                        self.pos += 1
                        continue
                    if c == ")":
                        break
                    raise self.error("expects ',' or ')' in the operand list")
            self.pos += 1
        return parameter_number, literal, operands

    def _fast_head(self, symbols):
        """The common one-line instruction head, matched by one regex; None means: use the general path."""
        save = self.pos
        head = self._match_fast_head(symbols)
        if head is None:
            self.pos = save
        return head

    def _match_fast_head(self, symbols):
        m = _FAST_HEAD.match(self.text, self.pos)
        if m is None:
            return None
        opcode = m.group(5)
        if opcode == "constant" or not is_opcode(opcode):
            return None
        shape = _SHAPE_CACHE.get(m.group(4))
        if shape is None:
            self.pos = m.start(4)
            shape = self.shape()
            if self.pos != m.end(4):
                return None
        ops_text = m.group(6)
        operands, parameter_number = [], None
        if opcode == "parameter":
            if not ops_text.strip().isdigit():
                return None
            parameter_number = int(ops_text)
        elif ops_text and not ops_text.isspace():
            if _FAST_OPERAND_LIST.fullmatch(ops_text) is None:
                return None
            for shape_text, name in _FAST_OPERAND.findall(ops_text):
                op = symbols.get(name)
                if op is None:
                    return None
                if shape_text:
                    given = _SHAPE_CACHE.get(shape_text)
                    if given is None or (given is not op.shape and not given.compatible(op.shape)):
                        return None
                operands.append(op)
        self.pos = m.end()
        return (m.start(), m.group(1) is not None, m.start(2), m.group(3), shape, opcode, m.start(5), operands,
                parameter_number)

    def operand(self, comp, symbols, pending_preds, depth) -> HloInstruction:
        self.skip()
        start = self.pos
        text = self.text
        shape = None
        if self.peek() == "(" or _ARRAY_SHAPE.match(text, self.pos) is not None:
            shape = self.shape()
            self.skip()
        m = _NAME.match(text, self.pos)
        if not m:
            raise self.error("cannot parse as an instruction name or as a nested instruction")
        ident = m.group(1)
        after = _WS.match(text, m.end()).end()
        if text[after:after + 1] == "(" and not m.group(0).startswith("%") and is_opcode(ident):
            self.pos = m.end()
            return self.instruction(comp, symbols, pending_preds, depth + 1, anonymous_opcode=ident,
                                    shape=shape, start=start)
        self.pos = m.end()
        if not self.saw["operands"]:
            self.saw["operands"] = True
            self.saw["operand_shape"] = shape is not None
        found = symbols.get(ident)
        if found is None:
            raise self.error(f"instruction '{ident}' is not defined", m.start())
        while True:  # `%t#1#0`: element 0 of element 1 of the tuple %t
            hash_pos = _WS.match(text, self.pos).end()
            if text[hash_pos:hash_pos + 1] != "#":
                break
            self.pos = hash_pos + 1
            found = self._tuple_element(comp, found, self.integer(), hash_pos)
        if shape is not None and not shape.compatible(found.shape):
            raise self.error(f"operand {ident} has shape {found.shape}, not {shape}", start)
        return found

    def _tuple_element(self, comp: HloComputation, tup: HloInstruction, index: int, pos: int) -> HloInstruction:
        """The get-tuple-element that XLA's compact form `%tuple#index` (its dumps') stands for.

        As XLA's parser does, every `%t#i` of a computation is one instruction, placed before
        its first user. It is named `t_i` once the names the text defines are known (`_name_compact`).
        """
        if not tup.shape.is_tuple:
            raise self.error(f"GTE operand must be tuple, but has shape: {tup.shape}", pos)
        if not 0 <= index < len(tup.shape.tuple_shapes):
            raise self.error(f"GTE index {index} out of bounds for shape: {tup.shape}", pos)
        gte = self.compact_gtes.get((tup, index))
        if gte is None:
            gte = HloInstruction(f"{tup.name}_{index}", "get-tuple-element", tup.shape.tuple_shapes[index], [tup],
                                 {"index": index})
            gte._compact = True
            gte.line = self.line_of(pos)
            gte.parent = comp
            tup.users.append(gte)
            comp.instructions.append(gte)
            self.compact_gtes[tup, index] = gte
        return gte

    def _name_compact(self):
        """Name the get-tuple-elements of `%t#i` operands `t_i` (XLA's names), made unique against
        every name the module's text defines; a nested one after its tuple's final name."""
        module = self.module_
        for (tup, index), gte in self.compact_gtes.items():
            gte.name = module.unique_name(f"{tup.name}_{index}")

    def _literal_attr(self, depth: int = 0):
        """`literal=s32[2]{0} {1, 2}` (a shape, then a literal) or a tuple of such `( ..., ... )`."""
        self.skip()
        if depth > MAX_NESTING:
            raise self.error("literal nested too deeply")
        if self.peek() == "(":
            start = self.pos
            self.pos += 1
            while True:
                self._literal_attr(depth + 1)
                if self.accept(")"):
                    break
                self.expect(",")
            return A.Raw(self.text[start:self.pos])
        shape = self.shape()
        self.skip()
        start = self.pos
        text, i, depth_ = self.text, self.pos, 0
        while i < self.n:
            c = text[i]
            if c in "({":
                depth_ += 1
            elif c in ")}":
                if depth_ == 0:
                    break
                depth_ -= 1
                if depth_ == 0:
                    i += 1
                    break
            elif depth_ == 0 and (c == "," or c.isspace()):
                break
            i += 1
        self.pos = i
        try:
            return Literal.parse(shape, text[start:i])
        except A.AttrError as e:
            raise self.error(e.message, start + e.offset) from None

    def _name_list(self, raw: str, pos: int) -> list[str]:
        body = raw[1:-1] if raw.startswith("{") and raw.endswith("}") else raw
        names = [p.strip() for p in body.split(",") if p.strip()]
        for n in names:
            if not _NAME.fullmatch(n):
                raise self.error(f"expects a name, saw '{n}'", pos)
        return [n.lstrip("%") for n in names]

    def _typed_attr(self, key: str, raw: str, pos: int):
        cached = _ATTR_CACHE.get((key, raw))
        if cached is not None:
            return cached
        value = self._parse_typed_attr(key, raw, pos)
        if len(_ATTR_CACHE) < 200_000 and len(raw) < 200:  # typed values are immutable: share them
            _ATTR_CACHE[(key, raw)] = value
        return value

    def _parse_typed_attr(self, key: str, raw: str, pos: int):
        if "/*" in raw and key not in _UNCOMMENTED_ATTRS:  # e.g. `/*index=5*/` inside tuple shardings
            raw = _COMMENT.sub("", raw)
        try:
            if key in A.INT_ATTRS:
                return A.parse_int(raw)
            if key in A.BOOL_ATTRS:
                return A.parse_bool(raw)
            if key in A.INT_LIST_ATTRS:
                return A.parse_int_list(raw)
            if key in A.QUOTED_ATTRS:
                return A.unquote(raw)
            if key in A.ENUM_ATTRS:
                if not re.fullmatch(r"[A-Za-z_][\w\-]*", raw):
                    raise A.AttrError(f"expects an identifier for {key}, saw '{raw}'")
                return raw
            parser = _STRUCTURED.get(key)
            if parser is not None:
                return parser(raw)
            if key == "backend_config" and raw.startswith('"'):
                return A.unquote(raw)
            if key == "outfeed_shape":
                return parse_shape(raw)
            if key == "operand_layout_constraints":
                return tuple(parse_shape(p) for p in A.split_top_level(raw[1:-1])) if raw != "{}" else ()
        except A.AttrError as e:
            raise self.error(e.message, pos + e.offset) from None
        except HloParseError as e:
            raise self.error(e.message, pos) from None
        return A.Raw(raw)

    def _infer_shape(self, opcode, operands, attrs, literal, pos) -> Shape:
        from hlo_tools.ir.shape_inference import ShapeInferenceError, infer_shape
        if opcode == "parameter":
            raise self.error("a parameter needs a shape", pos)
        if any(v is None for v in attrs.values()):
            raise self.error(f"the shape of {opcode} must be given when it calls a computation", pos)
        try:
            return infer_shape(opcode, [o.shape for o in operands], attrs, literal=literal)
        except ShapeInferenceError as e:
            raise self.error(f"cannot infer the shape of {opcode}: {e}", pos) from None

    def _resolve_computation_refs(self, module: HloModule):
        self._resolve_computation_refs_of({c.name: c for c in module.computations})
        for comp in module.computations:
            if comp.parsed:
                _mark_nested(comp)

    def _resolve_computation_refs_of(self, by_name: dict):
        """Set the computation attributes the general path left pending (names -> computations)."""
        for instr, key, names, pos, braced in self.pending_computation_refs:
            comps = []
            for n in names:
                if n not in by_name:
                    raise self.error(f"computation '{n}' is not defined", pos)
                comps.append(by_name[n])
            value = tuple(comps) if braced or len(comps) != 1 else comps[0]
            dict.__setitem__(instr.attrs, key, value)


def _mark_nested(comp: HloComputation):
    """Nested anonymous instructions print inside the instruction that owns their text (the
    get-tuple-elements of `%t#i` operands inside each of their users')."""
    owner = None
    for instr in reversed(comp.instructions):
        if instr._span is not None:
            owner = instr
        elif owner is not None and not instr._compact:
            instr._owner = owner


def _read_signature(text: str, pos: int):
    """The computation signature `(p: f32[2]) -> f32[2]` at `pos` of `text`, parsed."""
    parser = _Parser(text)
    parser.pos = pos
    return parser._signature()


def _parse_unparsed_body(text: str, computations_by_name: dict, positions: tuple, read_signature,
                         comp: HloComputation):
    """Parse the body of a computation that `parse_module(lazy_bodies=True)` left as text.

    `positions` are the computation's start, name, body start and closing `}` in `text`;
    `read_signature()` gives its header's signature (None: none); callees resolve by the
    names the module had when parsed.
    """
    start, name_pos, body_start, close = positions
    signature = read_signature() if read_signature is not None else None
    parser = _Parser(text)
    parser.module_ = comp.parent
    parser.computations_by_name = computations_by_name
    parser.pos = body_start
    parser._line_mark = (start, comp.line)
    comp.instructions, comp.root, comp._gaps = [], None, {}
    symbols, pending_preds = {}, []
    try:
        prev_end = parser._body_instructions(comp, symbols, pending_preds, start)
        if parser.pos != close:
            raise parser.error(f"computation {comp.name} does not end where a line starting with '}}' "
                               f"first follows its body (parse this module without lazy_bodies)")
        parser._finish_body(comp, symbols, pending_preds, signature, name_pos, close)
        parser._resolve_computation_refs_of(computations_by_name)
        _mark_nested(comp)
        parser._name_compact()
    except BaseException as e:
        del comp.instructions, comp.root, comp._gaps  # stays unparsed: reading it again raises again
        if isinstance(e, HloParseError) or not isinstance(e, _INTERNAL_ERRORS):
            raise
        raise parser.error(f"internal error while parsing: {type(e).__name__}: {e}") from e
    comp._tail_span = (prev_end, comp._span[1])


# The header of a non-entry computation as XLA prints it: `[%]name [(params) -> shape] {` and a
# line break; the signature (group 2) has no braces (XLA prints no layouts there).
_UNPARSED_HEAD = re.compile(r"%?([A-Za-z_][\w.\-]*)[ \t]*(\([^\n{}]*\)[ \t]*->[ \t]*[^\n{}]*?)?[ \t]*\{(?=[ \t]*\n)")

_STRUCTURED = {
    "window": A.Window.parse,
    "dim_labels": A.ConvDimensionNumbers.parse,
    "slice": A.SliceSpec.parse,
    "padding": A.PaddingConfig.parse,
    "replica_groups": A.ReplicaGroups.parse,
    "source_target_pairs": A.parse_source_target_pairs,
    "sharding": A.Sharding.parse,
    "metadata": A.Metadata.parse,
    "frontend_attributes": A.FrontendAttributes.parse,
    "operand_precision": lambda raw: tuple(p.strip() for p in raw[1:-1].split(",") if p.strip()),
}


def _check_shape_index(text: str, pos: int) -> int:
    """Validate `{0,1}` at text[pos:]; return the position after it."""
    if not text.startswith("{", pos):
        raise A.AttrError("Expects '{' at the start of ShapeIndex", pos)
    end = text.find("}", pos)
    if end < 0:
        raise A.AttrError("Expects '}' at the end of ShapeIndex", pos)
    body = text[pos + 1:end].strip()
    for piece in (body.split(",") if body else []):
        if not _INT.fullmatch(piece.strip()):
            raise A.AttrError("expects integer", pos + 1)
    return end + 1


def _check_parameter_and_index(raw: str, i: int, what: str) -> int:
    """`(N, {i,j}` inside alias/donor lists; returns the position after it and any space."""
    ws = _SPACE
    if not raw.startswith("(", i):
        raise A.AttrError(f"Expects '(' at the start of {what}", i)
    i = ws.match(raw, i + 1).end()
    m = _INT.match(raw, i)
    if not m:
        raise A.AttrError("expects integer", i)
    i = ws.match(raw, m.end()).end()
    if not raw.startswith(",", i):
        raise A.AttrError("Expects ',' after the parameter number", i)
    i = _check_shape_index(raw, ws.match(raw, i + 1).end())
    return ws.match(raw, i).end()


def _check_alias(raw: str):
    """`input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {1}) }`."""
    if not (raw.startswith("{") and raw.endswith("}")):
        raise A.AttrError("expects '{' at the start of input_output_alias")
    i, n = 1, len(raw) - 1
    ws = _SPACE
    while True:
        i = ws.match(raw, i).end()
        if i >= n:
            return
        i = _check_shape_index(raw, i)
        i = ws.match(raw, i).end()
        if not raw.startswith(":", i):
            raise A.AttrError("Expects ':' after the output ShapeIndex", i)
        i = _check_parameter_and_index(raw, ws.match(raw, i + 1).end(), "aliasing description")
        if raw.startswith(",", i):
            i = ws.match(raw, i + 1).end()
            m = re.compile(r"(may-alias|must-alias)").match(raw, i)
            if not m:
                raise A.AttrError("Unexpected aliasing kind; expected SYSTEM or USER", i)
            i = ws.match(raw, m.end()).end()
        if not raw.startswith(")", i):
            raise A.AttrError("Expects '}' at the end of aliasing description", i)
        i = ws.match(raw, i + 1).end()
        if raw.startswith(",", i):
            i += 1


def _check_buffer_donor(raw: str):
    """`buffer_donor={ (0, {}), (1, {0}) }`."""
    if not (raw.startswith("{") and raw.endswith("}")):
        raise A.AttrError("expects '{' at the start of buffer_donor")
    ws = _SPACE
    i, n = 1, len(raw) - 1
    while True:
        i = ws.match(raw, i).end()
        if i >= n:
            return
        i = _check_parameter_and_index(raw, i, "buffer donor description")
        if not raw.startswith(")", i):
            raise A.AttrError("Expects ')' at the end of buffer donor description", i)
        i = ws.match(raw, i + 1).end()
        if raw.startswith(",", i):
            i += 1
