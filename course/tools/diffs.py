"""The diff between consecutive solutions: the one idea a stage adds, as the docs show it.

``python -m course diffs`` writes docs/diffs/stageNN-stageMM.diff for every ready
prefill stage and the stage it starts from; a test proves the committed files
are current, so a page that includes one can never drift from the code.
"""

from __future__ import annotations

import difflib
import re

from course.runtime.stages import ROOT, STAGES

DIFF_DIR = ROOT / "docs" / "diffs"


def consecutive_pairs():
    """(predecessor, stage) for every ready prefill stage after the first: the stage it starts from
    (stage 8 starts from stage 6), else the prefill stage before it."""
    prefill = [s for s in STAGES if s.ready and s.kind == "prefill"]
    by_number = {s.number: s for s in prefill}
    return [(by_number[after.starts_from] if after.starts_from else before, after)
            for before, after in zip(prefill, prefill[1:]) if after.diffed]


def diff_path(before, after):
    return DIFF_DIR / f"stage{before.number:02d}-stage{after.number:02d}.diff"


SNIPPET_MARKER = re.compile(r"^\s*# --8<-- \[(start|end):\w+\]\s*$")


def code_lines(stage) -> list[str]:
    """The solution's lines without the docs' snippet markers: each page marks what it includes, and
    that bookkeeping is not part of what a stage changes."""
    return [line for line in stage.path("solutions").read_text().splitlines(keepends=True)
            if not SNIPPET_MARKER.match(line)]


def solution_diff(before, after) -> str:
    old = code_lines(before)
    new = code_lines(after)
    return "".join(difflib.unified_diff(
        old, new, f"solutions/{before.module_name}.py", f"solutions/{after.module_name}.py", n=2,
    ))


def out_of_date() -> list[str]:
    return [str(diff_path(a, b).relative_to(ROOT)) for a, b in consecutive_pairs()
            if not diff_path(a, b).exists() or diff_path(a, b).read_text() != solution_diff(a, b)]


def write_all() -> list[str]:
    DIFF_DIR.mkdir(parents=True, exist_ok=True)
    written = []
    for before, after in consecutive_pairs():
        diff_path(before, after).write_text(solution_diff(before, after))
        written.append(str(diff_path(before, after).relative_to(ROOT)))
    return written
