"""Line charts as self-contained SVG, for scaling tables (benchmarks/pod_scaling.py).

Log-scaled axes (chips double, step times span orders of magnitude), one coloured line with
markers per series, a legend, no scripts or external fonts, so the file renders the same on
GitHub, in a browser and inside `hlo-tools report` pages.
"""
from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
DASHES = ("", "6,3", "2,3", "8,3,2,3")


def _log_ticks(low: float, high: float) -> list[float]:
    """1, 2 and 5 times the powers of ten between low and high (at least the two ends' decades)."""
    ticks = []
    for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        ticks += [m * 10 ** exponent for m in (1, 2, 5) if low <= m * 10 ** exponent <= high]
    return ticks or [low, high]


def _label(value: float) -> str:
    return f"{value:g}" if value < 1e4 else f"{value:.0e}".replace("e+0", "e")


def line_chart_svg(series: dict[str, list[tuple[float, float]]], *, title: str, x_label: str, y_label: str,
                   y_scale: float = 1.0, width: int = 760, height: int = 420) -> str:
    """An SVG chart of each series' (x, y) points, x and y on log axes; y shown times ``y_scale``."""
    points = {name: [(x, y * y_scale) for x, y in values if x > 0 and y > 0] for name, values in series.items()}
    xs = [x for values in points.values() for x, _ in values]
    ys = [y for values in points.values() for _, y in values]
    if not xs:
        raise ValueError("nothing to plot: no positive points")
    left, right, top, bottom = 70, 230, 40, 50
    x_low, x_high = min(xs), max(xs) if max(xs) > min(xs) else min(xs) * 2
    y_low, y_high = min(ys) / 1.2, max(ys) * 1.2

    def sx(x: float) -> float:
        return left + (math.log(x) - math.log(x_low)) / (math.log(x_high) - math.log(x_low)) * (width - left - right)

    def sy(y: float) -> float:
        return height - bottom - (math.log(y) - math.log(y_low)) / (math.log(y_high) - math.log(y_low)) \
            * (height - top - bottom)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>']
    for x in sorted(set(xs)):
        parts.append(f'<line x1="{sx(x):.1f}" y1="{top}" x2="{sx(x):.1f}" y2="{height - bottom}" stroke="#eee"/>'
                     f'<text x="{sx(x):.1f}" y="{height - bottom + 15}" text-anchor="middle">{_label(x)}</text>')
    for y in _log_ticks(y_low, y_high):
        parts.append(f'<line x1="{left}" y1="{sy(y):.1f}" x2="{width - right}" y2="{sy(y):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{_label(y)}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
                 f'fill="none" stroke="#888"/>'
                 f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{escape(x_label)} '
                 f'(log scale)</text>'
                 f'<text transform="translate(16,{(top + height - bottom) / 2}) rotate(-90)" '
                 f'text-anchor="middle">{escape(y_label)} (log scale)</text>')
    for index, (name, values) in enumerate(points.items()):
        colour, dash = PALETTE[index % len(PALETTE)], DASHES[index // len(PALETTE) % len(DASHES)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(values))
        parts.append(f'<g class="series"><title>{escape(name)}</title>'
                     f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"'
                     + (f' stroke-dasharray="{dash}"' if dash else "") + "/>"
                     + "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>'
                               for x, y in values) + "</g>")
        legend_y = top + 8 + 16 * index
        parts.append(f'<line x1="{width - right + 12}" y1="{legend_y}" x2="{width - right + 36}" y2="{legend_y}" '
                     f'stroke="{colour}" stroke-width="2"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>"
                     f'<text x="{width - right + 42}" y="{legend_y + 4}">{escape(name)}</text>')
    parts.append("</svg>\n")
    return "\n".join(parts)
