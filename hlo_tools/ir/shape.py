"""HLO shapes: arrays (dtype, dims, dynamic dims, layout), tuples and tokens.

Shapes are immutable and hashable, so instructions can share them and passes can use them as
dictionary keys. `str(shape)` prints XLA's syntax, e.g. `f32[8,128]{1,0}`, `(f32[], s32[2])`,
`bf16[<=16,?]`, `token[]`.
"""
from __future__ import annotations

import re

# Bits per element of every primitive type XLA prints.
DTYPE_BITS = {
    "pred": 8, "s1": 1, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u1": 1, "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
}
FLOAT_DTYPES = frozenset(t for t in DTYPE_BITS if t[0] in "fb")
COMPLEX_DTYPES = frozenset({"c64", "c128"})
SIGNED_DTYPES = frozenset(t for t in DTYPE_BITS if t[0] == "s")
UNSIGNED_DTYPES = frozenset(t for t in DTYPE_BITS if t[0] == "u")
INTEGRAL_DTYPES = SIGNED_DTYPES | UNSIGNED_DTYPES

UNBOUNDED = -1  # the size XLA gives a `?` dimension
_MEMORY_SPACE = re.compile(r"(?<![A-Z])S\((\d+)\)")


class Layout:
    """A layout: minor-to-major dimension order plus XLA's optional suffix (tiling, memory space...).

    `extra` keeps the text after ':' verbatim (e.g. `T(8,128)(2,1)S(1)`), so layouts round-trip.
    """

    __slots__ = ("minor_to_major", "extra")

    def __init__(self, minor_to_major, extra: str = ""):
        object.__setattr__(self, "minor_to_major", tuple(minor_to_major))
        object.__setattr__(self, "extra", extra)

    def __setattr__(self, *_):
        raise AttributeError("Layout is immutable")

    @property
    def memory_space(self) -> int:
        """The `S(n)` memory space of the layout, 0 when absent."""
        m = _MEMORY_SPACE.search(self.extra)
        return int(m.group(1)) if m else 0

    def __eq__(self, other):
        return isinstance(other, Layout) and (self.minor_to_major, self.extra) == (other.minor_to_major, other.extra)

    def __hash__(self):
        return hash((self.minor_to_major, self.extra))

    def __str__(self):
        body = ",".join(map(str, self.minor_to_major))
        return "{" + body + (":" + self.extra if self.extra else "") + "}"

    __repr__ = __str__


