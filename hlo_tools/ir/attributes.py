"""Typed values of instruction attributes, each parsed from and printed to XLA's syntax.

Plain values use Python types: `int`, `bool`, `str` (enums such as `direction=LT` and quoted strings
such as `custom_call_target="foo"`), `tuple[int, ...]` (`dimensions={0,1}`), an `HloComputation`
(`to_apply=`), a tuple of computations (`branch_computations=`) or of instructions
(`control-predecessors=`). Structured values have a class here. Attributes this module does not
know stay `Raw` and print exactly as they were written.

Reading a value whatever its form (typed, or `Raw` text the parser did not interpret):
`attr_int`, `attr_ints`, `attr_bool`. The module header's aliasing lists: `parse_input_output_alias`,
`parse_buffer_donor`, and an instruction's `parse_output_to_operand_aliasing`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


class AttrError(Exception):
    """A malformed attribute value; `offset` is the position of the problem inside the value."""

    def __init__(self, message: str, offset: int = 0):
        super().__init__(message)
        self.message = message
        self.offset = offset


class AttrValueError(AttrError):
    """An attribute whose value is not of the type its reader asks for (`attr_int` of `x`)."""


class Named:
    """Base of the IR objects an attribute value can name, computations (`to_apply=%add`) and
    instructions (`control-predecessors={%a}`): attributes print them by name."""

    __slots__ = ()


@dataclass(frozen=True)
class Raw:
    """An attribute value kept as source text (printed verbatim)."""
    text: str

    def __str__(self):
        return self.text


INT_ATTRS = frozenset({
    "index", "channel_id", "feature_group_count", "batch_group_count", "iota_dimension", "exponent_bits",
    "mantissa_bits", "index_vector_dim", "k", "num_carries", "tuple_index", "cross_program_prefetch_index",
    "split_dimension", "concat_dimension", "split_count", "operand_index",
})
BOOL_ATTRS = frozenset({
    "use_global_device_ids", "constrain_layout", "is_stable", "indices_are_sorted", "unique_indices",
    "largest", "custom_call_has_side_effect", "is_host_transfer", "left_side", "lower", "unit_diagonal",
    "is_reverse", "is_associative", "is_composite", "is_cross_program_prefetch",
})
INT_LIST_ATTRS = frozenset({
    "dimensions", "slice_sizes", "offset_dims", "collapsed_slice_dims", "start_index_map",
    "operand_batching_dims", "start_indices_batching_dims", "update_window_dims", "inserted_window_dims",
    "scatter_dims_to_operand_dims", "input_batching_dims", "scatter_indices_batching_dims",
    "lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims", "rhs_contracting_dims", "fft_length",
    "dynamic_slice_sizes", "lhs_ragged_dims", "rhs_group_dims",
})
ENUM_ATTRS = frozenset({
    "direction", "type", "kind", "fft_type", "distribution", "transpose_a", "custom_call_schedule",
    "api_version", "algorithm", "schedule", "padding_type", "rng_algorithm", "mode",
})
QUOTED_ATTRS = frozenset({
    "custom_call_target", "async_execution_thread", "infeed_config", "outfeed_config", "execution_thread",
})
INSTRUCTION_LIST_ATTRS = frozenset({"control-predecessors"})
CONTROL_PREDECESSORS = "control-predecessors"
# Attributes whose values name computations of the module.
COMPUTATION_ATTRS = frozenset({
    "to_apply", "calls", "condition", "body", "branch_computations", "true_computation",
    "false_computation", "select", "scatter", "called_computations",
})

_INT = re.compile(r"-?\d+")
_IDENT = re.compile(r"[A-Za-z_][\w.\-]*")


# -- scalar and list helpers ------------------------------------------------------------------------
def parse_int(text: str) -> int:
    if not _INT.fullmatch(text):
        raise AttrError(f"expects integer, saw '{text}'")
    return int(text)


def parse_bool(text: str) -> bool:
    if text == "true":
        return True
    if text == "false":
        return False
    raise AttrError(f"expects true or false, saw '{text}'")


def parse_int_list(text: str) -> tuple:
    """`{1,2}`, or a list of such lists (`slice_sizes={{128,32}}` of collective-permute)."""
    if len(text) < 2 or text[0] != "{" or text[-1] != "}":
        raise AttrError("expects '{' int list '}'")
    body = text[1:-1].strip()
    if not body:
        return ()
    if body[0] == "{":
        return tuple(parse_int_list(p.strip()) for p in split_top_level(body))
    out = []
    offset = 1
    for piece in body.split(","):
        p = piece.strip()
        if not _INT.fullmatch(p):
            raise AttrError(f"expects integer, saw '{p}'", offset)
        out.append(int(p))
        offset += len(piece) + 1
    return tuple(out)


def print_int_list(values) -> str:
    return "{" + ",".join(print_int_list(v) if isinstance(v, tuple) else str(v) for v in values) + "}"


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets and strings."""
    parts, depth, start, i, n = [], 0, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def unquote(text: str) -> str:
    """The value of a C-escaped string literal `"..."`."""
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        raise AttrError("expects a quoted string")
    body = text[1:-1]
    if "\\" not in body:
        return body
    out, i = [], 0
    simple = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt == "x":
                m = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2:])
                if m:
                    out.append(chr(int(m.group(0), 16)))
                    i += 2 + len(m.group(0))
                    continue
            if nxt in "01234567" and re.match(r"[0-7]{3}", body[i + 1:]):
                out.append(chr(int(body[i + 1:i + 4], 8)))
                i += 4
                continue
            out.append(simple.get(nxt, nxt))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def quote(value: str) -> str:
    """C-escape `value` as XLA's printer does (absl::CEscape)."""
    out = []
    for c in value:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\{ord(c):03o}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


