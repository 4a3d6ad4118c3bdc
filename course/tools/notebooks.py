"""The workshop notebooks: run them top to bottom, and keep executed copies for the site.

notebooks/ is committed without outputs (a test checks it), so a fresh clone never shows
someone else's numbers. The site can still show a real run: on a Hopper GPU,

    python -m course notebooks --execute --out docs/notebooks-executed/

writes an executed copy of every notebook there, and the docs hook renders a notebook's
executed copy instead of the output-free one when it exists. ``--only NAME`` runs one notebook,
``--in-process`` runs the cells without a Jupyter kernel (``execute_in_process``).
"""

from __future__ import annotations

import io
from pathlib import Path

from course.runtime.stages import ROOT

NOTEBOOK_DIR = ROOT / "notebooks"
EXECUTED_DIR = ROOT / "docs" / "notebooks-executed"
CELL_TIMEOUT_S = 600  # the longest cell compiles several kernels, or benchmarks on a GPU


def notebooks(only=None) -> list[Path]:
    """The workshop notebooks, or those of ``only`` (names without ``.ipynb``)."""
    found = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if only:
        missing = set(only) - {path.stem for path in found}
        if missing:
            raise ValueError(f"no notebook named {', '.join(sorted(missing))} in {NOTEBOOK_DIR}; there are: "
                             f"{', '.join(path.stem for path in found)}")
        found = [path for path in found if path.stem in only]
    return found


def execute(path: Path, in_process: bool = False):
    """Run every cell of the notebook at ``path`` from notebooks/ (as a participant would); return it with outputs.
    ``in_process``: in this Python process (``execute_in_process``) instead of a Jupyter kernel."""
    import nbformat

    if in_process:
        return execute_in_process(path)
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    return notebook


class _Stream(io.TextIOBase):
    """A cell's stdout or stderr: appended to its outputs (one stream output per run of text), and echoed."""

    def __init__(self, outputs: list, name: str, echo):
        self.outputs, self.name, self.echo = outputs, name, echo

    def write(self, text: str) -> int:
        last = self.outputs[-1] if self.outputs else None
        if last is not None and last["output_type"] == "stream" and last["name"] == self.name:
            last["text"] += text
        elif text:
            self.outputs.append({"output_type": "stream", "name": self.name, "text": text})
        self.echo.write(text)
        return len(text)


def execute_in_process(path: Path):
    """Run the notebook's code cells in this process, in one namespace, from the notebook's folder, as a kernel
    would: for a machine without a Jupyter kernel (the GPU machines the course's own runs use). A cell's stdout
    and stderr become its stream outputs, its matplotlib figures (drawn with the Agg backend) image outputs. A
    cell that raises stops the run: the exception propagates (its traceback in this process's output) and no
    executed copy is written."""
    import base64
    import contextlib
    import os
    import sys

    import matplotlib
    import nbformat

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notebook = nbformat.read(path, as_version=4)
    namespace = {"__name__": "__main__"}
    previous = os.getcwd()
    os.chdir(path.parent)
    try:
        count = 0
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            count += 1
            outputs = []
            streams = _Stream(outputs, "stdout", sys.stdout), _Stream(outputs, "stderr", sys.stderr)
            try:
                with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
                    exec(compile(cell.source, f"<{path.name}, cell {count}>", "exec"), namespace)
            finally:
                for number in plt.get_fignums():  # what plt.show() would have displayed
                    image = io.BytesIO()
                    plt.figure(number).savefig(image, format="png", bbox_inches="tight")
                    outputs.append({"output_type": "display_data", "metadata": {},
                                    "data": {"image/png": base64.b64encode(image.getvalue()).decode(),
                                             "text/plain": "<Figure>"}})
                plt.close("all")
                cell.outputs = [nbformat.from_dict(output) for output in outputs]
                cell.execution_count = count
    finally:
        os.chdir(previous)
    return notebook


def write_executed(out_dir: Path, only=None, in_process: bool = False) -> list[Path]:
    """Execute every notebook (or those of ``only``) and write the executed copies to ``out_dir``; return their
    paths."""
    import nbformat

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks(only):
        nbformat.write(execute(path, in_process), out_dir / path.name)
        written.append(out_dir / path.name)
    return written
