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
    """The skeleton text for ``stage`` made from a solution's text.

    Regions may nest (a later stage's region inside an earlier one's): only the
    regions of ``stage`` are cut, together with anything nested inside them.
    """
    out: list[str] = []
    stack: list[bool] = []  # one entry per open region: is it cut from this skeleton?
    function = "<module>"
    for number, line in enumerate(solution.splitlines(keepends=True), start=1):
        if DEF.match(line):
            function = DEF.match(line).group(1)
        opened, closed = OPEN.match(line), CLOSE.match(line)
        inside_cut = any(stack)
        if opened:
            cut = int(opened["stage"]) == stage
            stack.append(cut)
            if cut and not inside_cut:
                indent, hint = opened["indent"], opened["hint"]
                message = f"TODO(stage {stage}) in {function}(): {hint} Hints: docs/{docs_page}"
                out.append(f"{indent}# TODO(stage {stage}): {hint}\n")
                out.append(f"{indent}raise NotImplementedError({message!r})\n")
            if cut or inside_cut:
                continue
        elif closed:
            if not stack:
                raise ValueError(f"line {number}: '# [/exercise]' without an opening marker")
            if stack.pop() or any(stack):
                continue
        elif inside_cut:
            continue
        out.append(line)
    if stack:
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