# -- reading values of any form ------------------------------------------------------------------------
def attr_int(attrs: dict, key: str, default=None):
    """`attrs[key]` as an int (`default` when absent); AttrValueError when it is not one."""
    value = attrs.get(key, default)
    if isinstance(value, Raw):
        value = value.text
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise AttrValueError(f"attribute {key} must be an integer, got {value!r}") from None
    if isinstance(value, bool):
        return int(value)
    return value


def attr_ints(attrs: dict, key: str, default=None):
    """`attrs[key]` as a tuple of ints (`default` when absent); AttrValueError when it is not one."""
    value = attrs.get(key, default)
    if isinstance(value, Raw):
        value = value.text
    if isinstance(value, str):
        body = value.strip()
        if body.startswith("{") and body.endswith("}"):
            body = body[1:-1]
        try:
            return tuple(int(x) for x in body.split(",") if x.strip())
        except ValueError:
            raise AttrValueError(f"attribute {key} must be an integer list, got {value!r}") from None
    if value is None:
        return None
    return tuple(value)


def attr_bool(attrs: dict, key: str, default: bool = False) -> bool:
    """`attrs[key]` as a bool (`default` when absent; text other than `true` is False)."""
    value = attrs.get(key, default)
    if isinstance(value, Raw):
        value = value.text
    if isinstance(value, str):
        return value.strip() == "true"
    return bool(value)


# -- windows ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WindowDimension:
    size: int = 1
    stride: int = 1
    padding_low: int = 0
    padding_high: int = 0
    window_dilation: int = 1
    base_dilation: int = 1
    window_reversal: bool = False


@dataclass(frozen=True)
class Window:
    """`window={size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=1x1 rhs_dilate=1x1 rhs_reversal=0x0}`."""
    dimensions: tuple[WindowDimension, ...]

    @staticmethod
    def parse(text: str) -> "Window":
        if len(text) < 2 or text[0] != "{" or text[-1] != "}":
            raise AttrError("expects '{' window '}'")
        fields: dict[str, list] = {}
        offset = 1
        for item in text[1:-1].split():
            key, eq, value = item.partition("=")
            where = text.find(item, offset)
            if not eq:
                raise AttrError(f"expects window field=value, saw '{item}'", where)
            if key in fields:
                raise AttrError(f"duplicate window field '{key}'", where)
            if key == "pad":
                vals = []
                for pair in value.split("x"):
                    lo, sep, hi = pair.partition("_")
                    if not sep or not _INT.fullmatch(lo) or not _INT.fullmatch(hi):
                        raise AttrError("expects padding_low and padding_high separated by '_'", where)
                    vals.append((int(lo), int(hi)))
            elif key in ("size", "stride", "lhs_dilate", "rhs_dilate", "rhs_reversal"):
                vals = []
                for v in value.split("x"):
                    if not _INT.fullmatch(v):
                        raise AttrError(f"expects integer in window {key}, saw '{v}'", where)
                    vals.append(int(v))
            else:
                raise AttrError(f"unknown window field '{key}'", where)
            fields[key] = vals
            offset = where + len(item)
        if "size" not in fields:
            if not fields:
                return Window(())
            raise AttrError("window has no size")
        rank = len(fields["size"])
        for key, vals in fields.items():
            if len(vals) != rank:
                raise AttrError(f"window {key} has {len(vals)} dimensions, size has {rank}")
        dims = []
        for i in range(rank):
            lo, hi = fields["pad"][i] if "pad" in fields else (0, 0)
            dims.append(WindowDimension(
                size=fields["size"][i], stride=fields.get("stride", [1] * rank)[i], padding_low=lo,
                padding_high=hi, window_dilation=fields.get("rhs_dilate", [1] * rank)[i],
                base_dilation=fields.get("lhs_dilate", [1] * rank)[i],
                window_reversal=bool(fields.get("rhs_reversal", [0] * rank)[i])))
        return Window(tuple(dims))

    def __str__(self):
        d = self.dimensions
        if not d:
            return "{}"
        parts = ["size=" + "x".join(str(x.size) for x in d)]
        if any(x.stride != 1 for x in d):
            parts.append("stride=" + "x".join(str(x.stride) for x in d))
        if any(x.padding_low or x.padding_high for x in d):
            parts.append("pad=" + "x".join(f"{x.padding_low}_{x.padding_high}" for x in d))
        if any(x.base_dilation != 1 for x in d):
            parts.append("lhs_dilate=" + "x".join(str(x.base_dilation) for x in d))
        if any(x.window_dilation != 1 for x in d):
            parts.append("rhs_dilate=" + "x".join(str(x.window_dilation) for x in d))
        if any(x.window_reversal for x in d):
            parts.append("rhs_reversal=" + "x".join(str(int(x.window_reversal)) for x in d))
        return "{" + " ".join(parts) + "}"


