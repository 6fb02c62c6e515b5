"""Constant literals: `constant({1, 2})`, `constant(( {1}, 2 ))`, `constant({...})`, `nan`, `-inf`,
complex `(1, 2)`, NaN payloads `nan(0x7f)`.

A literal is checked against its shape when parsed (structure, element count, value ranges, as
XLA's parser does) but kept as text; `to_numpy()` builds the array only when asked, so a huge
elided constant (`f32[999999999999] constant({...})`) costs nothing.
"""
from __future__ import annotations

import math
import re

from hlo_tools.ir.attributes import AttrError
from hlo_tools.ir.shape import COMPLEX_DTYPES, DTYPE_BITS, FLOAT_DTYPES, Shape

_TOKEN = re.compile(
    r"\s*(?:(/\*.*?\*/)|(\.\.\.)|([-+]?nan\(0x[0-9a-fA-F]+\))|([{}(),])"
    r"|([-+]?(?:inf|nan|true|false|0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)))", re.S)

# The smallest magnitude that rounds past the largest finite value (max + half an ulp): like XLA,
# refuse a value only when it would not survive conversion to the type.
_FLOAT_LIMIT = {
    "f16": 65520.0, "bf16": 3.3895313892515355e38 + 2.0 ** 119, "f32": 3.4028234663852886e38 + 2.0 ** 103,
    "f8e5m2": 61440.0, "f8e4m3": 248.0, "f8e4m3fn": 464.0, "f8e4m3b11fnuz": 31.0, "f8e5m2fnuz": 61440.0,
    "f8e4m3fnuz": 248.0, "f8e3m4": 15.75, "f8e8m0fnu": 2.0 ** 128, "f4e2m1fn": 7.0,
    "c64": 3.4028234663852886e38 + 2.0 ** 103,
}
# Largest NaN payload each type can hold (0: no payloads).
_NAN_PAYLOAD_MAX = {"f16": 0x1ff, "bf16": 0x7f, "f32": 0x3fffff, "f64": 0x7ffffffffffff, "f8e5m2": 0x1,
                    "f8e4m3": 0x3}
_MAX_DEPTH = 64


def _int_range(dtype: str) -> tuple[int, int]:
    bits = DTYPE_BITS[dtype]
    if dtype == "pred":
        return 0, 1
    if dtype[0] == "u":
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


class Literal:
    """A constant's value: its shape and its source text, validated; see `to_numpy`."""

    __slots__ = ("shape", "text", "elided")

    def __init__(self, shape: Shape, text: str):
        self.shape = shape
        self.text = text
        self.elided = "..." in text

    @staticmethod
    def parse(shape: Shape, text: str) -> "Literal":
        """Validate `text` as a literal of `shape`; raise AttrError (offset inside `text`) if not."""
        tokens = _tokenize(text)
        reader = _Reader(tokens, len(text))
        _check_value(reader, shape, 0)
        if reader.i != len(tokens):
            raise AttrError("unexpected text after the literal", tokens[reader.i][1])
        return Literal(shape, text)

    @staticmethod
    def from_numpy(array, shape: Shape | None = None) -> "Literal":
        """A literal holding `array` (printed as XLA prints constants)."""
        import numpy as np
        array = np.asarray(array)
        if shape is None:
            shape = Shape.array(_dtype_name(array.dtype), array.shape).with_default_layout()
        return Literal(shape, _format_array(array, shape.dtype))

    def to_numpy(self):
        """The value as a numpy array (ml_dtypes types for bf16/f8); tuples give a list of arrays."""
        if self.elided:
            raise ValueError("the literal's values were elided ({...}) in the text")
        tokens = [t for t in _tokenize(self.text) if t[0] not in "{}(),"]
        return _build(self.shape, iter(tokens))

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"Literal({self.shape}, {self.text[:40]!r})"

    def __eq__(self, other):
        return isinstance(other, Literal) and self.shape == other.shape and self.text == other.text

    def __hash__(self):
        return hash((self.shape, self.text))


def _tokenize(text: str) -> list[tuple[str, int]]:
    out, pos, n = [], 0, len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            rest = text[pos:].lstrip()
            if not rest:
                break
            raise AttrError(f"unexpected '{rest[:10]}' in literal", n - len(rest))
        pos = m.end()
        if m.group(1):
            continue
        tok = m.group(2) or m.group(3) or m.group(4) or m.group(5)
        out.append((tok, m.start(m.lastindex)))
    return out


