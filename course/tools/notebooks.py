"""The workshop notebooks: run them top to bottom, and keep executed copies for the site.

notebooks/ is committed without outputs (a test checks it), so a fresh clone never shows
someone else's numbers. The site can still show a real run: on a Hopper GPU,

    python -m course notebooks --execute --out docs/notebooks-executed/

writes an executed copy of every notebook there, and the docs hook renders a notebook's
executed copy instead of the output-free one when it exists.
"""

from __future__ import annotations

from pathlib import Path

from course.runtime.stages import ROOT

NOTEBOOK_DIR = ROOT / "notebooks"
EXECUTED_DIR = ROOT / "docs" / "notebooks-executed"
CELL_TIMEOUT_S = 600  # the longest cell compiles several kernels, or benchmarks on a GPU


def notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def execute(path: Path):
    """Run every cell of the notebook at ``path`` from notebooks/ (as a participant would); return it with outputs."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    return notebook


def write_executed(out_dir: Path) -> list[Path]:
    """Execute every notebook and write the executed copies to ``out_dir``; return their paths."""
    import nbformat

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks():
        nbformat.write(execute(path), out_dir / path.name)
        written.append(out_dir / path.name)
    return written
