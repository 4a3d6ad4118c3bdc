"""The docs site builds cleanly and the workshop notebooks are committed clean and run.

Without a GPU the notebooks run in their CPU mode: the reference, the sm_90a
cross-compile, and GPU cells that print why they were skipped. On a Hopper GPU
the same test runs every cell for real.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course import stages

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_mkdocs_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's end-of-life banner
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"


def test_every_ready_stage_has_a_notebook_and_a_docs_page():
    for stage in stages.STAGES:
        if stage.ready:
            notebook = NOTEBOOK_DIR / f"{stage.number:02d}_{stage.slug}.ipynb"
            assert notebook.exists(), f"stage {stage.number} has no workshop notebook ({notebook.relative_to(ROOT)})"
            page = ROOT / "docs" / stage.docs_page
            assert page.exists(), f"stage {stage.number} has no docs page ({page.relative_to(ROOT)})"


def test_home_page_lists_every_stage():
    """The stage table on the home page matches course/stages.py (number, title, status)."""
    text = (ROOT / "docs" / "index.md").read_text()
    rows = {int(m[1]): m[0] for m in re.finditer(r"^\| (\d+) \|.*\|$", text, flags=re.MULTILINE)}
    for stage in stages.STAGES:
        assert stage.number in rows, f"docs/index.md: the stage table has no row for stage {stage.number}"
        row = rows[stage.number]
        assert stage.title in row, f"docs/index.md: stage {stage.number}'s row does not say {stage.title!r}: {row}"
        status = "ready" if stage.ready else "planned"
        assert row.rstrip("| ").endswith(status), f"docs/index.md: stage {stage.number} should be {status}: {row}"


READY = [s for s in stages.STAGES if s.ready]


@pytest.mark.parametrize("stage", READY, ids=lambda s: f"stage{s.number}")
def test_docs_page_shows_the_real_first_todo(stage):
    """The 'expected output while unsolved' on a stage page is what the skeleton really raises."""
    module = stage.load("stages")
    with pytest.raises(NotImplementedError) as raised:
        module.cross_compile_config(*module.KERNEL_CONFIGS[0])
    page = ROOT / "docs" / stage.docs_page
    assert str(raised.value) in page.read_text(), (
        f"{page.relative_to(ROOT)} shows an outdated TODO message; the skeleton now raises:\n{raised.value}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (
        f"{path.relative_to(ROOT)}: code cells {dirty} have stored outputs or execution counts. "
        "Clear all outputs before committing (Jupyter: Edit > Clear Outputs of All Cells, or "
        f"`jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)}`)."
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()