class _Reader:
    def __init__(self, tokens, end):
        self.tokens, self.i, self.end = tokens, 0, end

    def peek(self):
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def offset(self):
        return self.tokens[self.i][1] if self.i < len(self.tokens) else self.end

    def take(self, expected=None):
        tok = self.peek()
        if tok is None:
            raise AttrError(f"literal ends early, expected {expected or 'a value'}", self.end)
        if expected is not None and tok != expected:
            raise AttrError(f"expects '{expected}' in literal, saw '{tok}'", self.offset())
        self.i += 1
        return tok


def _check_value(r: _Reader, shape: Shape, depth: int):
    if depth > _MAX_DEPTH:
        raise AttrError("literal nested too deeply", r.offset())
    if shape.is_tuple:
        r.take("(")
        for k, sub in enumerate(shape.tuple_shapes):
            if k:
                r.take(",")
            _check_value(r, sub, depth + 1)
        r.take(")")
        return
    if shape.is_token or not shape.is_array:
        raise AttrError(f"a constant cannot have shape {shape}", r.offset())
    if shape.rank == 0:
        if r.peek() == "{":  # XLA accepts a braced scalar
            r.take("{")
            _check_scalar(r, shape.dtype)
            r.take("}")
        else:
            _check_scalar(r, shape.dtype)
        return
    if r.peek() == "{" and r.i + 1 < len(r.tokens) and r.tokens[r.i + 1][0] == "...":  # elided: {...}
        r.take("{"), r.take("..."), r.take("}")
        return
    _check_array(r, shape, 0)


def _check_array(r: _Reader, shape: Shape, dim: int):
    """One nesting level of an array literal: `{ ... }` with dims[dim] entries."""
    rank = shape.rank
    r.take("{")
    count = 0
    while r.peek() != "}":
        if count:
            r.take(",")
            if r.peek() == "}":
                break
        if dim + 1 < rank:
            if r.peek() != "{":
                raise AttrError(f"expects nested array in rank {rank}, but sees {dim + 1}", r.offset())
            _check_array(r, shape, dim + 1)
        else:
            if r.peek() == "{":
                raise AttrError(f"expects nested array in rank {rank}, but sees larger", r.offset())
            _check_scalar(r, shape.dtype)
        count += 1
        if count > shape.dims[dim]:
            raise AttrError(f"expects {shape.dims[dim]} elements in the [{dim}]th dimension, but sees more",
                            r.offset())
    if count != shape.dims[dim] and not (count == 0 and any(d == 0 for d in shape.dims)):
        raise AttrError(f"expects {shape.dims[dim]} elements in the [{dim}]th dimension, but sees {count}",
                        r.offset())
    r.take("}")


def _check_scalar(r: _Reader, dtype: str):
    where = r.offset()
    if dtype in COMPLEX_DTYPES:
        r.take("(")
        _check_number(r.take(), dtype, where, "real part ")
        r.take(",")
        _check_number(r.take(), dtype, r.offset(), "imaginary part ")
        r.take(")")
        return
    _check_number(r.take(), dtype, where)


def _check_number(tok: str, dtype: str, where: int, what: str = ""):
    if tok in ("{", "}", "(", ")", ",", "..."):
        raise AttrError(f"expects a number in literal, saw '{tok}'", where)
    if dtype == "pred":
        if tok not in ("true", "false", "0", "1"):
            raise AttrError(f"expects true, false, 0 or 1 for pred, saw '{tok}'", where)
        return
    if dtype in FLOAT_DTYPES or dtype in COMPLEX_DTYPES:
        if "nan(" in tok:
            payload = int(tok[tok.index("(") + 1:-1], 16)
            limit = _NAN_PAYLOAD_MAX.get(dtype, 0)
            if payload == 0 or payload > limit:
                raise AttrError(f"NaN payload {hex(payload)} is out of range for {dtype}", where)
            return
        if tok.lstrip("+-") in ("nan", "inf"):
            return
        if tok in ("true", "false"):
            raise AttrError(f"expects a number for {dtype}, saw '{tok}'", where)
        try:
            value = float.fromhex(tok) if "0x" in tok else float(tok)
        except ValueError:
            raise AttrError(f"expects a number for {dtype}, saw '{tok}'", where) from None
        if math.isinf(value):
            raise AttrError("Constant is out of range for double (+/-1.79769e+308) and so is unparsable.", where)
        limit = _FLOAT_LIMIT.get(dtype)
        if limit is not None and abs(value) >= limit:
            raise AttrError(f"{what}value {tok} is out of range for literal's primitive type {dtype.upper()}",
                            where)
        return
    if tok in ("true", "false"):
        value = int(tok == "true")
    else:
        try:
            value = int(tok, 0)
        except ValueError:
            try:
                f = float(tok)
            except ValueError:
                raise AttrError(f"expects an integer for {dtype}, saw '{tok}'", where) from None
            if not f.is_integer():
                raise AttrError(f"expects an integer for {dtype}, saw '{tok}'", where) from None
            value = int(f)
    lo, hi = _int_range(dtype)
    if dtype == "u64":
        lo = -(1 << 63)  # XLA reads u64 literals through int64 too, so -1 means 2^64-1
    if not lo <= value <= hi:
        raise AttrError(f"value {tok} is out of range for literal's primitive type {dtype.upper()} "
                        f"namely [{lo}, {hi}].", where)


