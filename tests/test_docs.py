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

from course.runtime import stages
from course import testing
from course.tools import notebooks, transcripts

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = notebooks.NOTEBOOK_DIR
NOTEBOOKS = notebooks.notebooks()


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
    """The stage table on the home page matches course/runtime/stages.py (number, title, status)."""
    text = (ROOT / "docs" / "index.md").read_text()
    rows = {int(m[1]): m[0] for m in re.finditer(r"^\| (\d+) \|.*\|$", text, flags=re.MULTILINE)}
    for stage in stages.STAGES:
        assert stage.number in rows, f"docs/index.md: the stage table has no row for stage {stage.number}"
        row = rows[stage.number]
        assert stage.title in row, f"docs/index.md: stage {stage.number}'s row does not say {stage.title!r}: {row}"
        status = "ready" if stage.ready else "planned"
        assert row.rstrip("| ").endswith(status), f"docs/index.md: stage {stage.number} should be {status}: {row}"


READY = [s for s in stages.STAGES if s.ready]


@pytest.mark.compiles
def test_stage_pages_show_what_course_check_prints():
    """Each stage page's "Expected output" ends with what `course check N` really prints on the untouched
    skeleton: the first failing test, the line of the skeleton and the TODO message (a run with -x, which
    stops there with the same lines; course.tools.transcripts runs it in a scratch copy)."""
    outputs = transcripts.run({s.number: ("check", str(s.number), "-x") for s in READY})
    stale = []
    for stage in READY:
        tail = transcripts.first_failure(outputs[stage.number])
        assert tail, f"`course check {stage.number}` on the skeleton did not fail:\n{outputs[stage.number][-3000:]}"
        if tail not in (ROOT / "docs" / stage.docs_page).read_text():
            stale.append(f"docs/{stage.docs_page} should end its Expected output block with:\n{tail}")
    assert not stale, "\n\n".join(stale)


@pytest.mark.compiles
def test_quoted_transcripts_are_real_runs():
    """docs/transcripts/ (included by how-it-works.md) is what the commands print today, seconds aside."""
    if testing.gpu_skip_reason() is None:
        pytest.skip("the pages quote runs on a machine without a GPU; this one has a Hopper GPU")
    for name, text in transcripts.run(transcripts.TRANSCRIPTS).items():
        committed = (transcripts.DIR / f"{name}.txt").read_text()
        assert transcripts.comparable(committed) == transcripts.comparable(text), (
            f"docs/transcripts/{name}.txt is not what `python -m course {' '.join(transcripts.TRANSCRIPTS[name])}` "
            f"prints now; regenerate with `python -m course.tools.transcripts`.\n--- printed ---\n{text}")


def test_setup_page_quotes_the_status_footnote():
    """setup.md quotes the line `course status` prints without a GPU."""
    reason = testing.gpu_skip_reason()
    if reason is None or not reason.startswith("no CUDA GPU"):
        pytest.skip("the page quotes a machine without any CUDA GPU")
    from course.tools import cli

    assert cli.gpu_columns_note(reason) in (ROOT / "docs" / "setup.md").read_text()


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


# Notebooks that need an optional extra of pyproject.toml: {notebook: (module, extra)}. `make test` installs it.
NOTEBOOK_EXTRAS = {"10_gpt_oss.ipynb": ("transformers", "models")}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    if path.name in NOTEBOOK_EXTRAS:
        module, extra = NOTEBOOK_EXTRAS[path.name]
        pytest.importorskip(module, reason=f"{path.name} needs the {extra} extra: pip install -e '.[{extra}]'")
    notebooks.execute(path)


@pytest.mark.parametrize("folder", ["results", "results/h200"])
def test_results_tables_are_generated(tmp_path, folder):
    """docs/<folder>/results-tables.md, bench.md and stageNN.md are exactly what `python -m course.tools.results`
    writes from bench.json (docs/results: the course's GPU; results/h200: a run on another GPU, kept apart)."""
    import shutil

    from course.tools import results

    shutil.copy(ROOT / "docs" / folder / "bench.json", tmp_path / "bench.json")
    results.render(tmp_path, folder)
    names = [results.TABLES, results.BENCH_MD] + [results.stage_file(s.number) for s in stages.STAGES if s.ready]
    for name in names:
        committed = (ROOT / "docs" / folder / name).read_text()
        assert committed == (tmp_path / name).read_text(), (
            f"docs/{folder}/{name} is not what course.tools.results renders from bench.json; "
            f"regenerate it with `python -m course.tools.results --dir docs/{folder}` (never edit it by hand)"
        )


