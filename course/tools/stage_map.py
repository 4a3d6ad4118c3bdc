"""The landing page's map of the stages, drawn from the registry (``course.runtime.stages``) when the
site is built (docs/hooks/course_site.py), so it shows every stage the registry has and never goes
stale: a box per ready stage with its title and what it adds, in reading order along a snake (left to
right, then right to left), prefill, decode and backward stages in their own colours.
"""

from __future__ import annotations

import textwrap
from html import escape

from course.runtime import stages

SVG_PATH = "assets/course-stages.svg"  # where the site serves it (docs/index.md links it)
PER_ROW = 4
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN, TOP = 180, 104, 34, 34, 20, 40
COLOURS = {"prefill": ("#dbeafe", "#1e40af"), "decode": ("#ede9fe", "#5b21b6"), "backward": ("#dcfce7", "#166534")}
TITLE_CHARS, ADDS_CHARS, ADDS_LINES = 24, 31, 4  # what fits a box at 12 and 10.5 px


def box_origin(index: int) -> tuple[int, int]:
    """The top-left corner of the ``index``-th box: rows of PER_ROW, every other row right to left."""
    row, column = divmod(index, PER_ROW)
    if row % 2:
        column = PER_ROW - 1 - column
    return MARGIN + column * (BOX_W + GAP_X), TOP + row * (BOX_H + GAP_Y)


def arrow(index: int) -> str:
    """The arrow from box ``index`` to the next: sideways along a row, down at a row's end."""
    (x0, y0), (x1, y1) = box_origin(index), box_origin(index + 1)
    if y0 == y1:
        left_to_right = x1 > x0
        start = x0 + BOX_W if left_to_right else x0
        end = x1 - 3 if left_to_right else x1 + BOX_W + 3
        y = y0 + BOX_H // 2
        return f'<line x1="{start}" y1="{y}" x2="{end}" y2="{y}" class="arrow"/>'
    x = x0 + BOX_W // 2
    return f'<line x1="{x}" y1="{y0 + BOX_H}" x2="{x}" y2="{y1 - 3}" class="arrow"/>'


def stage_box(index: int, stage: stages.Stage) -> list[str]:
    x, y = box_origin(index)
    fill, stroke = COLOURS[stage.kind]
    title = textwrap.wrap(f"{stage.number} · {stage.title}", TITLE_CHARS)[:2]
    adds = textwrap.wrap(stage.adds, ADDS_CHARS)
    if len(adds) > ADDS_LINES:
        adds = adds[:ADDS_LINES - 1] + [textwrap.shorten(" ".join(adds[ADDS_LINES - 1:]), ADDS_CHARS)]
    centre = x + BOX_W // 2
    lines = [f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{fill}" stroke="{stroke}"/>']
    line_y = y + 18
    for text in title:
        lines.append(f'<text x="{centre}" y="{line_y}" text-anchor="middle" font-weight="bold">{escape(text)}</text>')
        line_y += 15
    line_y += 3
    for text in adds:
        lines.append(f'<text x="{centre}" y="{line_y}" text-anchor="middle" font-size="10.5">{escape(text)}</text>')
        line_y += 13
    return lines


def svg() -> str:
    """The map as an SVG document."""
    ready = [s for s in stages.STAGES if s.ready]
    rows = -(-len(ready) // PER_ROW)
    width = 2 * MARGIN + PER_ROW * BOX_W + (PER_ROW - 1) * GAP_X
    legend_y = TOP + rows * (BOX_H + GAP_Y)
    height = legend_y + 46
    body = [f'<text x="{MARGIN}" y="24" font-weight="bold">Each stage = the previous stage\'s kernel + one idea'
            "</text>"]
    for index, stage in enumerate(ready):
        body += stage_box(index, stage)
        if index + 1 < len(ready):
            body.append(arrow(index))
    for i, (kind, what) in enumerate((("prefill", "prefill: [B, S, H, D]"),
                                      ("decode", "decode: one query token per sequence"),
                                      ("backward", "backward: dQ, dK, dV"))):
        fill, stroke = COLOURS[kind]
        x = MARGIN + i * 260
        body += [f'<rect x="{x}" y="{legend_y}" width="16" height="12" fill="{fill}" stroke="{stroke}"/>',
                 f'<text x="{x + 24}" y="{legend_y + 10}" font-size="11">{what}</text>']
    body.append(f'<text x="{MARGIN}" y="{legend_y + 34}" font-size="11" fill="#374151">Every stage is a complete '
                "kernel; diff two consecutive solutions to see the one change.</text>")
    title = f"The {len(ready)} stages of the course, each adding one idea to the previous stage's kernel"
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f"  <title>{escape(title)}</title>",
        '  <defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>',
        '  <style>.arrow { stroke: #555; stroke-width: 2; marker-end: url(#arrow); }</style></defs>',
        f'  <rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        *(f"  {line}" for line in body),
        "</svg>",
    ]) + "\n"