class Shape:
    """An HLO shape. Build with `Shape.array`, `Shape.tuple`, `Shape.token`, or `parse_shape`."""

    __slots__ = ("dtype", "dims", "dynamic", "layout", "tuple_shapes", "_hash")

    def __init__(self, dtype: str, dims=(), dynamic=None, layout: Layout | None = None, tuple_shapes=None):
        dims = tuple(dims)
        set_ = object.__setattr__
        set_(self, "dtype", dtype)
        set_(self, "dims", dims)
        set_(self, "dynamic", tuple(dynamic) if dynamic is not None and any(dynamic) else None)
        set_(self, "layout", layout)
        set_(self, "tuple_shapes", tuple(tuple_shapes) if tuple_shapes is not None else None)
        set_(self, "_hash", None)

    def __setattr__(self, *_):
        raise AttributeError("Shape is immutable; use with_dims/with_dtype/with_layout")

    # -- constructors --------------------------------------------------------------------------
    @staticmethod
    def array(dtype: str, dims=(), layout=None, dynamic=None) -> "Shape":
        """An array shape; `layout` may be a Layout, a minor-to-major sequence, or None."""
        if dtype not in DTYPE_BITS:
            raise ValueError(f"unknown element type {dtype!r}")
        if layout is not None and not isinstance(layout, Layout):
            layout = Layout(layout)
        return Shape(dtype, dims, dynamic, layout)

    @staticmethod
    def tuple(shapes) -> "Shape":
        return Shape("tuple", (), None, None, tuple(shapes))

    @staticmethod
    def token() -> "Shape":
        return Shape("token")

    # -- queries --------------------------------------------------------------------------------
    @property
    def is_tuple(self) -> bool:
        return self.tuple_shapes is not None

    @property
    def is_token(self) -> bool:
        return self.dtype == "token"

    @property
    def is_array(self) -> bool:
        return self.tuple_shapes is None and self.dtype not in ("token", "opaque")

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_scalar(self) -> bool:
        return self.is_array and not self.dims

    @property
    def is_dynamic(self) -> bool:
        return self.dynamic is not None

    def is_dynamic_dim(self, i: int) -> bool:
        return self.dynamic is not None and self.dynamic[i]

    @property
    def element_count(self) -> int:
        n = 1
        for d in self.dims:
            n *= max(d, 0)
        return n

    @property
    def byte_size(self) -> int:
        """Bytes of the array (sub-byte types packed), or the sum over a tuple's leaves."""
        if self.is_tuple:
            return sum(s.byte_size for s in self.tuple_shapes)
        if not self.is_array:
            return 0
        return (self.element_count * DTYPE_BITS[self.dtype] + 7) // 8

    def leaves(self):
        """(shape_index, array-or-token shape) for every leaf, depth first, like XLA's ForEachSubshape."""
        if not self.is_tuple:
            yield (), self
            return
        for i, s in enumerate(self.tuple_shapes):
            for idx, leaf in s.leaves():
                yield (i,) + idx, leaf

    def subshape(self, index) -> "Shape":
        s = self
        for i in index:
            s = s.tuple_shapes[i]
        return s

    @property
    def is_row_major(self) -> bool:
        """Whether the elements lie in memory in row-major order: the layout lists the dimensions
        of size above one from major to minor in order (an absent layout is XLA's default), with
        nothing but the order in it (no tiling or memory space)."""
        if self.layout is None:
            return True
        if self.layout.extra:
            return False
        order = [d for d in reversed(self.layout.minor_to_major) if self.dims[d] != 1]
        return order == sorted(order)

    def reshape_is_bitcast(self, result: "Shape") -> bool:
        """Whether reshaping this array to `result` moves no element in memory (XLA's
        `ShapeUtil::ReshapeIsBitcast`, for the layouts passes meet): both are row-major."""
        return (self.is_array and result.is_array and self.dtype == result.dtype
                and self.element_count == result.element_count and not self.is_dynamic
                and not result.is_dynamic and self.is_row_major and result.is_row_major)

    # -- derived shapes -----------------------------------------------------------------------
    def with_dims(self, dims, keep_layout: bool = True) -> "Shape":
        """Same dtype with new dims; the layout is kept when its rank still fits, else dropped."""
        dims = tuple(dims)
        layout = self.layout if keep_layout and self.layout is not None and len(dims) == self.rank else None
        return Shape(self.dtype, dims, None, layout)

    def with_dtype(self, dtype: str) -> "Shape":
        return Shape(dtype, self.dims, self.dynamic, self.layout)

    def with_layout(self, layout) -> "Shape":
        if layout is not None and not isinstance(layout, Layout):
            layout = Layout(layout)
        return Shape(self.dtype, self.dims, self.dynamic, layout)

    def without_layout(self) -> "Shape":
        if self.is_tuple:
            return Shape.tuple(s.without_layout() for s in self.tuple_shapes)
        return Shape(self.dtype, self.dims, self.dynamic, None)

    def with_default_layout(self) -> "Shape":
        """Major-to-minor layout (`{rank-1,...,0}`) on every array leaf, as XLA assigns by default."""
        if self.is_tuple:
            return Shape.tuple(s.with_default_layout() for s in self.tuple_shapes)
        if not self.is_array:
            return self
        return Shape(self.dtype, self.dims, self.dynamic, Layout(range(self.rank - 1, -1, -1)))

    def compatible(self, other: "Shape") -> bool:
        """Equal ignoring layouts (XLA's ShapeUtil::Compatible)."""
        if self.is_tuple or other.is_tuple:
            return (self.is_tuple and other.is_tuple and len(self.tuple_shapes) == len(other.tuple_shapes)
                    and all(a.compatible(b) for a, b in zip(self.tuple_shapes, other.tuple_shapes)))
        return self.dtype == other.dtype and self.dims == other.dims and self.dynamic == other.dynamic

    # -- identity and printing -------------------------------------------------------------------
    def _key(self):
        return (self.dtype, self.dims, self.dynamic, self.layout, self.tuple_shapes)

    def __eq__(self, other):
        return isinstance(other, Shape) and self._key() == other._key()

    def __hash__(self):
        h = self._hash
        if h is None:
            h = hash(self._key())
            object.__setattr__(self, "_hash", h)
        return h

    def to_text(self, print_layout: bool = True) -> str:
        if self.is_tuple:
            return "(" + ", ".join(s.to_text(print_layout) for s in self.tuple_shapes) + ")"
        if self.dynamic is None:
            body = ",".join(map(str, self.dims))
        else:
            body = ",".join(("?" if d == UNBOUNDED else f"<={d}") if dyn else str(d)
                            for d, dyn in zip(self.dims, self.dynamic))
        text = f"{self.dtype}[{body}]"
        # XLA leaves a scalar's empty layout unprinted (`f32[]`, never `f32[]{}`).
        if print_layout and self.layout is not None and (self.dims or self.layout.extra):
            text += str(self.layout)
        return text

    def __str__(self):
        return self.to_text()

    def __repr__(self):
        return f"Shape({self.to_text()})"