def test_models_table_is_generated():
    """docs/results/models.md is what `python -m course model-bench --render` writes from models.json (or,
    before the first measurement, its "not measured yet" text)."""
    import json

    from course.tools import model_bench

    source = ROOT / "docs" / "results" / model_bench.MODELS_JSON
    expected = model_bench.table(json.loads(source.read_text()) if source.exists() else None)
    assert (ROOT / "docs" / "results" / model_bench.MODELS_MD).read_text() == expected, (
        "docs/results/models.md is not what course.tools.model_bench renders; regenerate it with "
        "`python -m course model-bench --render` (never edit it by hand)"
    )


def test_host_table_is_generated():
    """docs/results/host.md is what `python -m course host-bench --render` writes from host.json."""
    import json

    from course.tools import host_bench

    results = json.loads((ROOT / "docs" / "results" / host_bench.HOST_JSON).read_text())
    assert (ROOT / "docs" / "results" / host_bench.HOST_MD).read_text() == host_bench.table(results), (
        "docs/results/host.md is not what course.tools.host_bench renders; regenerate it with "
        "`python -m course host-bench --render` (never edit it by hand)"
    )


def test_host_table_compares_each_call_with_cudnn():
    """The renderer on a made-up measurement (never written anywhere): ratios to SDPA cuDNN's row."""
    from course.tools import host_bench

    env = {"gpu": "GPU", "torch": "2", "nvidia_cutlass_dsl": "4", "date": "today"}
    rows = [{"call": "stage 9 decode_attention", "host_us": 20.0, "eager_us": 25.0},
            {"call": "SDPA cuDNN", "host_us": 50.0, "eager_us": 50.0}]
    results = {"environment": env, "prefill": host_bench.PREFILL, "decode": host_bench.DECODE,
               "rows": {"prefill": rows, "decode": rows}}
    text = host_bench.table(results)
    assert "| stage 9 decode_attention | 20.0 | 0.40x | 25.0 | 2.00 |" in text
    assert "| SDPA cuDNN | 50.0 | 1.00x | 50.0 | 1.00 |" in text


def test_models_table_shows_every_row():
    """The renderer on a made-up measurement (never written anywhere): times, a refused backend, an error."""
    from course.tools import model_bench

    env = {"gpu": "GPU", "driver": "1", "torch": "2", "transformers": "5.23.0", "nvidia_cutlass_dsl": "4",
           "date": "today", "course": {"prefill": 6, "decode": 7, "impl": "solutions"}}
    rows = [{"model": "gpt-oss", "backend": "sdpa", "error": "transformers refuses it: no SDPA"}]
    rows += [{"model": "gpt-oss", "backend": backend, "phase": "decode", "batch": 1, "tokens": 4096, "ms": ms}
             for backend, ms in (("course", 2.0), ("eager", 5.0))]
    rows.append({"model": "llama", "backend": "eager", "phase": "prefill", "batch": 1, "tokens": 4096,
                 "error": "out of memory"})
    rows.append({"model": "llama", "backend": "course", "phase": "decode", "batch": 8, "tokens": 4096,
                 "mode": "static+compile", "ms": 1.0})
    rows.append({"model": "llama", "backend": "sdpa", "phase": "decode", "batch": 8, "tokens": 4096,
                 "mode": "static+compile", "ms": 1.5})
    results = {"environment": env, "decode_steps": 32, "rows": rows}
    text = model_bench.table(results)
    assert ("| GPT-OSS, 8 layers | decode B=1, 32 steps after 4096 tokens, eager | 2.00 | refused | 5.00 | - "
            "| 2.50x |") in text
    assert "| Llama, same attention | prefill, 4096 tokens | refused | refused | out of memory | - | - |" in text
    assert ("| Llama, same attention | decode B=8, 32 steps after 4096 tokens, static+compile | 1.00 | 1.50 | "
            "refused | 1.50x | - |") in text
    assert "- GPT-OSS, 8 layers, sdpa: transformers refuses it: no SDPA" in text
    assert [ax.get_title() for ax in model_bench.figure(results).axes] == [
        "decode B=1, 32 steps after 4096 tokens, eager",
        "decode B=8, 32 steps after 4096 tokens,\nstatic+compile"]