# -- convolution dimension labels ---------------------------------------------------------------------
@dataclass(frozen=True)
class ConvDimensionNumbers:
    """`dim_labels=b01f_01io->b01f`: which dimension of each operand is batch/feature/spatial.

    The label strings are the source of truth; the index properties are derived from them.
    """
    input_labels: str
    kernel_labels: str
    output_labels: str

    @staticmethod
    def parse(text: str) -> "ConvDimensionNumbers":
        m = re.fullmatch(r"([0-9a-z?]+)_([0-9a-z?]+)->([0-9a-z?]+)", text)
        if not m:
            raise AttrError(f"expects dim labels like b01f_01io->b01f, saw '{text}'")
        dn = ConvDimensionNumbers(*m.groups())
        for labels, a, b, what in ((dn.input_labels, "b", "f", "input"), (dn.kernel_labels, "i", "o", "kernel"),
                                   (dn.output_labels, "b", "f", "output")):
            digits = sorted(int(c) for c in labels if c.isdigit())
            if (labels.count(a) != 1 or labels.count(b) != 1 or digits != list(range(len(digits)))
                    or len(labels) != 2 + len(digits) + labels.count("?")):
                raise AttrError(f"invalid {what} dim labels '{labels}'")
        if not (len(dn.input_spatial) == len(dn.kernel_spatial) == len(dn.output_spatial)):
            raise AttrError(f"dim labels '{text}' disagree on the number of spatial dimensions")
        return dn

    @staticmethod
    def _spatial(labels: str) -> tuple[int, ...]:
        return tuple(i for _, i in sorted((int(c), i) for i, c in enumerate(labels) if c.isdigit()))

    input_batch = property(lambda self: self.input_labels.index("b"))
    input_feature = property(lambda self: self.input_labels.index("f"))
    input_spatial = property(lambda self: self._spatial(self.input_labels))
    kernel_input_feature = property(lambda self: self.kernel_labels.index("i"))
    kernel_output_feature = property(lambda self: self.kernel_labels.index("o"))
    kernel_spatial = property(lambda self: self._spatial(self.kernel_labels))
    output_batch = property(lambda self: self.output_labels.index("b"))
    output_feature = property(lambda self: self.output_labels.index("f"))
    output_spatial = property(lambda self: self._spatial(self.output_labels))

    @property
    def num_spatial(self) -> int:
        return len(self.input_spatial)

    def __str__(self):
        return f"{self.input_labels}_{self.kernel_labels}->{self.output_labels}"


# -- slices and padding ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SliceSpec:
    """`slice={[0:4], [2:8:2]}`: (start, limit, stride) per dimension."""
    dims: tuple[tuple[int, int, int], ...]

    @staticmethod
    def parse(text: str) -> "SliceSpec":
        if len(text) < 2 or text[0] != "{" or text[-1] != "}":
            raise AttrError("expects '{' slice ranges '}'")
        body = text[1:-1].strip()
        dims = []
        for piece in (split_top_level(body) if body else []):
            m = re.fullmatch(r"\s*\[\s*(-?\d+)\s*:\s*(-?\d+)\s*(?::\s*(-?\d+)\s*)?\]\s*", piece)
            if not m:
                raise AttrError(f"expects [start:limit(:stride)], saw '{piece.strip()}'", text.find(piece))
            dims.append((int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)))
        return SliceSpec(tuple(dims))

    @property
    def starts(self):
        return tuple(d[0] for d in self.dims)

    @property
    def limits(self):
        return tuple(d[1] for d in self.dims)

    @property
    def strides(self):
        return tuple(d[2] for d in self.dims)

    def __str__(self):
        return "{" + ", ".join(f"[{a}:{b}]" if s == 1 else f"[{a}:{b}:{s}]" for a, b, s in self.dims) + "}"


@dataclass(frozen=True)
class PaddingConfig:
    """`padding=0_1_0x2_2_1`: (low, high, interior) per dimension."""
    dims: tuple[tuple[int, int, int], ...]

    @staticmethod
    def parse(text: str) -> "PaddingConfig":
        if text in ("{}", ""):
            return PaddingConfig(())
        dims = []
        for piece in text.split("x"):
            vals = piece.split("_")
            if len(vals) not in (2, 3) or not all(_INT.fullmatch(v) for v in vals):
                raise AttrError(f"expects padding low_high(_interior), saw '{piece}'")
            lo, hi = int(vals[0]), int(vals[1])
            dims.append((lo, hi, int(vals[2]) if len(vals) == 3 else 0))
        return PaddingConfig(tuple(dims))

    def __str__(self):
        if not self.dims:
            return "{}"
        return "x".join(f"{lo}_{hi}_{interior}" if interior else f"{lo}_{hi}" for lo, hi, interior in self.dims)


# -- replica groups and device lists -----------------------------------------------------------------
@dataclass(frozen=True)
class IotaTileAssignment:
    """XLA's compact device list `[dims]<=[reshape_dims]T(perm)`: iota(prod) reshaped, transposed, reshaped."""
    dims: tuple[int, ...]
    reshape_dims: tuple[int, ...]
    transpose_perm: tuple[int, ...] | None

    def devices(self) -> list[int]:
        """The device ids in row-major order of `dims`."""
        import numpy as np
        n = 1
        for d in self.reshape_dims:
            n *= d
        arr = np.arange(n).reshape(self.reshape_dims)
        if self.transpose_perm is not None:
            arr = arr.transpose(self.transpose_perm)
        return [int(x) for x in arr.reshape(-1)]

    def __str__(self):
        text = "[" + ",".join(map(str, self.dims)) + "]<=[" + ",".join(map(str, self.reshape_dims)) + "]"
        if self.transpose_perm is not None:
            text += "T(" + ",".join(map(str, self.transpose_perm)) + ")"
        return text


_IOTA = re.compile(r"\[([\d,\s]*)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?")


def _ints(text: str) -> tuple[int, ...]:
    text = text.strip()
    if not text:
        return ()
    values = [x.strip() for x in text.split(",")]
    if not all(_INT.fullmatch(x) for x in values):
        raise AttrError(f"expects a comma-separated integer list, saw '{text}'")
    return tuple(int(x) for x in values)


