"""Generate the learner's skeletons in ``stages/`` from the solutions.

In a solution, the code that teaches stage N sits between two markers:

    # [exercise N] What must hold when the code below has run, in a sentence
    #   or a few lines: comment lines that follow the marker, indented two more
    #   spaces after the '#', continue the hint.
    ...solution code...
    # [/exercise]

In stage N's skeleton that region becomes a ``TODO(stage N)`` comment with
the hint and a ``NotImplementedError`` that names the function to finish.
Regions of other stages stay as they are, so a skeleton differs from its
solution only where that stage's idea lives. Regenerate with
``python -m course skeletons``; a test proves the committed ``stages/`` is up
to date. The files in ``stages/`` are the learner's work: regenerating refuses
to overwrite a file that differs from its skeleton (``--force`` keeps a backup),
and ``python -m course reset N`` starts one stage over, keeping a backup.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

from course.runtime.stages import STAGES, Stage

OPEN = re.compile(r"^(?P<indent>\s*)# \[exercise (?P<stage>\d+)\] (?P<hint>.+?)\s*$")
MORE = "#   "  # after the indent of an opening marker: a line that continues its hint
CLOSE = re.compile(r"^\s*# \[/exercise\]\s*$")
DEF = re.compile(r"^\s*def (\w+)\(")


def hints_pointer(stage: int, docs_page: str) -> str:
    """Where a learner gets a stage's hints, as the TODO messages and ``course check`` say it."""
    return f"Hints, one at a time: python -m course hint {stage} (docs/{docs_page} as raw markdown shows them all at once)"


def skeleton_source(solution: str, stage: int, docs_page: str) -> str:
    """The skeleton text for ``stage`` made from a solution's text.

    Regions may nest (a later stage's region inside an earlier one's): only the
    regions of ``stage`` are cut, together with anything nested inside them.
    """
    out: list[str] = []
    stack: list[bool] = []  # one entry per open region: is it cut from this skeleton?
    function = "<module>"
    lines = solution.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if DEF.match(line):
            function = DEF.match(line).group(1)
        opened, closed = OPEN.match(line), CLOSE.match(line)
        inside_cut = any(stack)
        if opened:
            cut = int(opened["stage"]) == stage
            stack.append(cut)
            if cut and not inside_cut:
                indent = opened["indent"]
                hint = [opened["hint"], *hint_continuation(lines[number:], indent)]
                message = f"TODO(stage {stage}) in {function}(): {' '.join(hint)} {hints_pointer(stage, docs_page)}"
                out.append(f"{indent}# TODO(stage {stage}): {hint[0]}\n")
                out.extend(f"{indent}{MORE}{more}\n" for more in hint[1:])
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


def hint_continuation(following: list[str], indent: str) -> list[str]:
    """The lines of ``following`` (the lines after an opening marker) that continue its hint: comment
    lines at the marker's indent whose text starts two spaces further in (``MORE``)."""
    more = []
    for line in following:
        if not line.startswith(indent + MORE):
            break
        more.append(line[len(indent + MORE):].strip())
    return more


def exercise_functions(stage: Stage) -> list[str]:
    """The functions that hold stage ``stage``'s exercise regions, in file order: the names its TODOs give."""
    names: list[str] = []
    function = "<module>"
    for line in stage.path("solutions").read_text().splitlines():
        if DEF.match(line):
            function = DEF.match(line).group(1)
        opened = OPEN.match(line)
        if opened and int(opened["stage"]) == stage.number and function not in names:
            names.append(function)
    return names


def expected_skeleton(stage: Stage) -> str:
    return skeleton_source(stage.path("solutions").read_text(), stage.number, stage.docs_page)


def committed(path: Path) -> str | None:
    """The file as committed (``git show HEAD:...``), or None without git, outside a repository, or for a new file."""
    try:
        shown = subprocess.run(["git", "-C", str(path.parent), "show", f"HEAD:./{path.name}"],
                               capture_output=True, text=True)
    except FileNotFoundError:  # no git on this machine
        return None
    return shown.stdout if shown.returncode == 0 else None


def ready_stages() -> list[Stage]:
    return [stage for stage in STAGES if stage.ready]


def out_of_date() -> list[Stage]:
    """Ready stages whose skeleton is not what the generator makes, neither as committed nor in the working tree.

    The committed skeleton is the course's and the working tree is the learner's, so editing
    stages/ passes as long as the committed file is current. After a change to a solution, the
    regenerated working tree passes before it is committed. Without git only the working tree counts.
    """
    stale = []
    for stage in ready_stages():
        path = stage.path("stages")
        versions = {committed(path), path.read_text() if path.exists() else None}
        if expected_skeleton(stage) not in versions:
            stale.append(stage)
    return stale


def is_edited(stage: Stage) -> bool:
    """Does stages/ hold work of the learner's? True when the file is neither the generator's
    output nor the committed skeleton (a skeleton left behind by a change to a solution is not edited)."""
    path = stage.path("stages")
    return path.exists() and path.read_text() not in {expected_skeleton(stage), committed(path)}


class EditedSkeletons(Exception):
    """Regenerating would overwrite the learner's edits in these files."""

    def __init__(self, paths: list[Path]):
        super().__init__(", ".join(str(p) for p in paths))
        self.paths = paths


def backup(path: Path) -> Path:
    """Copy ``path`` to ``<name>.bak-<timestamp>`` next to it (never over an earlier backup); return the copy."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    copy = path.with_name(f"{path.name}.bak-{stamp}")
    n = 1
    while copy.exists():
        n += 1
        copy = path.with_name(f"{path.name}.bak-{stamp}-{n}")
    shutil.copy2(path, copy)
    return copy


def _write_skeleton(stage: Stage, keep_backup: bool) -> Path | None:
    path = stage.path("stages")
    kept = backup(path) if keep_backup else None
    path.write_text(expected_skeleton(stage))
    return kept


def reset(stage: Stage) -> Path | None:
    """Write ``stage``'s skeleton to stages/; the file it replaces is kept as a backup (returned),
    unless it was the skeleton already."""
    path = stage.path("stages")
    return _write_skeleton(stage, keep_backup=path.exists() and path.read_text() != expected_skeleton(stage))


def write_all(force: bool = False) -> list[tuple[Path, Path | None]]:
    """Regenerate every ready stage's skeleton: [(path, the backup of the learner's edits or None)].

    Raises EditedSkeletons, before writing anything, when a file holds the learner's edits;
    ``force`` overwrites them and keeps a backup of each.
    """
    edited = [stage for stage in ready_stages() if is_edited(stage)]
    if edited and not force:
        raise EditedSkeletons([stage.path("stages") for stage in edited])
    return [(stage.path("stages"), _write_skeleton(stage, keep_backup=stage in edited)) for stage in ready_stages()]