def test_summary_table_of_a_grouping():
    """The per-grouping summary of stage 9's results on made-up rows (never written anywhere): the median
    over contiguous shapes, the lowest ratio, the widest paged gap, the lowest copy share next to cuDNN's,
    and the FP8 speed-ups from L = 32k on."""
    from dataclasses import asdict

    from course.tools import results
    from course.runtime.shapes import DecodeShape

    def row(kernel, shape, ms, **extra):
        return {"kernel": kernel, "label": shape.label, "shape": asdict(shape), "ms": ms, **extra}

    rows = []
    for batch, seqlen, ms in ((1, 4096, 0.010), (1, 32768, 0.020), (8, 32768, 0.080), (8, 131072, 0.300)):
        contiguous = DecodeShape(batch, seqlen, heads_q=8, heads_kv=1)
        paged = DecodeShape(batch, seqlen, heads_q=8, heads_kv=1, paged=True)
        rows.append(row("SDPA cuDNN", contiguous, ms, copy_fraction=0.9 if batch == 8 else 0.45))
        rows.append(row("stage 9", contiguous, ms / (1.10 if batch == 8 else 0.90),
                        copy_fraction=0.95 if batch == 8 else 0.5))
        rows.append(row("stage 9", paged, ms / (1.05 if seqlen == 32768 and batch == 8 else 0.89)))
        rows.append(row("stage 9 fp8", contiguous, ms, speedup_vs_fp16=1.9 if batch == 8 else 1.1))
    lines = results.summary_table(rows, 9)
    assert lines[2] == ("| 8/1 | 1.00x | 0.89x (B1 4k paged) | 0.21 (B8 128k) | 50% (B1 32k; cuDNN 45%) "
                        "| 95% (B8 32k; cuDNN 90%) | 1.10x | 1.90x |"), lines[2]
    assert len(lines) == 3


def test_results_figures_are_readable_at_page_width():
    """No results figure is a strip: at page width, one wider than 3:1 shrinks its labels past reading."""
    from PIL import Image

    for path in sorted((ROOT / "docs" / "results").glob("*.png")):
        width, height = Image.open(path).size
        assert width <= 3 * height, (f"docs/results/{path.name} is {width} x {height}: draw it as panels (see "
                                     "course/tools/bench.py's plots) so it is at most three times as wide as tall")


def test_results_tables_cover_every_measured_stage():
    import json

    from course.tools import results

    data = json.loads((ROOT / "docs" / "results" / "bench.json").read_text())
    text = results.tables(data)
    for key in ("gpu", "driver", "torch", "nvidia_cutlass_dsl", "date"):
        assert str(data["environment"][key]) in text, f"the results tables do not show the {key}"
    for number in {row["stage"] for row in data["rows"] if row["stage"] is not None}:  # None: SDPA rows
        assert f"## {results.stage_heading(number)}" in text


CUTE_EXAMPLES = ROOT / "docs" / "primers" / "cute_layouts.py"


