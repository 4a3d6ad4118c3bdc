"""The diff between consecutive solutions: the one idea a stage adds, as the docs show it.

``python -m course diffs`` writes docs/diffs/stageNN-stageMM.diff for every pair
of consecutive ready prefill stages; a test proves the committed files are
current, so a page that includes one can never drift from the code.
"""

from __future__ import annotations

import difflib

from course.stages import ROOT, STAGES

DIFF_DIR = ROOT / "docs" / "diffs"


def consecutive_pairs():
    ready = [s for s in STAGES if s.ready and s.number <= 6]
    return list(zip(ready, ready[1:]))


def diff_path(before, after):
    return DIFF_DIR / f"stage{before.number:02d}-stage{after.number:02d}.diff"


def solution_diff(before, after) -> str:
    old = before.path("solutions").read_text().splitlines(keepends=True)
    new = after.path("solutions").read_text().splitlines(keepends=True)
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
