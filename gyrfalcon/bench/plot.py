"""``gyrfalcon bench --plot FILE.svg``: output tokens per second at each concurrency level, gyrfalcon's
and the peer's (``--peer-url``) from the same run, as a small SVG with the bench's header as its
caption (the CPU, its instruction set and both servers' threads). Plain SVG, written by hand: no
plotting library is a dependency, and the docs site shows it as an image."""

from __future__ import annotations

import html
import math
from typing import Any

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 30, 40, 110  # margins: axis labels below, the caption under them
SERIES = (("gyrfalcon", "#1f6feb"), ("peer", "#d1242f"))


def _ticks(top: float) -> list[float]:
    """Round values from 0 to at least ``top``, about five of them."""
    step = 10 ** math.floor(math.log10(max(top, 1e-9) / 5))
    for factor in (1, 2, 5, 10):
        if top / (step * factor) <= 6:
            step *= factor
            break
    return [step * i for i in range(int(math.ceil(top / step)) + 1)]


def svg(levels: list[int], series: dict[str, list[float]], caption: str) -> str:
    """The chart of ``series`` (name -> tok/s per level); levels are spaced evenly, in order."""
    values = [v for points in series.values() for v in points]
    ticks = _ticks(max(values, default=1.0))
    span_x, span_y = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(i: int) -> float:
        return LEFT + (span_x * (i + 0.5) / len(levels))

    def y(value: float) -> float:
        return TOP + span_y * (1 - value / ticks[-1])

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>']  # fmt: skip
    for tick in ticks:
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')  # fmt: skip
    for i, level in enumerate(levels):
        out.append(f'<text x="{x(i):.1f}" y="{TOP + span_y + 18}" text-anchor="middle">c={level}</text>')
    out.append(f'<text x="16" y="{TOP + span_y / 2:.0f}" transform="rotate(-90 16 {TOP + span_y / 2:.0f})" '
               f'text-anchor="middle">output tok/s</text>')  # fmt: skip
    for row, (name, color) in enumerate((s for s in SERIES if s[0] in series)):
        points = series[name]
        path = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(points))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for i, v in enumerate(points):
            out.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="4" fill="{color}"/>'
                       f'<text x="{x(i) + 7:.1f}" y="{y(v) - 7:.1f}" fill="{color}">{v:.1f}</text>')  # fmt: skip
        out.append(f'<rect x="{LEFT + 10}" y="{12 + 16 * row}" width="12" height="4" fill="{color}"/>'
                   f'<text x="{LEFT + 28}" y="{18 + 16 * row}">{name}</text>')  # fmt: skip
    words, lines = html.escape(caption).split(), [""]
    for word in words:  # the caption wrapped at about 100 characters, up to four lines
        lines[-1:] = [lines[-1] + " " + word] if len(lines[-1]) + len(word) < 100 else [lines[-1], word]
    for k, line in enumerate(lines[:4]):
        out.append(f'<text x="{LEFT - 50}" y="{TOP + span_y + 42 + 15 * k}" font-size="10" fill="#555">{line.strip()}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_plot(path: str, levels: list[int], loads: list[Any], peer_loads: list[Any], caption: str) -> None:
    """Draw the run's loads (and the peer's, when there were) into ``path``."""
    series = {"gyrfalcon": [load.output_tokens_per_s for load in loads]}
    if peer_loads:
        series["peer"] = [load.output_tokens_per_s for load in peer_loads]
    with open(path, "w", encoding="utf-8") as f:
        f.write(svg(levels, series, caption))