def test_cute_primer_examples_print_what_the_page_shows():
    """The CuTe primer's examples run on the CPU (trace time only) and print the committed output."""
    result = subprocess.run([sys.executable, str(CUTE_EXAMPLES)], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, f"{CUTE_EXAMPLES.relative_to(ROOT)} failed:\n{result.stderr[-3000:]}"
    expected = CUTE_EXAMPLES.with_suffix(".txt").read_text()
    assert result.stdout == expected, (
        f"{CUTE_EXAMPLES.relative_to(ROOT)} now prints something else than the page shows; rerun it with\n"
        f"  python {CUTE_EXAMPLES.relative_to(ROOT)} > {CUTE_EXAMPLES.with_suffix('.txt').relative_to(ROOT)}\n"
        f"and check the text of docs/primers/cute.md against the new output.\n--- printed ---\n{result.stdout}"
    )


def test_every_stage_page_is_in_the_navigation():
    """The hook fills the Stages section from docs/stages/*.md, so every page there is reachable."""
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    config.plugins.on_startup(command="build", dirty=False)
    config = config.plugins.on_config(config)
    stages_section = next(entry["Stages"] for entry in config.nav if isinstance(entry, dict) and "Stages" in entry)
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs" / "stages").glob("*.md"))
    assert stages_section == pages


def test_troubleshooting_quotes_the_real_input_errors():
    """The errors quoted on the troubleshooting page are what stage 1 raises today, word for word."""
    import torch

    module = stages.get(1).load("solutions")

    def t(*shape, dtype=torch.float16):
        return torch.randn(*shape).to(dtype)

    cases = [
        lambda: module.attention(t(1, 128, 8, 72), t(1, 128, 8, 72), t(1, 128, 8, 72)),
        lambda: module.attention(t(1, 128, 8, 96), t(1, 128, 8, 96), t(1, 128, 8, 96)),
        lambda: module.attention(t(1, 128, 8, 64), t(1, 128, 3, 64), t(1, 128, 3, 64)),
        lambda: module.attention(t(1, 128, 8, 64, dtype=torch.float32), t(1, 128, 8, 64), t(1, 128, 8, 64)),
        lambda: module.attention(t(1, 64, 8, 128).transpose(2, 3), t(1, 64, 8, 128), t(1, 64, 8, 128)),
        lambda: module.attention(t(1, 128, 8, 64), t(1, 128, 8, 64), t(1, 128, 8, 64)),
        lambda: module.attention(t(1, 128, 8, 64), t(1, 128, 8, 64), t(1, 128, 8, 64), causal=True),
        lambda: module.attention(t(1, 128, 8, 64), t(1, 512, 8, 64), t(1, 512, 8, 64)),
    ]
    page = (ROOT / "docs" / "workshop" / "troubleshooting.md").read_text()
    for case in cases:
        with pytest.raises((ValueError, TypeError, NotImplementedError)) as raised:
            case()
        line = f"{type(raised.value).__name__}: {raised.value}"
        assert line in page, f"docs/workshop/troubleshooting.md does not quote the current message:\n{line}"


# ---------------------------------------------------------------- no spoilers on the pages

SNIPPET_LINE = re.compile(r'^(?P<indent>\s*)--8<--\s+"(?P<target>[^"]+)"\s*$')
SNIPPET_BLOCK = re.compile(r"^\s*--8<--\s*$")
FOLD_START = re.compile(r"^(?P<indent>\s*)\?\?\?(?P<open>\+?)\s")
EXERCISE_HEADING = "## The exercise"
STAGE_PAGES = sorted((ROOT / "docs" / "stages").glob("[0-9][0-9]-*.md"))


def _snippet_includes(text: str):
    """(line number, target, folded) for every pymdownx.snippets include of a page.

    ``folded`` is True when the include sits inside a closed ``???`` block (rendered as a
    ``<details>`` element that is closed on load). Both the one-line form and the block form
    (``--8<--`` lines around a list of files) are recognized.
    """
    folds: list[tuple[int, bool]] = []  # (indent, closed on load) of the ??? blocks around the line
    in_block = False
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while folds and indent <= folds[-1][0]:
            folds.pop()
        fold = FOLD_START.match(line)
        if fold:
            folds.append((indent, not fold["open"]))  # ???+ renders open: it hides nothing
            continue
        if SNIPPET_BLOCK.match(line):
            in_block = not in_block
            continue
        folded = any(closed for _, closed in folds)
        if in_block:
            target = line.strip()
            if target and not target.startswith(";"):
                yield number, target, folded
            continue
        include = SNIPPET_LINE.match(line)
        if include:
            yield number, include["target"], folded


def _included_text(target: str) -> tuple[Path, str]:
    """The file a snippet target names, and the text the include pulls in (a section, lines, or all)."""
    path, _, rest = target.partition(":")
    file = ROOT / path
    text = file.read_text()
    if not rest:
        return file, text
    if re.fullmatch(r"[\d:,-]+", rest):  # line ranges, e.g. file.py:10:20
        return file, text
    start = re.search(rf"--8<-- \[start:{re.escape(rest)}\]", text)
    end = re.search(rf"--8<-- \[end:{re.escape(rest)}\]", text)
    assert start and end, f"{target}: no section {rest!r} in {path}"
    return file, text[start.end():end.start()]


def _exercise_stages(target: str) -> set[int]:
    """The stages whose answers an include shows: [exercise N] regions of its text, or the diff's stage."""
    path = target.partition(":")[0]
    diff = re.fullmatch(r"docs/diffs/stage\d\d-stage(\d\d)\.diff", path)
    if diff:
        return {int(diff[1])}
    if not path.startswith("solutions/"):
        return set()
    _, text = _included_text(target)
    return {int(n) for n in re.findall(r"#\s*\[exercise (\d+)\]", text)}


@pytest.mark.parametrize("page", STAGE_PAGES, ids=[p.stem for p in STAGE_PAGES])
def test_stage_page_shows_no_answer_before_the_exercise(page):
    """A stage page teaches with code that is not its exercise, and folds each answer after it.

    An include is an answer to stage N (the page's own stage) when it is a solutions/ section
    that contains an ``[exercise N]`` region, or the diff docs/diffs/stageMM-stageNN.diff.
    It must come after the page's exercise heading and inside a closed ``???`` block.
    Regions of earlier stages are not answers to this one: later skeletons contain them.
    """
    stage = int(page.name[:2])
    text = page.read_text()
    lines = text.splitlines()
    headings = [i for i, line in enumerate(lines, start=1) if line.strip() == EXERCISE_HEADING]
    rel = page.relative_to(ROOT)
    assert headings, f"{rel} has no '{EXERCISE_HEADING}' heading; every stage page states its exercise under one"
    exercise_line = headings[0]
    problems = []
    for number, target, folded in _snippet_includes(text):
        if stage not in _exercise_stages(target):
            continue
        where = []
        if number < exercise_line:
            where.append(f"before the '{EXERCISE_HEADING}' heading (line {exercise_line})")
        if not folded:
            where.append("outside a closed '???' block")
        if where:
            problems.append(
                f'{rel}, line {number}: --8<-- "{target}" shows the answer to stage {stage}\'s exercise, '
                f"{' and '.join(where)}. Teach that part with other code or ```text pseudo-code, and show "
                f"this include after the exercise, indented under "
                f'??? success "Solution: <function>" (or ??? info for a diff), which renders closed.'
            )
    assert not problems, "\n".join(problems)


# Every other page: the course pages, primers, and the stage pages beside a stage's own (engineering notes, extras).
OTHER_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in STAGE_PAGES)


