"""Typed values of instruction attributes, each parsed from and printed to XLA's syntax.

Plain values use Python types: `int`, `bool`, `str` (enums such as `direction=LT` and quoted strings
such as `custom_call_target="foo"`), `tuple[int, ...]` (`dimensions={0,1}`), an `HloComputation`
(`to_apply=`), a tuple of computations (`branch_computations=`) or of instructions
(`control-predecessors=`). Structured values have a class here. Attributes this module does not
know stay `Raw` and print exactly as they were written.
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
    """
    kind: str                                   # replicated | maximal | manual | tiled | unknown | tuple
    tile_dims: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    iota: IotaTileAssignment | None = None
    last_tile_dim_replicate: bool = False
    last_tile_dims: tuple[str, ...] = ()        # subgroup types, e.g. ("manual",)
    elements: tuple["Sharding", ...] = ()
    device: int | None = None                   # for maximal
    extra: str = ""                             # metadata={...} and other fields kept verbatim

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
        return _parse_single_sharding(body, text)

    def __str__(self):
        if self.kind == "tuple":
            return "{" + ", ".join(str(e) for e in self.elements) + "}"
        parts = []
        if self.kind in ("replicated", "manual", "unknown"):
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
        if tok in ("replicated", "manual", "unknown"):
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
