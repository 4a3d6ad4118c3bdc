"""The command outputs the docs quote, from real runs: ``python -m course.tools.transcripts`` writes docs/transcripts/.

Each transcript is what one ``course`` command prints, run in a scratch copy of this
repository whose stages/ holds the generated skeletons, so a learner's edits never reach
the pages. They are runs on a machine without a GPU (what the pages say they show). The
seconds on the progress lines change from run to run; ``comparable`` leaves them out.
tests/test_docs.py reruns them and compares, and checks the end of each stage page's
"Expected output" (``first_failure``) against ``course check N -x`` on the skeleton.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course.runtime import stages
from course.tools import skeleton

DIR = stages.ROOT / "docs" / "transcripts"
TRANSCRIPTS = {  # file name (without .txt): the arguments of `python -m course`
    "check-01-skeleton": ("check", "1"),
    "check-01-solutions": ("check", "1", "--impl", "solutions"),
}
SECONDS = re.compile(r"\(\d+\.\d s\)")


def comparable(text: str) -> str:
    return SECONDS.sub("(s)", text)


def first_failure(text: str) -> str:
    """The end of a failing ``course check``: from "Not there yet." on (the same with and without -x)."""
    return text[text.index("Not there yet."):] if "Not there yet." in text else ""


def scratch_copy(target: Path, files: dict[str, str]) -> Path:
    """The code, tests and solutions of this repository in ``target``, with stages/ as the generator makes it,
    then ``files`` ({path in the repository: text}) written over it."""
    for folder in ("course", "tests", "solutions"):
        shutil.copytree(stages.ROOT / folder, target / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(stages.ROOT / "pyproject.toml", target)
    (target / "stages").mkdir()
    (target / "stages" / "__init__.py").write_text("")
    for stage in skeleton.ready_stages():
        (target / "stages" / stage.path("stages").name).write_text(skeleton.expected_skeleton(stage))
    for path, text in files.items():
        (target / path).write_text(text)
    return target


def run(commands: dict, files: dict[str, str] | None = None) -> dict:
    """{name: what ``python -m course *arguments`` printed} for {name: arguments}, side by side in one scratch
    copy; ``files`` replaces files of the copy (a learner's edit of a skeleton, say)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "COLUMNS")}
    with tempfile.TemporaryDirectory(prefix="course-transcripts-") as tmp:
        root = scratch_copy(Path(tmp), files or {})

        def output(name: str) -> str:
            done = subprocess.run([sys.executable, "-m", "course", *commands[name]], cwd=root, env=env,
                                  capture_output=True, text=True)
            return done.stdout

        with ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) // 2))) as pool:
            return dict(zip(commands, pool.map(output, commands)))


def main() -> int:
    DIR.mkdir(parents=True, exist_ok=True)
    for name, text in run(TRANSCRIPTS).items():
        (DIR / f"{name}.txt").write_text(text)
        print(f"wrote {(DIR / f'{name}.txt').relative_to(stages.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