@pytest.mark.parametrize("page", OTHER_PAGES, ids=[p.relative_to(ROOT / "docs").as_posix() for p in OTHER_PAGES])
def test_other_pages_fold_every_answer(page):
    """Primers and the course pages may show an exercise's answer only inside a closed ``???`` block."""
    rel = page.relative_to(ROOT)
    problems = []
    for number, target, folded in _snippet_includes(page.read_text()):
        path = target.partition(":")[0]
        own = re.match(r"(?:solutions/stage|docs/diffs/stage\d\d-stage)(\d\d)", path)
        if own and int(own[1]) in _exercise_stages(target) and not folded:
            problems.append(
                f'{rel}, line {number}: --8<-- "{target}" shows the answer to a stage {int(own[1])} exercise '
                "unfolded. Explain it in prose or ```text pseudo-code, or put the include under a closed "
                '??? success "Solution: <function>" block.'
            )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("stage", [s for s in READY if s.cpu_numerics], ids=lambda s: f"stage{s.number}")
def test_exercise_says_which_todos_the_cpu_numerics_cover(stage):
    """One sentence of the page's exercise names every TODO function that `course check` runs on the CPU."""
    text = (ROOT / "docs" / stage.docs_page).read_text()
    start = text.index(EXERCISE_HEADING)
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    missing = [name for name in stage.cpu_numerics if f"`{name}`" not in section]
    assert "On the CPU" in section and not missing, (
        f"docs/{stage.docs_page}: the exercise should say, in a sentence starting 'On the CPU', which TODOs the CPU "
        f"numerics run (stage.cpu_numerics in course/runtime/stages.py); missing: {missing}")


