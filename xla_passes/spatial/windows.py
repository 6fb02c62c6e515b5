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
