"""mkdocs hooks for the course site (loaded by `hooks:` in mkdocs.yml).

- The *Stages* section of the navigation lists every ``docs/stages/*.md`` in
  file-name order, so a new stage page needs no edit of mkdocs.yml.
- The workshop notebooks live in ``notebooks/``, outside ``docs/``. They are
  added to the site at build time (mkdocs-jupyter renders them, without
  executing them). A notebook's page shows its executed copy from
  ``docs/notebooks-executed/`` when one is there (``python -m course notebooks
  --execute`` writes them on a GPU machine), else the committed notebook,
  which has no outputs. The *Notebooks* section lists the index page and one
  page per notebook.
- ``<!-- notebook-index -->`` in a page becomes a table of every notebook with
  a link to its page and a download link for the ``.ipynb``.
- Each notebook page starts with a download link and the command that runs it.
- ``assets/course-stages.svg``, the landing page's map of the stages, is drawn
  from the stage registry (``course.tools.stage_map``) at every build.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

from course.tools import stage_map
from course.tools.notebooks import EXECUTED_DIR, NOTEBOOK_DIR, notebooks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_INDEX_MARKER = "<!-- notebook-index -->"


def notebook_title(path: Path) -> str:
    """The first level-1 heading of the notebook's first markdown cell, else the file name."""
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") == "markdown":
            source = cell.get("source", "")
            text = "".join(source) if isinstance(source, list) else source
            for line in text.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
            break
    return path.stem


def download_href(path: Path) -> str:
    """Where mkdocs-jupyter's include_source puts the .ipynb: next to the page's index.html."""
    return f"{path.stem}/{path.name}"


def _fill_section(nav: list, title: str, children: list) -> None:
    for entry in nav:
        if isinstance(entry, dict) and title in entry:
            entry[title] = children
            return
    raise ValueError(f"mkdocs.yml: the nav has no section {title!r} for docs/hooks/course_site.py to fill")


def on_config(config):
    docs_dir = Path(config.docs_dir)
    stage_pages = sorted(p.relative_to(docs_dir).as_posix() for p in (docs_dir / "stages").glob("*.md"))
    _fill_section(config.nav, "Stages", stage_pages)
    _fill_section(
        config.nav, "Notebooks",
        [{"All notebooks": "notebooks/index.md"}]
        + [{notebook_title(nb): f"notebooks/{nb.name}"} for nb in notebooks()],
    )
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files, config):
    # The landing page's map of the stages, drawn from the stage registry at every build.
    files.append(File.generated(config, stage_map.SVG_PATH, content=stage_map.svg()))
    for nb in notebooks():
        uri = f"notebooks/{nb.name}"
        if files.get_file_from_path(uri) is None:
            # src_dir is the repository root, so the page's source is notebooks/<name>.ipynb itself.
            files.append(File(uri, src_dir=str(ROOT), dest_dir=config.site_dir,
                              use_directory_urls=config.use_directory_urls))
    return files


@event_priority(100)  # before mkdocs-jupyter renders the page from page.file.abs_src_path
def on_pre_page(page, config, files):
    """A notebook's page renders its executed copy (with outputs) when docs/notebooks-executed/ has one."""
    uri = page.file.src_uri
    executed = EXECUTED_DIR / Path(uri).name
    if uri.startswith("notebooks/") and uri.endswith(".ipynb") and executed.exists():
        page.file.abs_src_path = str(executed)
    return page


def on_page_markdown(markdown, page, config, files):
    if NOTEBOOK_INDEX_MARKER not in markdown:
        return markdown
    rows = ["| notebook | file | download |", "|---|---|---|"]
    for nb in notebooks():
        rows.append(
            f"| [{notebook_title(nb)}]({nb.name}) | `notebooks/{nb.name}` | "
            f'<a href="{download_href(nb)}" download="{nb.name}">{nb.name}</a> |'
        )
    return markdown.replace(NOTEBOOK_INDEX_MARKER, "\n".join(rows))


def on_page_content(content, page, config, files):
    path = Path(page.file.abs_src_path or "")
    if path.suffix != ".ipynb" or path.parent not in (NOTEBOOK_DIR, EXECUTED_DIR):
        return content
    name = html.escape(path.name)
    shown = ("Shown with the outputs of a run (docs/notebooks-executed/)." if path.parent == EXECUTED_DIR
             else "Shown without outputs.")
    banner = (
        '<div class="admonition info"><p class="admonition-title">Workshop notebook</p>'
        f'<p>{shown} <a href="{html.escape(path.name)}" download="{name}">Download {name}</a>, '
        f"or run it from the repository: <code>cd notebooks &amp;&amp; ../.venv/bin/jupyter execute {name}</code>. "
        "Without a Hopper GPU its GPU cells print why they were skipped and the rest runs.</p></div>"
    )
    return banner + content
