"""Halo arithmetic: what one device needs to compute its slab of a windowed op.

One dimension of a convolution or reduce-window is split into slabs: device d holds input
rows [d*S_in, (d+1)*S_in) and computes output rows [d*S_out, (d+1)*S_out). In the
(lhs-dilated, padded) input, input row i sits at position `pad_lo + i*ld` and output row o
reads positions `o*stride + j*rd` for j in [0, window). The slabs line up when
`S_in*ld == S_out*stride`: then every device needs the same number of rows from its
neighbours (the halo) and runs the same local window, whose padding is the global padding
shifted by the halo. Rows before the first or after the last device's slab arrive as zeros
(no neighbour sends them) and are the global padding; rows past the end of an uneven split
are masked by the caller.

The same arithmetic serves a convolution whose window is split (a weight gradient: the
kernel-sized output is a partial sum over the device's window rows) with `out_rows` the
full output size, `window` the device's window rows and `S_out*rd == S_in*ld`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The local window of one split dimension.

    The device's input is its slab with `have_low` rows of the previous devices before it
    and `have_high` rows of the next ones after it; the local op, with `padding_low/high`,
    yields the device's output rows plus `out_low`/`out_high` rows of its neighbours'
    (halo fusion: rows computed twice so that the next window needs no exchange).
    """

    need_low: int       # rows before the slab the output needs (negative: rows it skips)
    need_high: int
    have_low: int
    have_high: int
    padding_low: int
    padding_high: int
    out_low: int = 0
    out_high: int = 0


def aligned_output_rows(in_rows: int, base_dilation: int, stride: int) -> int | None:
    """Output rows per device that keep the slabs lined up, or None when none do."""
    span = in_rows * base_dilation
    return span // stride if span % stride == 0 and span >= stride else None


def needed_rows(*, in_rows: int, padding_low: int, base_dilation: int, stride: int,
                window_dilation: int, window: int, out_rows: int, out_low: int = 0,
                out_high: int = 0) -> tuple[int, int]:
    """(rows before, rows after) the slab that the local output rows read."""
    low = (out_low * stride + padding_low) // base_dilation
    last = (out_rows + out_high - 1) * stride + (window - 1) * window_dilation - padding_low
    return low, last // base_dilation - in_rows + 1


def plan_window(*, in_rows: int, padding_low: int, base_dilation: int, stride: int,
                window_dilation: int, window: int, out_rows: int, out_low: int = 0,
                out_high: int = 0, have_low: int | None = None,
                have_high: int | None = None) -> WindowPlan:
    """The local window for a device with `in_rows` slab rows computing `out_rows` (plus
    `out_low`/`out_high` neighbour rows), given the halo rows it has (default: just enough)."""
    need_low, need_high = needed_rows(
        in_rows=in_rows, padding_low=padding_low, base_dilation=base_dilation, stride=stride,
        window_dilation=window_dilation, window=window, out_rows=out_rows, out_low=out_low,
        out_high=out_high)
    have_low = max(need_low, 0) if have_low is None else have_low
    have_high = max(need_high, 0) if have_high is None else have_high
    if have_low < need_low or have_high < need_high:
        raise ValueError(f"halo ({have_low}, {have_high}) is narrower than needed ({need_low}, {need_high})")
    local_low = padding_low - have_low * base_dilation + out_low * stride
    last = (out_rows + out_low + out_high - 1) * stride + (window - 1) * window_dilation
    extent = in_rows + have_low + have_high
    local_high = last - (local_low + (extent - 1) * base_dilation)
    return WindowPlan(need_low, need_high, have_low, have_high, local_low, local_high, out_low, out_high)


@dataclasses.dataclass(frozen=True)
class ScatterPlan:
    """The local select-and-scatter of one split dimension.

    The device scatters `source_low` + its own + `source_high` source rows into its slab
    extended by `operand_low`/`operand_high` rows (every window that touches the slab),
    then keeps its own rows.
    """

    source_low: int
    source_high: int
    operand_low: int
    operand_high: int


