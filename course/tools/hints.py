"""``course hint N [EXERCISE [LEVEL]]``: a stage's hints one at a time, in the terminal.

Each stage page folds its hints (``??? tip "Hint 2: ..."``) so that a reader opens them in order, from a
nudge to nearly the answer. Read as raw markdown, in an editor or a terminal, the folds are open: Hint 3
sits right under Hint 1. This command prints the one hint asked for and says how to get the next.

    python -m course hint 8          # the stage's exercises, numbered
    python -m course hint 8 2        # exercise 2's first hint
    python -m course hint 8 2 3      # its third
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

from course.runtime import stages

FOLD = re.compile(r'^\?\?\?\+? \w+ "(?P<title>[^"]*)"\s*$')
HINT_TITLE = re.compile(r"^Hint (?P<level>\d+)(?::\s*(?P<rest>.*))?$")
HEADER = re.compile(r"^#### (?P<name>.+?)\s*$")


@dataclass
class Exercise:
    name: str
    hints: list[tuple[str, str]] = field(default_factory=list)  # (title, text), Hint 1 first


def _folds(lines: list[str]):
    """(title, body) of every fold and (None, header) of every #### header, in order."""
    index = 0
    while index < len(lines):
        header, fold = HEADER.match(lines[index]), FOLD.match(lines[index])
        index += 1
        if header:
            yield None, header["name"]
        elif fold:
            body = []
            while index < len(lines) and (not lines[index].strip() or lines[index].startswith("    ")):
                body.append(lines[index])
                index += 1
            yield fold["title"], textwrap.dedent("\n".join(body)).strip()


def _hints_section(page: str) -> list[str]:
    """The lines of the page's "### Hints" section (up to the next heading of its level or above)."""
    lines = page.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "### Hints"), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^#{1,3} ", lines[i])), len(lines))
    return lines[start + 1:end]


def _label(title_rest: str) -> str:
    """A group's name from its first hint's title when no #### header names it: "`f`, the idea" -> "`f`"."""
    return re.sub(r",\s*the idea$", "", title_rest or "").strip() or "exercise"


def exercises(page: str) -> list[Exercise]:
    """The page's exercises, each with its hints in order: a group starts at every "Hint 1"."""
    found: list[Exercise] = []
    header = None
    for title, body in _folds(_hints_section(page)):
        if title is None:
            header = body
            continue
        hint = HINT_TITLE.match(title)
        if not hint:
            continue
        if hint["level"] == "1" or not found:
            found.append(Exercise((header if header else _label(hint["rest"])).replace("`", "")))
            header = None
        found[-1].hints.append((title, body))
    return found


def _pick(found: list[Exercise], which: str) -> int:
    if which.isdigit() and 1 <= int(which) <= len(found):
        return int(which) - 1
    matches = [i for i, exercise in enumerate(found) if which in exercise.name]
    if len(matches) != 1:
        names = "; ".join(f"{i + 1}: {exercise.name}" for i, exercise in enumerate(found))
        raise ValueError(f"{which!r} names {'no' if not matches else 'more than one'} exercise of this stage "
                         f"(by number or part of its name): {names}")
    return matches[0]


def main(number: int, which: str | None = None, level: int = 1) -> int:
    stage = stages.get(number)
    page = stages.ROOT / "docs" / stage.docs_page
    found = exercises(page.read_text())
    command = f"{stages.COURSE_COMMAND} hint {number}"
    if not found:
        print(f"Stage {number}'s page (docs/{stage.docs_page}) has no hints.")
        return 1
    if which is None:
        print(f"Stage {number} ({stage.title}): the hints of each exercise, one at a time.")
        for i, exercise in enumerate(found, start=1):
            print(f"  {i}. {exercise.name} ({len(exercise.hints)} hints): {command} {i}")
        return 0
    try:
        index = _pick(found, which)
    except ValueError as error:
        print(error)
        return 1
    exercise = found[index]
    if not 1 <= level <= len(exercise.hints):
        print(f"{exercise.name} has hints 1 to {len(exercise.hints)}; there is no hint {level}.")
        return 1
    title, text = exercise.hints[level - 1]
    text = re.sub(r"\[([^\]]+)\]\(#[^)]*\)", r"\1 (on the page)", text)  # in-page links mean nothing here
    print(f"{exercise.name}, {title}\n\n{text}\n")
    if level < len(exercise.hints):
        print(f"Still stuck? The next one says more: {command} {index + 1} {level + 1}")
    else:
        print(f"That was the last hint. The solution is folded under Solutions on docs/{stage.docs_page}.")
    return 0
