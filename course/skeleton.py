"""Generate the learner's skeletons in ``stages/`` from the solutions.

In a solution, the code that teaches stage N sits between two markers:

    # [exercise N] One line that says what to write.
    ...solution code...
    # [/exercise]

In stage N's skeleton that region becomes a ``TODO(stage N)`` comment with
the hint and a ``NotImplementedError`` that names the function to finish.
Regions of other stages stay as they are, so a skeleton differs from its
solution only where that stage's idea lives. Regenerate with
``python -m course skeletons``; a test proves ``stages/`` is up to date.
"""

from __future__ import annotations

import re

from course.stages import STAGES, Stage

OPEN = re.compile(r"^(?P<indent>\s*)# \[exercise (?P<stage>\d+)\] (?P<hint>.+?)\s*$")
CLOSE = re.compile(r"^\s*# \[/exercise\]\s*$")
DEF = re.compile(r"^\s*def (\w+)\(")


def skeleton_source(solution: str, stage: int, docs_page: str) -> str:
    """The skeleton text for ``stage`` made from a solution's text."""
    out: list[str] = []
    inside = False
    function = "<module>"
    for number, line in enumerate(solution.splitlines(keepends=True), start=1):
        if DEF.match(line):
            function = DEF.match(line).group(1)
        opened = OPEN.match(line)
        if inside:
            if OPEN.match(line):
                raise ValueError(f"line {number}: exercise region opened inside another one")
            inside = not CLOSE.match(line)
            continue
        if opened and int(opened["stage"]) == stage:
            indent, hint = opened["indent"], opened["hint"]
            message = f"TODO(stage {stage}) in {function}(): {hint} Hints: docs/{docs_page}"
            out.append(f"{indent}# TODO(stage {stage}): {hint}\n")
            out.append(f"{indent}raise NotImplementedError({message!r})\n")
            inside = True
            continue
        if CLOSE.match(line):
            raise ValueError(f"line {number}: '# [/exercise]' without an opening marker")
        out.append(line)
    if inside:
        raise ValueError("an exercise region is not closed with '# [/exercise]'")
    return "".join(out)


def expected_skeleton(stage: Stage) -> str:
    return skeleton_source(stage.path("solutions").read_text(), stage.number, stage.docs_page)


def out_of_date() -> list[Stage]:
    """Ready stages whose file in stages/ is not what the generator makes."""
    stale = []
    for stage in STAGES:
        if stage.ready:
            path = stage.path("stages")
            if not path.exists() or path.read_text() != expected_skeleton(stage):
                stale.append(stage)
    return stale


def write_all() -> list[str]:
    """Regenerate every ready stage's skeleton; return the paths written."""
    written = []
    for stage in STAGES:
        if stage.ready:
            stage.path("stages").write_text(expected_skeleton(stage))
            written.append(str(stage.path("stages").relative_to(stage.path("stages").parent.parent)))
    return written