def plan_select_and_scatter(*, operand_rows: int, source_rows: int, window: int, stride: int,
                            padding_low: int) -> ScatterPlan | None:
    """The halos of a split select-and-scatter, or None when the slabs do not line up
    (`operand_rows != source_rows*stride`) or the local windows would need negative padding."""
    if operand_rows != source_rows * stride:
        return None
    source_low = max((window - 1 - padding_low) // stride, 0)
    source_high = max((operand_rows - 1 + padding_low) // stride - source_rows + 1, 0)
    operand_low = source_low * stride + padding_low
    operand_high = (source_rows + source_high - 1) * stride - padding_low + window - operand_rows
    if operand_low < 0 or operand_high < 0:
        return None
    return ScatterPlan(source_low, source_high, operand_low, operand_high)


# -- windows whose output slabs do not line up with the input slabs ---------------------------------
#
# As GSPMD does (spmd_partitioner_util.cc, ExchangeHaloAndGetValidData): device coordinate c
# reads input rows [starts[c], starts[c] + count), a range whose offset from its slab varies
# with c. It exchanges the widest halo any device needs, pads locally where no device has the
# rows, dynamic-slices its range at an offset read from a table indexed by partition-id, and
# masks the rows outside the array. The local window then has no padding.


@dataclasses.dataclass(frozen=True)
class RowRange:
    """Rows [starts[c], starts[c] + count) of a split dimension that coordinate c reads
    (global row indices; those outside the array read as the padding value)."""

    starts: tuple[int, ...]
    count: int


@dataclasses.dataclass(frozen=True)
class RowFetch:
    """How each device assembles its RowRange from its slab of `local` rows: exchange `low`
    rows from the previous devices and `high` from the next ones, pad the result by
    `pad_low`/`pad_high` rows, and slice `count` rows from `offsets[c]`."""

    low: int
    high: int
    pad_low: int
    pad_high: int
    offsets: tuple[int, ...]


def plan_row_fetch(rows: RowRange, local: int, size: int) -> RowFetch:
    """The halo exchange and dynamic slice that give coordinate c rows `rows.starts[c]...`
    of an array of `size` rows split into slabs of `local` rows. Only rows inside the array
    are exchanged (the others are padding), so no halo reaches past the last device."""
    low = high = 0
    for c, start in enumerate(rows.starts):
        first, stop = max(start, 0), min(start + rows.count, size)
        if first < stop:
            low = max(low, c * local - first)
            high = max(high, stop - (c + 1) * local)
    pad_low = max([0] + [c * local - low - start for c, start in enumerate(rows.starts)])
    pad_high = max([0] + [start + rows.count - (c + 1) * local - high for c, start in enumerate(rows.starts)])
    offsets = tuple(start - (c * local - low - pad_low) for c, start in enumerate(rows.starts))
    return RowFetch(low, high, pad_low, pad_high, offsets)


def window_row_range(*, parts: int, out_rows: int, padding_low: int, stride: int, window_dilation: int,
                     window: int) -> RowRange:
    """The (base-dilated) input rows a device's `out_rows` output rows read, for each of
    `parts` devices; the local window over them has no padding."""
    count = (out_rows - 1) * stride + (window - 1) * window_dilation + 1
    return RowRange(tuple(c * out_rows * stride - padding_low for c in range(parts)), count)


def scatter_row_ranges(*, parts: int, operand_rows: int, window: int, stride: int,
                       padding_low: int) -> tuple[RowRange, RowRange]:
    """(source rows, operand rows) of a select-and-scatter whose device c owns operand rows
    [c*operand_rows, (c+1)*operand_rows): every window that touches them, and every row those
    windows cover. The local select-and-scatter over them has no padding; the device's own
    rows start `c*operand_rows - operand.starts[c]` into its result (possibly before it:
    rows no window touches)."""
    first = [-((padding_low - window + 1 + c * operand_rows) // -stride) for c in range(parts)]
    last = [((c + 1) * operand_rows - 1 + padding_low) // stride for c in range(parts)]
    count = max(1, max(b - a + 1 for a, b in zip(first, last)))
    source = RowRange(tuple(first), count)
    operand = RowRange(tuple(a * stride - padding_low for a in first), (count - 1) * stride + window)
    return source, operand