def _numpy_dtype(dtype: str):
    import ml_dtypes
    import numpy as np
    names = {"pred": np.bool_, "f16": np.float16, "f32": np.float32, "f64": np.float64, "c64": np.complex64,
             "c128": np.complex128, "bf16": ml_dtypes.bfloat16}
    if dtype in names:
        return np.dtype(names[dtype])
    if dtype[0] in "su" and dtype[1:].isdigit():
        bits = int(dtype[1:])
        kind = "int" if dtype[0] == "s" else "uint"
        if bits >= 8:
            return np.dtype(f"{kind}{bits}")
        return np.dtype(getattr(ml_dtypes, f"{kind}{bits}"))
    return np.dtype(getattr(ml_dtypes, {"f8e5m2": "float8_e5m2", "f8e4m3fn": "float8_e4m3fn",
                                        "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
                                        "f8e4m3fnuz": "float8_e4m3fnuz", "f8e4m3": "float8_e4m3",
                                        "f8e3m4": "float8_e3m4", "f8e8m0fnu": "float8_e8m0fnu",
                                        "f4e2m1fn": "float4_e2m1fn"}[dtype]))


def numpy_dtype(dtype: str):
    """The numpy dtype for an XLA element type (ml_dtypes for bf16, f8 and sub-byte ints)."""
    return _numpy_dtype(dtype)


def _dtype_name(np_dtype) -> str:
    import numpy as np
    np_dtype = np.dtype(np_dtype)
    for name in DTYPE_BITS:
        try:
            if _numpy_dtype(name) == np_dtype:
                return name
        except AttributeError:
            continue
    raise ValueError(f"no XLA element type for numpy dtype {np_dtype}")


def _scalar_value(tok: str, dtype: str):
    if dtype == "pred":
        return tok in ("true", "1")
    if dtype in FLOAT_DTYPES:
        if "nan" in tok:
            return -math.nan if tok.startswith("-") else math.nan
        return float.fromhex(tok) if "0x" in tok else float(tok)
    value = int(tok == "true") if tok in ("true", "false") else _int_token(tok)
    if dtype[0] == "u":
        value %= 1 << DTYPE_BITS[dtype]  # u64 `-1` is 2^64-1, as XLA reads it
    return value


def _int_token(tok: str) -> int:
    try:
        return int(tok, 0)
    except ValueError:
        return int(float(tok))


def _build(shape: Shape, tokens):
    import numpy as np
    if shape.is_tuple:
        return [_build(s, tokens) for s in shape.tuple_shapes]
    n = shape.element_count
    if shape.dtype in COMPLEX_DTYPES:
        vals = []
        for _ in range(n):
            re_, im = next(tokens)[0], next(tokens)[0]
            vals.append(complex(_scalar_value(re_, "f64"), _scalar_value(im, "f64")))
    else:
        vals = [_scalar_value(next(tokens)[0], shape.dtype) for _ in range(n)]
    return np.array(vals, dtype=_numpy_dtype(shape.dtype)).reshape(shape.dims)


def _format_scalar(x, dtype: str) -> str:
    if dtype == "pred":
        return "true" if bool(x) else "false"
    if dtype in COMPLEX_DTYPES:
        return f"({_format_scalar(x.real, 'f64')}, {_format_scalar(x.imag, 'f64')})"
    if dtype in FLOAT_DTYPES:
        f = float(x)
        if math.isnan(f):
            return "-nan" if math.copysign(1.0, f) < 0 else "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return repr(f) if not f.is_integer() else str(int(f)) if abs(f) < 1e16 else repr(f)
    return str(int(x))


def _format_array(array, dtype: str) -> str:
    if array.ndim == 0:
        return _format_scalar(array.item(), dtype)
    if array.ndim == 1:
        return "{" + ", ".join(_format_scalar(x, dtype) for x in array.tolist()) + "}"
    return "{ " + ", ".join(_format_array(a, dtype) for a in array) + " }"