def parse_iota(text: str) -> IotaTileAssignment:
    m = _IOTA.fullmatch(text)
    if not m:
        raise AttrError(f"expects an iota list like [2,4]<=[8], saw '{text}'")
    dims, reshape = _ints(m.group(1)), _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) is not None else None
    total = 1
    for d in dims:
        total *= d
    total2 = 1
    for d in reshape:
        total2 *= d
    if total != total2:
        raise AttrError(f"iota list {text}: {total} devices in the result but {total2} in the iota")
    if perm is not None and sorted(perm) != list(range(len(reshape))):
        raise AttrError(f"iota list {text}: T(...) is not a permutation of the reshape dims")
    if total > 1 << 24:
        raise AttrError(f"iota list {text} names too many devices")
    return IotaTileAssignment(dims, reshape, perm)


_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_MESH_AXIS_REF = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def parse_mesh_replica_groups(text: str) -> IotaTileAssignment:
    """XLA's mesh-axes form `mesh['x'=2,'y'=4] {'x'}` (a group spans the named axes) as the iota list it means.

    Shardy-partitioned modules print their collectives this way. A sub-axis `'x':(p)s` is the size-s
    part of axis x after the p devices more major than it, as in XLA's MeshAxesReplicaGroupList.
    """
    m = re.fullmatch(r"mesh\[(.*)\] \{(.*)\}", text)
    if not m:
        raise AttrError(f"expects mesh replica groups like mesh['x'=2,'y'=4] {{'x'}}, saw '{text}'")
    axes = [_MESH_AXIS.fullmatch(piece.strip()) for piece in m.group(1).split(",")]
    refs = [_MESH_AXIS_REF.fullmatch(piece.strip()) for piece in m.group(2).split(",")]
    if not all(axes) or not all(refs):
        raise AttrError(f"mesh replica groups '{text}': only meshes of named axes 'name'=size are supported")
    sizes = {a.group(1): int(a.group(2)) for a in axes}
    # Per mesh axis: (pre_size, size) of each referenced part, or None for the whole axis.
    parts: dict[str, list[tuple[int, int] | None]] = {}
    for ref in refs:
        if ref.group(1) not in sizes:
            raise AttrError(f"mesh replica groups '{text}': no mesh axis '{ref.group(1)}'")
        part = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else None
        parts.setdefault(ref.group(1), []).append(part)
    reshape_dims: list[int] = []
    grouped: list[int] = []  # reshaped dimensions a group spans, in the order the refs name them
    order = {}  # (axis, part) -> reshaped dimension
    for axis, size in sizes.items():
        if axis not in parts:
            reshape_dims.append(size)
            continue
        if parts[axis] == [None]:
            order[axis, None] = len(reshape_dims)
            reshape_dims.append(size)
            continue
        if None in parts[axis] or any(p < 1 or s < 1 for p, s in parts[axis]):
            raise AttrError(f"mesh replica groups '{text}': axis '{axis}' named whole and in parts")
        prefix = 1
        for pre, part_size in sorted(parts[axis]):
            if pre % prefix:
                raise AttrError(f"mesh replica groups '{text}': sub-axes of '{axis}' overlap")
            if pre != prefix:
                reshape_dims.append(pre // prefix)
            order[axis, (pre, part_size)] = len(reshape_dims)
            reshape_dims.append(part_size)
            prefix = pre * part_size
        if size % prefix:
            raise AttrError(f"mesh replica groups '{text}': sub-axes of '{axis}' do not divide its size {size}")
        if prefix != size:
            reshape_dims.append(size // prefix)
    for ref in refs:
        part = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else None
        grouped.append(order[ref.group(1), part])
    perm = tuple([d for d in range(len(reshape_dims)) if d not in grouped] + grouped)
    group_size = 1
    for d in grouped:
        group_size *= reshape_dims[d]
    total = 1
    for d in reshape_dims:
        total *= d
    return IotaTileAssignment((total // group_size, group_size), tuple(reshape_dims), perm)


@dataclass(frozen=True)
class ReplicaGroups:
    """`replica_groups={{0,1},{2,3}}`, the iota form `[2,2]<=[4]` or the mesh form `mesh['x'=2,'y'=2] {'y'}`.

    The mesh form is kept as its text (`mesh`) for printing, and read as the iota list it means.
    """
    explicit: tuple[tuple[int, ...], ...] | None = None
    iota: IotaTileAssignment | None = None
    mesh: str | None = None

    @staticmethod
    def parse(text: str) -> "ReplicaGroups":
        if text.startswith("mesh["):
            return ReplicaGroups(iota=parse_mesh_replica_groups(text), mesh=text)
        if text.startswith("["):
            iota = parse_iota(text)
            if len(iota.dims) != 2:
                raise AttrError("iota replica groups need [num_groups,group_size]")
            return ReplicaGroups(iota=iota)
        if len(text) < 2 or text[0] != "{" or text[-1] != "}":
            raise AttrError("expects '{' replica groups '}'")
        body = text[1:-1].strip()
        groups = []
        for piece in (split_top_level(body) if body else []):
            groups.append(parse_int_list(piece.strip()))
        return ReplicaGroups(explicit=tuple(groups))

    @staticmethod
    def of(groups) -> "ReplicaGroups":
        return ReplicaGroups(explicit=tuple(tuple(g) for g in groups))

    @property
    def groups(self) -> list[list[int]]:
        """The groups as explicit lists (empty list: one group of all participants)."""
        if self.iota is None:
            return [list(g) for g in self.explicit]
        devices = self.iota.devices()
        size = self.iota.dims[1]
        return [devices[i:i + size] for i in range(0, len(devices), size)]

    def __str__(self):
        if self.mesh is not None:
            return self.mesh
        if self.iota is not None:
            return str(self.iota)
        return "{" + ",".join(print_int_list(g) for g in self.explicit) + "}"


def parse_source_target_pairs(text: str) -> tuple[tuple[int, int], ...]:
    if len(text) < 2 or text[0] != "{" or text[-1] != "}":
        raise AttrError("expects '{' source-target pairs '}'")
    body = text[1:-1].strip()
    pairs = []
    for piece in (split_top_level(body) if body else []):
        pair = parse_int_list(piece.strip())
        if len(pair) != 2:
            raise AttrError(f"expects {{source,target}} pairs, saw '{piece.strip()}'")
        pairs.append(pair)
    return tuple(pairs)


def print_source_target_pairs(pairs) -> str:
    return "{" + ",".join(f"{{{a},{b}}}" for a, b in pairs) + "}"


# -- sharding -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sharding:
    """An HloSharding: `{replicated}`, `{maximal device=0}`, `{manual}`,
    `{devices=[2,1,2]<=[4] last_tile_dim_replicate}`, `{devices=[2,2]0,2,1,3}`, or a tuple `{{...}, {...}}`.

    `tile_dims` is the tile-assignment shape; `devices` lists device ids in its row-major order.
    A sharding over named mesh axes (`{mesh['x'=2,'y'=4], [{'x'}, {}]}`, XLA's "HloShardingV3") keeps
    its text in `mesh`, printed as it was, and is read as the tile assignment it means (as XLA's
    V3-to-V2 conversion gives it), so that analyses read every sharding the same way.
    """
    kind: str                                   # replicated | maximal | manual | unreduced | tiled | unknown | tuple
    tile_dims: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    iota: IotaTileAssignment | None = None
    last_tile_dim_replicate: bool = False
    last_tile_dims: tuple[str, ...] = ()        # subgroup types, e.g. ("manual",)
    elements: tuple["Sharding", ...] = ()
    device: int | None = None                   # for maximal
    extra: str = ""                             # metadata={...} and other fields kept verbatim
    mesh: str | None = None                     # the text of a sharding over named mesh axes

    @staticmethod
    def replicated() -> "Sharding":
        return Sharding("replicated")

    @staticmethod
    def manual() -> "Sharding":
        return Sharding("manual")

    @staticmethod
    def tiled(tile_dims, devices=None, last_tile_dim_replicate=False) -> "Sharding":
        tile_dims = tuple(tile_dims)
        n = 1
        for d in tile_dims:
            n *= d
        devices = tuple(devices) if devices is not None else tuple(range(n))
        return Sharding("tiled", tile_dims, devices, None, last_tile_dim_replicate)

    @staticmethod
    def tuple_of(elements) -> "Sharding":
        return Sharding("tuple", elements=tuple(elements))

    @property
    def is_tiled(self) -> bool:
        return self.kind == "tiled"

    def device_list(self) -> list[int]:
        return self.iota.devices() if self.iota is not None else list(self.devices)

    @staticmethod
    def parse(text: str) -> "Sharding":
        if len(text) < 2 or text[0] != "{" or text[-1] != "}":
            raise AttrError("expects '{' sharding '}'")
        body = text[1:-1].strip()
        if body.startswith("{") or body == "":
            elements = [Sharding.parse(p.strip()) for p in split_top_level(body)] if body else []
            return Sharding("tuple", elements=tuple(elements))
        if body.startswith(("mesh", "single_device", "maximal_mesh")):
            return _parse_mesh_sharding(text)
        return _parse_single_sharding(body, text)

    def __str__(self):
        if self.mesh is not None:
            return self.mesh
        if self.kind == "tuple":
            return "{" + ", ".join(str(e) for e in self.elements) + "}"
        parts = []
        if self.kind in ("replicated", "manual", "unreduced", "unknown"):
            parts.append(self.kind)
        elif self.kind == "maximal":
            parts.append(f"maximal device={self.device}")
        else:
            dims = "[" + ",".join(map(str, self.tile_dims)) + "]"
            if self.iota is not None:
                parts.append("devices=" + str(self.iota))
            else:
                parts.append("devices=" + dims + ",".join(map(str, self.devices)))
            if self.last_tile_dim_replicate:
                parts.append("last_tile_dim_replicate")
            if self.last_tile_dims:
                parts.append("last_tile_dims={" + ", ".join(self.last_tile_dims) + "}")
        if self.extra:
            parts.append(self.extra)
        return "{" + " ".join(parts) + "}"


_SHARDING_TOKEN = re.compile(r'\s*(metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}|last_tile_dims=\{[^}]*\}|\S+)')


def _parse_single_sharding(body: str, text: str) -> Sharding:
    kind, tile_dims, devices, iota, ltdr, ltd, device, extra = None, (), (), None, False, (), None, []
    pos = 0
    while pos < len(body):
        m = _SHARDING_TOKEN.match(body, pos)
        if not m or not m.group(1):
            break
        tok = m.group(1)
        pos = m.end()
        if tok in ("replicated", "manual", "unreduced", "unknown"):
            kind = tok
        elif tok == "maximal":
            kind = "maximal"
        elif tok.startswith("device="):
            device = parse_int(tok[7:])
        elif tok.startswith("devices="):
            kind = "tiled"
            spec = tok[8:]
            if "<=" in spec:
                iota = parse_iota(spec)
                tile_dims = iota.dims
            else:
                m2 = re.fullmatch(r"\[([\d,]*)\]([\d,]*)", spec)
                if not m2:
                    raise AttrError(f"malformed sharding devices '{spec}'")
                tile_dims, devices = _ints(m2.group(1)), _ints(m2.group(2))
                n = 1
                for d in tile_dims:
                    n *= d
                if n != len(devices):
                    raise AttrError(f"sharding tile assignment {list(tile_dims)} needs {n} devices, has {len(devices)}")
        elif tok == "last_tile_dim_replicate":
            ltdr = True
        elif tok.startswith("last_tile_dims="):
            ltd = tuple(s.strip() for s in tok[len("last_tile_dims={"):-1].split(",") if s.strip())
        elif tok.startswith("metadata=") or tok.startswith("shard_as") or tok.startswith("shard_like"):
            extra.append(tok)
        else:
            extra.append(tok)
    if kind is None:
        raise AttrError(f"unknown sharding '{text}'")
    if kind == "maximal" and device is None:
        raise AttrError("maximal sharding needs device=N")
    return Sharding(kind, tile_dims, devices, iota, ltdr, ltd, (), device, " ".join(extra))


# A sharding over named mesh axes ("HloShardingV3"), e.g. `{mesh['x'=2,'y'=4], [{'x'}, {}], unreduced={'y'}}`:
# a mesh (axis names and sizes; `device_ids=(...)` lists its devices in row-major order when they are
# not 0, 1, 2, ...), then `replicated`, `manual`, `unreduced` (the whole array), or per array dimension
# the axes that split it, major first (`?`: open to more), then the axes the array is replicated,
# unreduced or manual over; mesh axes named nowhere replicate it. `'x':(p)s` is the size-s part of axis x
# after its p most major devices. `{single_device[device_id=3]}` (`maximal_mesh[...]` in older XLA)
# puts the array on one device.
_AXIS_REF_RE = r"'[^']*'(?:\s*:\s*\(\s*\d+\s*\)\s*\d+)?"
_AXIS_REFS_RE = rf"(?:{_AXIS_REF_RE}(?:\s*,\s*{_AXIS_REF_RE})*)?"
_MESH_DIM_RE = rf"\{{\s*(?:{_AXIS_REF_RE}(?:\s*,\s*{_AXIS_REF_RE})*(?:\s*,\s*\?)?|\?)?\s*\}}"
_MESH_SHARDING = re.compile(
    r"\{\s*(?:mesh\s*\[(?P<axes>[^\]]*)\](?:\s*,\s*device_ids\s*=\s*\((?P<ids>[^)]*)\))?\s*,\s*"
    rf"(?:(?P<whole>replicated|manual|unreduced)|\[(?P<dims>\s*(?:{_MESH_DIM_RE}(?:\s*,\s*{_MESH_DIM_RE})*)?\s*)\]"
    rf"(?P<sets>(?:\s*,\s*(?:replicated|unreduced|manual)\s*=\s*\{{\s*{_AXIS_REFS_RE}\s*\}})*))"
    r"|(?:single_device|maximal_mesh)\s*\[\s*device_id\s*=\s*(?P<device>-?\d+)\s*\])"
    r'(?:\s*,\s*metadata\s*=\s*\{(?:[^{}"]|"(?:[^"\\]|\\.)*"|\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\})*\})?\s*\}')
_MESH_AXIS_DEF = re.compile(r"\s*'([^']*)'\s*=\s*(\d+)\s*")
_MESH_AXIS_USE = re.compile(r"'([^']*)'(?:\s*:\s*\(\s*(\d+)\s*\)\s*(\d+))?")
_MESH_AXIS_SET = re.compile(r"(replicated|unreduced|manual)\s*=\s*\{([^{}]*)\}")
_SUBGROUP_ORDER = ("manual", "unreduced", "replicated")  # as XLA's V3-to-V2 conversion orders them


def _parse_mesh_sharding(text: str) -> Sharding:
    """A sharding over named mesh axes, as the tile assignment XLA converts it to.

    Rejects what XLA's NamedSharding CHECK-fails on (aborting the process): duplicate axis names,
    device ids that are no permutation (or the identity), overlapping or mergeable axes, unsorted
    axis sets.
    """
    m = _MESH_SHARDING.fullmatch(text)
    if not m:
        raise AttrError(f"malformed mesh sharding '{text}'")
    if m.group("device") is not None:
        return Sharding("maximal", device=int(m.group("device")), mesh=text)
    sizes = _mesh_axes(m.group("axes"), text)
    ids = _mesh_device_ids(m.group("ids"), sizes, text) if m.group("ids") is not None else None
    if m.group("whole"):
        return Sharding(m.group("whole"), mesh=text)
    names = list(sizes)
    # Each use of an axis is (axis index, lo, hi): the sub-axis `(lo)hi/lo`, the whole axis (1, size).
    dims = [[_mesh_axis_use(u, sizes, names, text) for u in _MESH_AXIS_USE.finditer(d)]
            for d in re.findall(r"\{([^{}]*)\}", m.group("dims"))]
    sets: dict[str, list] = {}
    for kind, refs in _MESH_AXIS_SET.findall(m.group("sets")):
        if kind in sets:
            raise AttrError(f"mesh sharding '{text}' names {kind} axes twice")
        sets[kind] = [_mesh_axis_use(u, sizes, names, text) for u in _MESH_AXIS_USE.finditer(refs)]
        if sets[kind] != sorted(sets[kind], key=lambda u: (u[0], u[1], u[2] // u[1])):
            raise AttrError(f"mesh sharding '{text}': {kind} axes must be in mesh order")
    for group in dims + list(sets.values()):
        for a, b in zip(group, group[1:]):
            if a[0] == b[0] and a[2] == b[1]:
                raise AttrError(f"mesh sharding '{text}': adjacent sub-axes of '{names[a[0]]}' make one axis")
    uses = [u for group in dims + list(sets.values()) for u in group]
    for i, (axis, lo, hi) in enumerate(uses):
        for other, lo2, hi2 in uses[i + 1:]:
            if other != axis:
                continue
            whole = (1, sizes[names[axis]]) in ((lo, hi), (lo2, hi2))
            if whole or lo < hi2 and lo2 < hi or max(lo, lo2) % min(hi, hi2):  # overlap, or a gap XLA refuses
                raise AttrError(f"mesh sharding '{text}' uses parts of axis '{names[axis]}' that overlap")
    # Split every axis where a use starts or ends: the parts, major first, are the iota's reshape dims.
    reshape_dims, parts_of = [], {}
    for axis, name in enumerate(names):
        cuts = sorted({1, sizes[name]} | {c for a, lo, hi in uses if a == axis for c in (lo, hi)})
        first = len(reshape_dims)
        reshape_dims += [b // a for a, b in zip(cuts, cuts[1:])]
        for a, lo, hi in uses:
            if a == axis:
                parts_of[a, lo, hi] = list(range(first + cuts.index(lo), first + cuts.index(hi)))
    used = {p for parts in parts_of.values() for p in parts}
    order = [p for group in dims for use in group for p in parts_of[use]]
    tile_dims = [_product(reshape_dims[p] for use in group for p in parts_of[use]) for group in dims]
    subgroups = []
    for kind in _SUBGROUP_ORDER:
        parts = [p for use in sets.get(kind, ()) for p in parts_of[use]]
        if kind == "replicated":
            parts = sorted(parts + [p for p in range(len(reshape_dims)) if p not in used])
        if parts:
            order += parts
            tile_dims.append(_product(reshape_dims[p] for p in parts))
            subgroups.append(kind)
    whole = _whole_mesh_sharding(sets, all(d == 1 for d in tile_dims[:len(dims)]), _product(sizes.values()), subgroups)
    if whole is not None:
        return Sharding(whole, mesh=text)
    iota = IotaTileAssignment(tuple(tile_dims), tuple(reshape_dims),
                              None if order == sorted(order) else tuple(order))
    replicate = subgroups == ["replicated"]
    types = tuple(subgroups) if not replicate else ()
    if ids is None:
        return Sharding("tiled", iota.dims, (), iota, replicate, types, mesh=text)
    devices = [ids[i] for i in iota.devices()]
    if subgroups and subgroups[-1] == "replicated":  # XLA sorts each replication group
        size = tile_dims[-1]
        devices = [d for i in range(0, len(devices), size) for d in sorted(devices[i:i + size])]
    return Sharding("tiled", iota.dims, tuple(devices), None, replicate, types, mesh=text)


def _whole_mesh_sharding(sets: dict, data_whole: bool, devices: int, subgroups: list[str]) -> str | None:
    """`replicated`, `manual` or `unreduced` where XLA reads a mesh sharding as that whole kind, else
    None (a tile assignment). `data_whole`: no array dimension is split; `subgroups`: the tile
    assignment's subgroup kinds, those of size 1 left out. As XLA converts them, size-1 axes
    included: manual (or unreduced) axes that span every device, with no unreduced (or manual)
    ones, make that kind; else a lone replicated or manual subgroup does, a lone unreduced one not."""
    manual, unreduced = sets.get("manual"), sets.get("unreduced")
    if data_whole and not manual and not unreduced:
        return "replicated"
    for kind, uses, other in (("manual", manual, unreduced), ("unreduced", unreduced, manual)):
        if uses and not other and _product(hi // lo for _, lo, hi in uses) == devices:
            return kind
    if data_whole and subgroups in (["replicated"], ["manual"]):
        return subgroups[0]
    return None


def _product(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def _mesh_axes(text: str, sharding: str) -> dict[str, int]:
    """`'x'=2,'y'=4` as {name: size}, in mesh order."""
    sizes: dict[str, int] = {}
    for piece in (text.split(",") if text.strip() else []):
        m = _MESH_AXIS_DEF.fullmatch(piece)
        if not m:
            raise AttrError(f"mesh sharding '{sharding}': expects mesh axes like 'x'=2, saw '{piece.strip()}'")
        name, size = m.group(1), int(m.group(2))
        if name in sizes:
            raise AttrError(f"mesh sharding '{sharding}' has two axes named '{name}'")
        if size < 1:
            raise AttrError(f"mesh sharding '{sharding}': axis '{name}' has no devices")
        sizes[name] = size
    if _product(sizes.values()) > 1 << 24:
        raise AttrError(f"mesh sharding '{sharding}' names too many devices")
    return sizes


def _mesh_device_ids(text: str, sizes: dict[str, int], sharding: str) -> tuple[int, ...]:
    """`device_ids=(...)`: a permutation of the mesh's devices other than the identity."""
    ids = _ints(text)
    count = _product(sizes.values())
    if len(ids) != count:
        raise AttrError(f"mesh sharding '{sharding}' needs {count} device ids, has {len(ids)}")
    if sorted(ids) != list(range(count)) or list(ids) == list(range(count)):
        raise AttrError(f"mesh sharding '{sharding}': device_ids must reorder the devices 0..{count - 1}")
    return ids


def _mesh_axis_use(m: re.Match, sizes: dict[str, int], names: list[str], sharding: str) -> tuple[int, int, int]:
    """`'x'` or `'x':(pre)size` as (axis index, lo, hi): the part of the axis between its `lo` and
    `hi` most major devices (1 and the axis size for the whole axis)."""
    name = m.group(1)
    if name not in sizes:
        raise AttrError(f"mesh sharding '{sharding}': no mesh axis '{name}'")
    size = sizes[name]
    if m.group(2) is None:
        return names.index(name), 1, size
    pre, part = int(m.group(2)), int(m.group(3))
    if pre < 1 or part < 2 or part >= size or size % (pre * part):
        raise AttrError(f"mesh sharding '{sharding}': '{name}':({pre}){part} is no part of an axis of size {size}")
    return names.index(name), pre, pre * part


# -- key=value bags: metadata and frontend attributes --------------------------------------------------
_META_VALUE = r'"(?:[^"\\]|\\.)*"|\{[^{}]*\}|[^\s,}]+'
_META_ITEM = re.compile(r'\s*([A-Za-z_][\w]*)=(' + _META_VALUE + r')\s*,?')
_METADATA = re.compile(r'\{(?:\s*[A-Za-z_]\w*=(?:' + _META_VALUE + r')\s*,?)*\s*\}')


class Metadata:
    """`metadata={op_type="add" op_name="jit(f)/add" source_file="f.py" source_line=3}`.

    Quoted values are `str`, integers `int`, anything else (`profile_type={1}`) `Raw`. Parsed
    metadata is validated up front and split into items on first use (most passes never look).
    """

    __slots__ = ("_items", "_text")

    def __init__(self, items=(), *, _text: str | None = None):
        self._items = None if _text is not None else tuple(items)
        self._text = _text

    @staticmethod
    def parse(text: str) -> "Metadata":
        if _METADATA.fullmatch(text) is None:
            raise AttrError("malformed metadata")
        return Metadata(_text=text)

    @property
    def items(self) -> tuple[tuple[str, object], ...]:
        if self._items is None:
            items, pos, body = [], 0, self._text[1:-1]
            while pos < len(body) and body[pos:].strip():
                m = _META_ITEM.match(body, pos)
                key, value = m.group(1), m.group(2)
                if value.startswith('"'):
                    value = unquote(value)
                elif _INT.fullmatch(value):
                    value = int(value)
                else:
                    value = Raw(value)
                items.append((key, value))
                pos = m.end()
            self._items = tuple(items)
        return self._items

    def get(self, key: str, default=None):
        for k, v in self.items:
            if k == key:
                return v
        return default

    def replace(self, **changes) -> "Metadata":
        """A copy with some fields set (None removes a field)."""
        items = dict(self.items)
        items.update(changes)
        return Metadata((k, v) for k, v in items.items() if v is not None)

    def __eq__(self, other):
        return isinstance(other, Metadata) and self.items == other.items

    def __hash__(self):
        return hash(self.items)

    def __repr__(self):
        return f"Metadata({str(self)})"

    def __str__(self):
        if self._text is not None:
            return self._text
        return "{" + " ".join(f"{k}={quote(v) if isinstance(v, str) else v}" for k, v in self.items) + "}"


@dataclass(frozen=True)
class FrontendAttributes:
    """`frontend_attributes={_xla_stream_annotation="1",other="x"}`."""
    items: tuple[tuple[str, str], ...]

    @staticmethod
    def parse(text: str) -> "FrontendAttributes":
        if len(text) < 2 or text[0] != "{" or text[-1] != "}":
            raise AttrError("expects '{' attributes '}'")
        body = text[1:-1].strip()
        items = []
        for piece in (split_top_level(body) if body else []):
            key, eq, value = piece.strip().partition("=")
            if not eq:
                raise AttrError(f"expects key=value, saw '{piece.strip()}'")
            value = value.strip()
            items.append((key.strip(), unquote(value) if value.startswith('"') else value))
        return FrontendAttributes(tuple(items))

    def get(self, key: str, default=None):
        return dict(self.items).get(key, default)

    def __str__(self):
        return "{" + ",".join(f"{k}={quote(v)}" for k, v in self.items) + "}"


# -- aliasing lists ---------------------------------------------------------------------------------------
_SHAPE_INDEX = r"\{\s*(-?\d+(?:\s*,\s*-?\d+)*)?\s*\}"


def _index(text) -> tuple:
    return tuple(int(x) for x in text.split(",")) if text else ()


def parse_input_output_alias(text: str):
    """`{ {0}: (0, {}, may-alias), {1}: (1, {1}) }` -> [(output index, param, param index, kind)];
    ValueError when the text is not such a list."""
    item = re.compile(r"\s*" + _SHAPE_INDEX + r"\s*:\s*\(\s*(-?\d+)\s*,\s*" + _SHAPE_INDEX
                      + r"\s*(?:,\s*(may-alias|must-alias)\s*)?\)\s*(,|$)")
    return [(_index(m.group(1)), int(m.group(2)), _index(m.group(3)), m.group(4) or "may-alias")
            for m in _braced_items(text, item, "input_output_alias")]


def parse_buffer_donor(text: str):
    """`{(0, {}), (1, {1})}` -> [(parameter, parameter index)]."""
    item = re.compile(r"\s*\(\s*(-?\d+)\s*,\s*" + _SHAPE_INDEX + r"\s*\)\s*(,|$)")
    return [(int(m.group(1)), _index(m.group(2))) for m in _braced_items(text, item, "buffer_donor")]


def parse_output_to_operand_aliasing(text: str):
    """`{{0}: (1, {}), {1}: (0, {0})}` -> [(output index, operand number, operand index)]."""
    item = re.compile(r"\s*" + _SHAPE_INDEX + r"\s*:\s*\(\s*(-?\d+)\s*,\s*" + _SHAPE_INDEX + r"\s*\)\s*(,|$)")
    return [(_index(m.group(1)), int(m.group(2)), _index(m.group(3)))
            for m in _braced_items(text, item, "output_to_operand_aliasing")]


def _braced_items(text: str, item: re.Pattern, attribute: str) -> list[re.Match]:
    """The matches of `item`, one after another, that make up the braced list `text` of `attribute`."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"expects '{{' at the start of {attribute}")
    matches, pos, inner = [], 0, body[1:-1]
    while inner[pos:].strip():
        m = item.match(inner, pos)
        if not m:
            raise ValueError(f"cannot parse '{inner[pos:].strip()[:40]}'")
        matches.append(m)
        pos = m.end()
    return matches