def test_notebook_pages_render_executed_copies_when_present(tmp_path, monkeypatch):
    """`course notebooks --execute` writes executed copies; the hook renders a notebook's page from its copy."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("course_site", ROOT / "docs" / "hooks" / "course_site.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    monkeypatch.setattr(hook, "EXECUTED_DIR", tmp_path)
    (tmp_path / NOTEBOOKS[0].name).write_text(NOTEBOOKS[0].read_text())

    def rendered_from(notebook):
        page = SimpleNamespace(file=SimpleNamespace(src_uri=f"notebooks/{notebook.name}", abs_src_path=str(notebook)))
        return hook.on_pre_page(page, None, None).file.abs_src_path

    assert rendered_from(NOTEBOOKS[0]) == str(tmp_path / NOTEBOOKS[0].name)
    assert rendered_from(NOTEBOOKS[1]) == str(NOTEBOOKS[1])  # no executed copy: the committed notebook


@pytest.mark.parametrize("executed", sorted(notebooks.EXECUTED_DIR.glob("*.ipynb")), ids=lambda p: p.stem)
def test_executed_copies_show_the_committed_notebooks(executed):
    """The site shows an executed copy in place of its notebook, so its cells must be the notebook's, and ran clean."""
    import nbformat

    notebook = notebooks.NOTEBOOK_DIR / executed.name
    assert notebook.exists(), f"{executed}: no notebooks/{executed.name}; delete the stale executed copy"
    ran = nbformat.read(executed, as_version=4)
    assert [c.source for c in ran.cells] == [c.source for c in nbformat.read(notebook, as_version=4).cells], (
        f"{executed} was executed from an older notebooks/{executed.name}: rerun `python -m course notebooks "
        "--execute` on a Hopper GPU, or delete the copy so the site shows the notebook without outputs")
    errors = [o.ename for c in ran.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{executed} holds errors from its run: {errors}"


def test_the_landing_pages_stage_map_has_every_ready_stage():
    """The map is drawn from the registry: one box per ready stage, with its number and title, in order."""
    import xml.etree.ElementTree as ET

    from course.tools import stage_map

    root = ET.fromstring(stage_map.svg())
    ns = "{http://www.w3.org/2000/svg}"
    bold = " ".join(t.text for t in root.iter(f"{ns}text") if t.get("font-weight") == "bold")
    ready = [s for s in stages.STAGES if s.ready]
    positions = [bold.find(f"{s.number} · ") for s in ready]
    assert -1 not in positions and positions == sorted(positions), bold
    boxes = [r for r in root.iter(f"{ns}rect") if r.get("rx")]
    assert len(boxes) == len(ready)
    assert "assets/course-stages.svg" in (ROOT / "docs" / "index.md").read_text()


@pytest.mark.compiles
@pytest.mark.parametrize("number", [8, 11])
def test_sass_listing_is_what_course_sass_prints(capsys, number):
    """A page's SASS listing is the output of `python -m course sass N` for the kernel as it is now."""
    from course.tools import sass

    if sass.tool_dir() is None:
        pytest.skip("cuobjdump is not installed: pip install -e '.[dev]' brings nvidia-cuda-cuobjdump")
    sass.main(number)
    printed = capsys.readouterr().out
    listing = f"docs/results/stage{number:02d}-sass.txt"
    assert printed == (ROOT / listing).read_text(), (
        f"{listing} is not what `python -m course sass {number}` prints now; regenerate it with "
        f"`python -m course sass {number} > {listing}` and read the page's SASS paragraphs again")


ALL_PAGES = sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("page", ALL_PAGES, ids=[p.relative_to(ROOT / "docs").as_posix() for p in ALL_PAGES])
def test_code_includes_sit_in_code_blocks(page):
    """An include of code (a .py section or a diff) outside a ``` block renders as prose: its comments become
    headings, its lines one paragraph."""
    rel = page.relative_to(ROOT)
    fenced, problems = False, []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        include = SNIPPET_LINE.match(line)
        if include and not fenced and re.search(r"\.(py|diff)(:|$)", include["target"]):
            problems.append(f'{rel}, line {number}: --8<-- "{include["target"]}" is outside a ``` block')
    assert not problems, "\n".join(problems)
