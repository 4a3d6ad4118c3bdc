"""Checks of the shared course code: the reference against brute force, the skeletons, the benchmark plan."""

import math
import os
import shutil

import pytest
import torch

from course.runtime import stages, validation
from course.testing import reference
from course.tools import bench, diffs, skeleton
from course.tools import results as results_page
from course.__main__ import main


def brute_force(q, k, v, *, scale, visible, sink=None):
    """Row by row with Python loops over keys: the definitions, nothing clever."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    o = torch.zeros(b, s_q, h_q, d, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for h in range(h_q):
            hk = h // (h_q // h_kv)
            for i in range(s_q):
                logits = [float(q[bi, i, h].double() @ k[bi, j, hk].double()) * scale
                          for j in range(s_k) if visible(i, j)]
                keys = [j for j in range(s_k) if visible(i, j)]
                terms = logits + ([float(sink[h])] if sink is not None else [])
                if not terms:
                    continue
                m = max(terms)
                denom = sum(math.exp(t - m) for t in terms)
                lse[bi, h, i] = m + math.log(denom)
                for s, j in zip(logits, keys):
                    o[bi, i, h] += math.exp(s - m) / denom * v[bi, j, hk].double()
    return o, lse


CASES = [
    dict(), dict(causal=True), dict(window_size=(2, 1)), dict(window_size=(0, 0)),
    dict(window_size=(1, -1), num_sink_tokens=2), dict(causal=True, sink_logits=True),
    dict(window_size=(0, 0), sink_logits=True),
]


@pytest.mark.parametrize("s_q, s_k", [(5, 7), (7, 5), (6, 6)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "full")
def test_reference_matches_brute_force(s_q, s_k, case):
    gen = torch.Generator().manual_seed(s_q * 10 + s_k)
    q = torch.randn(2, s_q, 4, 8, generator=gen)
    k = torch.randn(2, s_k, 2, 8, generator=gen)
    v = torch.randn(2, s_k, 2, 8, generator=gen)
    features = dict(case)
    sink = torch.randn(4, generator=gen) * 3 if features.pop("sink_logits", False) else None
    left, right = validation.resolve_window(features.get("causal", False), features.get("window_size", (-1, -1)))
    n_sink, offset = features.get("num_sink_tokens", 0), s_k - s_q

    def visible(i, j):
        ok = right < 0 or j <= i + offset + right
        return ok and (left < 0 or j >= i + offset - left or j < n_sink)

    o, lse = reference.attention(q, k, v, sink_logits=sink, return_lse=True, **features)
    o_bf, lse_bf = brute_force(q, k, v, scale=8 ** -0.5, visible=visible, sink=sink)
    torch.testing.assert_close(o, o_bf, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse.double(), lse_bf, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("s_q, s_k", [(5, 7), (7, 5)])
def test_reference_alibi_matches_brute_force(s_q, s_k):
    """ALiBi: - slope_h x |query position - key position| on the scaled logit, positions bottom-right aligned;
    a decode step (one query, the last position) is the same as a prefill row there."""
    gen = torch.Generator().manual_seed(s_q + s_k)
    q, k, v = torch.randn(1, s_q, 4, 8, generator=gen), torch.randn(1, s_k, 2, 8, generator=gen), \
        torch.randn(1, s_k, 2, 8, generator=gen)
    slopes = torch.tensor([0.5, 0.25, 0.125, 1.0])
    o = reference.attention(q, k, v, alibi_slopes=slopes)
    offset = s_k - s_q
    for h in range(4):
        for i in range(s_q):
            logits = torch.tensor([float(q[0, i, h].double() @ k[0, j, h // 2].double()) * 8 ** -0.5
                                   - float(slopes[h]) * abs(i + offset - j) for j in range(s_k)], dtype=torch.float64)
            expected = torch.softmax(logits, 0) @ v[0, :, h // 2].double()
            torch.testing.assert_close(o[0, i, h], expected, rtol=1e-9, atol=1e-9)
    cache = {"k_cache": k, "v_cache": v, "cache_seqlens": torch.tensor([s_k], dtype=torch.int32)}
    last = reference.decode_attention(q[:, -1], **cache, alibi_slopes=slopes)  # the last row sits at s_k - 1
    torch.testing.assert_close(last[0], o[0, -1], rtol=1e-9, atol=1e-9)


def test_reference_empty_rows_are_zero_with_minus_inf_lse():
    q, k, v = (torch.randn(1, 4, 1, 8) for _ in range(3))
    o, lse = reference.attention(q, k, v, window_size=(0, 0), causal=True, return_lse=True)
    o2, lse2 = reference.attention(q[:, :3], k[:, :1], v[:, :1], causal=True, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()  # each row sees its diagonal key
    assert (o2[:, :2] == 0).all() and torch.isneginf(lse2[:, :, :2]).all()  # S_q > S_k: first rows see nothing
    sink = torch.tensor([1.5])
    o3, lse3 = reference.attention(q[:, :3], k[:, :1], v[:, :1], causal=True, sink_logits=sink, return_lse=True)
    assert (o3[:, :2] == 0).all() and torch.allclose(lse3[:, :, :2], torch.tensor(1.5))


def test_validation_names_what_is_accepted():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"expected a contiguous \[2\] float32 tensor \(one natural-log logit per query head\)"):
        validation.check_attention_inputs(q, q, q, sink_logits=torch.zeros(3))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        validation.check_attention_inputs(q, q, q, window_size=(-2, 0))


def test_docs_diffs_are_current():
    stale = diffs.out_of_date()
    assert not stale, f"{stale} are out of date: run `python -m course diffs` after editing solutions/"


def test_skeletons_are_generated_from_solutions():
    """The committed stages/ is what the generator makes (a learner's edits in the working tree do not count)."""
    stale = skeleton.out_of_date()
    assert not stale, (
        f"stages/ is out of date for stage(s) {[s.number for s in stale]}: the generator's output is neither the "
        "committed skeleton nor the file in the working tree. After editing solutions/, run "
        "`python -m course skeletons` and commit stages/ with the solutions.")


@pytest.mark.compiles
@pytest.mark.parametrize("stage", [s for s in stages.STAGES if s.ready], ids=lambda s: f"stage{s.number}")
def test_skeleton_fails_with_its_todo(stage, generated_skeleton):
    """The untouched skeleton imports, and compiling it stops at the first TODO with its hint."""
    module = generated_skeleton(stage)
    with pytest.raises(NotImplementedError, match=rf"TODO\(stage {stage.number}\) in \w+\(\)"):
        module.cross_compile_config(module.KERNEL_CONFIGS[-1])


def test_compile_report_reads_ptxas_serialized_wgmma_note():
    """ptxas says when it makes every WGMMA wait for the one before (correct, several times slower), only as a
    -v note: the cross-compile report picks it out so that the compile tests can fail on it."""
    from course.runtime.compile import wgmma_serialized

    note = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
            "stage in the function ''kernel_cutlass_kernel_x''\nptxas info    : Used 168 registers, used 5 barriers")
    assert wgmma_serialized(note) == (
        "C7514: wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator "
        "registers of a wgmma between start and end of the pipeline stage")
    assert wgmma_serialized("ptxas info    : Used 168 registers, used 5 barriers\n") is None


def test_status_flags_a_kernel_whose_wgmmas_ptxas_serialized():
    """`course status` shows a compile whose WGMMAs ptxas serialized as such, not as a plain "yes"."""
    from types import SimpleNamespace

    from course.runtime.compile import CompileReport
    from course.tools import cli

    def module(note):
        report = CompileReport(name="k", seconds=0.0, registers=168, spill_bytes=0, wgmma_serialized=note)
        return SimpleNamespace(KERNEL_CONFIGS=[None], cross_compile_config=lambda config: report)

    assert "serialized" in cli._compile_cell(module("C7514: wgmma.mma_async instructions are serialized due to ..."))
    assert cli._compile_cell(module(None)).startswith("[green]yes[/]")


def test_skeleton_differs_only_in_todo_regions():
    for stage in (s for s in stages.STAGES if s.ready):
        solution = stage.path("solutions").read_text().splitlines()
        learner = skeleton.expected_skeleton(stage).splitlines()
        only_solution = set(solution) - set(learner)
        only_learner = set(learner) - set(solution)
        assert all("TODO(stage" in line or "NotImplementedError('TODO(stage" in line for line in only_learner)
        assert any("[exercise" in line for line in only_solution)


def test_decode_bench_times_both_layouts_of_a_shape_together():
    """Paged rows are compared with SDPA on the contiguous cache: both must be timed in the same rounds."""
    shapes = stages.get(7).bench_shapes
    groups = bench.decode_groups(shapes)
    timed = [s for group in groups.values() for s in group]
    assert len(timed) == len(shapes) and set(timed) == set(shapes)
    for contiguous, group in groups.items():
        assert not contiguous.paged
        assert {(s.batch, s.seqlen_k, s.paged) for s in group} == {(contiguous.batch, contiguous.seqlen_k, False),
                                                                     (contiguous.batch, contiguous.seqlen_k, True)}


# Made-up decode times (ms) of every kernel of a stage-9 run, the same on every shape: SDPA has no paged cache.
DECODE_MS = {"stage 9": 0.4, "stage 9 fp8": 0.25, "stage 7": 0.5, "SDPA cuDNN": 0.44, "SDPA flash": 0.45, "FA4": 0.8}


def fake_decode_results(groupings) -> dict:
    """A results dict as `course bench --stage 9` writes it (rows from bench.decode_row), at DECODE_MS, on stage
    9's shapes of ``groupings`` at B=8, L=4k and 32k: made up, never written anywhere."""
    rows = []
    for shape in stages.get(9).bench_shapes:
        if (shape.heads_q, shape.heads_kv) not in groupings or shape.batch != 8 or shape.seqlen_k > 32768:
            continue
        for kernel, ms in DECODE_MS.items():
            if not (shape.paged and kernel.startswith("SDPA")):
                stage = int(kernel.split()[1]) if kernel.startswith("stage") else None
                kv_bytes = shape.kv_bytes // 2 if kernel.endswith(results_page.FP8_SUFFIX) else shape.kv_bytes
                rows.append(bench.decode_row(kernel, shape, stage=stage, kv_bytes=kv_bytes, ms=ms, eager_ms=1.25 * ms,
                                             host_us=50.0, copy_gbps=3000.0))
    bench.add_fp8_speedups(rows)
    environment = {"gpu": "GPU", "driver": "1", "torch": "2", "cuda": "13", "cudnn": 91900,
                   "nvidia_cutlass_dsl": "4", "date": "today"}
    return {"environment": environment, "rows": [], "decode": {"copy_gbps": 3000.0, "graph_calls": 10, "rows": rows}}


def test_stage9_results_have_a_table_per_head_grouping():
    """GB/s per kernel, the ratio to cuDNN (a paged row: cuDNN on the contiguous cache), the FP8 kernel's tokens/s and
    its speed-up over the 16-bit cache; stage 7's table keeps one row per (shape, kernel), on its own shapes."""
    results = fake_decode_results([(32, 8), (64, 1)])
    page = results_page.stage_md(results, 9)
    assert "**H_q = 32, H_kv = 8 (GQA, group 4)**" in page and "**H_q = 64, H_kv = 1 (MQA)**" in page
    assert ("| B | L | layout | stage 9 | stage 9 fp8 | stage 7 | SDPA cuDNN | SDPA flash | FA4 | stage 9 vs cuDNN | "
            "stage 9 fp8 M tokens/s | fp8 vs 16-bit tokens/s | stage 9 graph (ms) | stage 9 eager (ms) |") in page
    # B=8 L=32k H_kv=8: 1 GiB of fp16 K and V; stage 9 at 0.4 ms reads it at 2684 GB/s, its fp8 half at 0.25 ms
    # at 2147 GB/s, 8 * 32768 tokens / 0.25 ms = 1,049 M tokens/s, 1.60x stage 9's on the 16-bit cache.
    same_on_both_layouts = "| 1.10x | 1,049 | 1.60x | 0.400 | 0.500 |"
    assert "| 8 | 32k | contiguous | 2684 | 2147 | 2147 | 2440 | 2386 | 1342 " + same_on_both_layouts in page
    assert "| 8 | 32k | paged 64 | 2684 | 2147 | 2147 | - | - | 1342 " + same_on_both_layouts in page
    assert f"(../results/{results_page.GROUPINGS_PLOT})" in page
    assert f"(results/{results_page.GROUPINGS_PLOT})" in results_page.tables(results)
    stage7 = results_page.stage_md(results, 7)
    assert "| B=8 L=32768 H_q=32 H_kv=8 D=128 float16 paged 64 | **stage 9 fp8** |" in stage7
    assert "H_kv=1" not in stage7, "stage 7's table shows its own shapes, not every grouping stage 9 times it on"


def test_stage9_plot_has_a_panel_per_grouping_and_batch():
    figure = bench.decode_groupings_figure(fake_decode_results([(32, 8), (64, 1)]))
    assert [ax.get_title() for ax in figure.axes] == ["H_q/H_kv 32/8 (GQA, group 4), B=8",
                                                      "H_q/H_kv 64/1 (MQA), B=8"]
    assert bench.decode_groupings_figure(fake_decode_results([])) is None


def test_merging_decode_runs_of_some_groupings_keeps_every_row():
    """`course bench --groupings` runs in parts; `course.tools.results --merge` must add their rows up."""
    full = fake_decode_results([(32, 8), (64, 1)])
    parts = [fake_decode_results([grouping]) for grouping in [(32, 8), (64, 1)]]
    merged = results_page.merge(parts)["decode"]["rows"]
    assert sorted((r["label"], r["kernel"]) for r in merged) == sorted(
        (r["label"], r["kernel"]) for r in full["decode"]["rows"])


def test_a_partial_bench_run_keeps_every_other_row(tmp_path, capsys):
    """A run of some stages or groupings into a folder with bench.json replaces only what it timed: the prefill
    rows and the other groupings stay (once, every prefill row was lost that way). Rows of another GPU are not
    mixed with the run's."""
    import json

    earlier = fake_decode_results([(32, 8), (64, 1)])
    earlier["rows"] = [{"label": "B=1 prefill", "kernel": "stage 8", "stage": 8, "ms": 1.0}]
    (tmp_path / "bench.json").write_text(json.dumps(earlier))
    run = fake_decode_results([(64, 1)])
    merged = results_page.merge_into(tmp_path, run)
    assert merged["rows"] == earlier["rows"], "the prefill rows of the earlier run are gone"
    later = {**run, "environment": {**run["environment"], "date": "tomorrow"}}
    assert results_page.merge([merged, later, later])["environment"]["date"] == "today, tomorrow", (
        "a merged file's dates are listed once each, however often it is merged again")
    assert sorted((r["label"], r["kernel"]) for r in merged["decode"]["rows"]) == sorted(
        (r["label"], r["kernel"]) for r in earlier["decode"]["rows"])
    other_gpu = {**run, "environment": {**run["environment"], "gpu": "another GPU"}}
    assert results_page.merge_into(tmp_path, other_gpu) is other_gpu
    assert "replaced, not merged" in capsys.readouterr().out
    assert results_page.merge_into(tmp_path / "empty", run) is run


def test_merge_command_keeps_the_folders_own_rows(tmp_path):
    """`course.tools.results --merge RUN` adds a run to the folder's bench.json: rows it did not time stay."""
    import json

    earlier = fake_decode_results([(32, 8), (64, 1)])
    (tmp_path / "bench.json").write_text(json.dumps(earlier))
    run = tmp_path / "run.json"
    run.write_text(json.dumps(fake_decode_results([(64, 1)])))
    assert results_page.main(["--dir", str(tmp_path), "--merge", str(run)]) == 0
    merged = json.loads((tmp_path / "bench.json").read_text())
    assert sorted((r["label"], r["kernel"]) for r in merged["decode"]["rows"]) == sorted(
        (r["label"], r["kernel"]) for r in earlier["decode"]["rows"]), "--merge of one grouping lost the other"


def test_every_stage_page_has_its_results_or_says_there_are_none(tmp_path):
    """render writes a results file per ready stage: a stage without rows gets "not measured", never a table
    left over from data that is gone."""
    import json

    (tmp_path / "bench.json").write_text(json.dumps(fake_decode_results([(32, 8)])))
    results_page.render(tmp_path)
    for stage in (s for s in stages.STAGES if s.ready):
        text = (tmp_path / results_page.stage_file(stage.number)).read_text()
        assert ("Not measured yet" in text) == (stage.number not in (7, 9)), (stage.number, text[:300])


def test_bench_groupings_select_decode_shapes():
    assert set(bench.decode_shapes([9], ((32, 8),))) == set(stages.get(7).bench_shapes)
    with pytest.raises(SystemExit, match="no bench shape of stage 7 has the head grouping 64/1"):
        bench.decode_shapes([7], ((64, 1),))


def test_fp8_copy_is_quantize_kv_cache_head_by_head():
    """The bench quantizes one KV head at a time (less memory); the scales are per head, so the cache is the same."""
    from course.runtime.kv_cache import quantize_kv_cache

    k, v = torch.randn(2, 2, 64, 3, 16).mul(torch.tensor([1.0, 5.0, 0.1]).view(1, 1, 3, 1)).to(torch.float16).unbind(0)
    for ours, theirs in zip(bench.fp8_copy(k, v), quantize_kv_cache(k, v)):
        assert ours.dtype == theirs.dtype and torch.equal(ours.float(), theirs.float())


# The parts of course/, in order: each may import only the parts before it (course/__init__.py).
PARTS = ("runtime", "testing", "integration", "tools")


def imported_course_modules(tree, *, skip_main_block: bool = False) -> set[str]:
    """The modules of course/ an AST imports, as dotted names under course ("runtime.launch", "testing"),
    lazy (in-function) imports included; old names (``from course import launch``) as where they live now."""
    import ast

    import course

    def where(name: str) -> str:
        first, _, rest = name.partition(".")
        return f"{course.MOVED[first]}.{name}" if first in course.MOVED else name

    nodes = ast.walk(tree)
    if skip_main_block:
        main_blocks = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        inside = {id(n) for block in main_blocks for n in ast.walk(block)}
        nodes = (node for node in ast.walk(tree) if id(node) not in inside)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "course":
            package = node.module.partition(".")[2]
            for alias in node.names:
                # `from course.runtime import launch` imports the module runtime.launch; `from course.runtime.launch
                # import x`, the module itself.
                candidate = f"{package}.{alias.name}" if package else alias.name
                is_module = (stages.ROOT / "course" / candidate.replace(".", "/")).with_suffix(".py").exists() or (
                    stages.ROOT / "course" / candidate.replace(".", "/") / "__init__.py").exists()
                found.add(where(candidate if is_module or candidate.split(".")[0] in course.MOVED else package))
        elif isinstance(node, ast.Import):
            found.update(where(a.name.partition(".")[2]) for a in node.names if a.name.startswith("course."))
    return {name for name in found if name}


def course_imports() -> dict[str, set[str]]:
    """{module: the course modules it imports}, for every module of course/ ("runtime.launch": {...})."""
    import ast

    graph = {}
    for path in sorted((stages.ROOT / "course").rglob("*.py")):
        parts = path.relative_to(stages.ROOT / "course").with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)  # "" is course/__init__.py
        graph[name] = imported_course_modules(ast.parse(path.read_text())) - {name}
    return graph


def part_of(module: str) -> str:
    return module.split(".")[0]


def test_course_is_laid_out_in_its_parts():
    """`ls course/` shows the parts: no module outside them but the package's own __init__ and __main__."""
    entries = sorted(p.name for p in (stages.ROOT / "course").iterdir() if p.name != "__pycache__")
    assert entries == sorted(["__init__.py", "__main__.py", *PARTS]), (
        f"course/ holds {entries}: a new module goes into one of the parts {PARTS} (course/__init__.py says "
        "which part holds what)")


def test_each_part_imports_only_the_parts_before_it():
    """runtime imports nothing else of course; testing imports runtime; integration imports runtime and testing;
    tools import everything."""
    for module, imported in course_imports().items():
        if module in ("", "__main__"):  # course/__init__.py (the old names) and the command line's entry point
            continue
        allowed = PARTS[:PARTS.index(part_of(module)) + 1]
        wrong = sorted(name for name in imported if part_of(name) not in allowed)
        assert not wrong, (f"course/{module.replace('.', '/')}.py imports {wrong}: a module of course.{part_of(module)} "
                           f"may import only {', '.join('course.' + p for p in allowed)}. Move what both need down "
                           "to the lower part.")


def test_course_has_no_import_cycles():
    """Each host concern has one home and the modules form a hierarchy: no module imports itself back."""
    graph = course_imports()

    def cycle_from(start, node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, path + [nxt])
                if found:
                    return found
        return None

    for module in graph:
        cycle = cycle_from(module, module, [module])
        assert cycle is None, (f"import cycle in course/: {' -> '.join(cycle)}. Move what both need into a "
                               "module that imports neither (see the module docstrings for what lives where).")


def test_kernels_import_only_course_runtime():
    """Importing a kernel loads course.runtime and nothing else of course; the file's demo (its __main__ block)
    may use course.testing."""
    import ast

    for stage in (s for s in stages.STAGES if s.ready):
        for impl in ("solutions", "stages"):
            tree = ast.parse(stage.path(impl).read_text())
            used = imported_course_modules(tree, skip_main_block=True)
            wrong = sorted(name for name in used if part_of(name) != "runtime")
            assert not wrong, (f"{impl}/{stage.module_name}.py imports {wrong}: kernels import only course.runtime "
                               "(validation, compile, launch, prefill, kv_cache, shapes, stages)")
            demo = imported_course_modules(tree) - used
            assert all(part_of(name) in ("runtime", "testing") for name in demo), demo


def test_old_module_names_are_the_modules_themselves():
    """A stage file or script written before the layout (`from course import launch`, `import course.models`)
    gets the very module of the new layout, not a second copy with its own caches."""
    import importlib

    import course

    for old, part in course.MOVED.items():
        if old == "models":
            continue  # needs transformers, which the CPU set-up installs only with the models extra
        module = importlib.import_module(f"course.{old}")
        assert module is importlib.import_module(f"course.{part}.{old}"), old
        assert module.__spec__.name == f"course.{part}.{old}", module.__spec__.name


# ---------------------------------------------------------------- the learner's files in stages/ are never lost

EDIT = "\n# the learner's work\n"


@pytest.fixture
def course_copy(tmp_path, monkeypatch):
    """solutions/ copied to tmp_path, which the registry takes for the repository (no git yet), and stages/
    as the skeletons generated from them: what the learner has written in stages/ changes nothing here."""
    import shutil

    shutil.copytree(stages.ROOT / "solutions", tmp_path / "solutions", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(stages.ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__", "stage*"))
    for stage in stages.STAGES:
        if stage.ready:
            (tmp_path / "stages" / stage.path("stages").name).write_text(skeleton.expected_skeleton(stage))
    monkeypatch.setattr(stages, "ROOT", tmp_path)
    return tmp_path


def git(root, *args):
    import subprocess

    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def committed_copy(course_copy):
    """The copy as a git repository with everything committed."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git(course_copy, "init", "-q")
    git(course_copy, "add", ".")
    git(course_copy, "-c", "user.name=course", "-c", "user.email=course@example.invalid", "commit", "-q", "-m", "x")
    return course_copy


def edit(stage_number: int) -> stages.Stage:
    stage = stages.get(stage_number)
    stage.path("stages").write_text(stage.path("stages").read_text() + EDIT)
    return stage


def test_editing_stages_passes_the_sync_check(committed_copy):
    edit(4)
    assert skeleton.out_of_date() == []
    git(committed_copy, "-c", "user.name=course", "-c", "user.email=course@example.invalid",
        "commit", "-q", "-am", "committed edits are not the course's skeleton any more")
    assert [s.number for s in skeleton.out_of_date()] == [4]


def test_sync_check_reads_the_working_tree_without_git(course_copy):
    assert skeleton.committed(stages.get(4).path("stages")) is None  # not a repository
    assert skeleton.out_of_date() == []
    edit(4)
    assert [s.number for s in skeleton.out_of_date()] == [4]


def test_a_changed_solution_needs_regenerated_skeletons(committed_copy):
    stage = stages.get(3)
    solution = stage.path("solutions")
    solution.write_text(solution.read_text().replace("# [exercise 3] For each row r:", "# [exercise 3] For any row r:"))
    assert [s.number for s in skeleton.out_of_date()] == [3]
    assert not skeleton.is_edited(stage)  # the committed skeleton, left behind: regenerating it loses nothing
    assert main(["skeletons"]) == 0
    assert skeleton.out_of_date() == [] and not list(stage.path("stages").parent.glob("*.bak-*"))


def test_skeletons_refuses_to_overwrite_edits(committed_copy, capsys):
    edit(5)
    before = {p: p.read_text() for p in (committed_copy / "stages").glob("*.py")}
    assert main(["skeletons"]) == 1
    assert {p: p.read_text() for p in (committed_copy / "stages").glob("*.py")} == before  # nothing written
    out = capsys.readouterr().out
    assert "stages/stage05_sinks.py" in out and "reset N" in out and "--force" in out


def test_skeletons_force_keeps_a_backup(committed_copy):
    stage = edit(5)
    edited = stage.path("stages").read_text()
    assert main(["skeletons", "--force"]) == 0
    assert stage.path("stages").read_text() == skeleton.expected_skeleton(stage)
    backups = list(stage.path("stages").parent.glob("stage05_sinks.py.bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == edited
    assert len(list(stage.path("stages").parent.glob("*.bak-*"))) == 1  # untouched files need no backup


def test_reset_restores_one_stage_and_keeps_a_backup(course_copy, capsys):
    four, five = edit(4), edit(5)
    edited = four.path("stages").read_text()
    assert main(["reset", "4"]) == 0
    assert four.path("stages").read_text() == skeleton.expected_skeleton(four)
    assert five.path("stages").read_text().endswith(EDIT)  # the other stages are left alone
    backup = next(four.path("stages").parent.glob("stage04_masking.py.bak-*"))
    assert backup.read_text() == edited and backup.name in capsys.readouterr().out
    assert main(["reset", "4"]) == 0  # a second reset: nothing to keep
    assert len(list(four.path("stages").parent.glob("stage04_masking.py.bak-*"))) == 1


@pytest.mark.parametrize("argument, message", [("12", "there is no stage 12"),
                                               ("four", "'four' is not a stage number")])
def test_check_names_the_stages_for_an_unknown_number(argument, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["check", argument])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_bench_head_dims_take_the_prefill_pairs_and_name_them_when_wrong(capsys):
    """`course bench --head-dims 192,192/128,256` splits a prefill run by head dims; an unknown one lists those there are."""
    from course.__main__ import parser

    assert parser().parse_args(["bench", "--head-dims", "192,192/128,256"]).head_dims == (
        (192, 192), (192, 128), (256, 256))
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["bench", "--head-dims", "100"])
    assert exited.value.code == 2 and "192/128" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [s for s in stages.STAGES if s.ready], ids=lambda s: f"stage{s.number}")
def test_cpu_numerics_are_todos_with_tests(stage):
    """stage.cpu_numerics (what `course check` says the CPU covers) names TODO functions, and the stage has CPU tests."""
    todos = skeleton.exercise_functions(stage)
    assert set(stage.cpu_numerics) <= set(todos), f"{sorted(set(stage.cpu_numerics) - set(todos))} hold no TODO"
    assert set(stage.cpu_sync) <= set(todos), f"{sorted(set(stage.cpu_sync) - set(todos))} hold no TODO"
    tests = (stages.ROOT / "tests" / f"test_{stage.module_name}.py").read_text()
    assert not stage.cpu_numerics or "def test_on_cpu_" in tests, f"stage {stage.number} has no test_on_cpu_* test"
    assert not stage.cpu_sync or "cpu_sync.check_" in tests, f"stage {stage.number} runs no CPU synchronization check"


# ---------------------------------------------------------------- what `course check` says about a failure

def test_check_finds_the_learners_line_in_any_error():
    from course.tools import cli

    path = stages.get(4).path("stages")
    dsl = f"error[ARG_WRONG_TYPE]: Loop `stop` must be an integer\n   --> {stages.ROOT}/stages/stage04_masking.py:486\n"
    mlir = 'error: loc("s[r, 0] = x"("/somewhere/stages/stage04_masking.py":172:15)): type mismatch'
    traceback = ("course/runtime/compile.py:137: in cross_compile\n    compiled = cute.compile(\n"
                 "stages/stage04_masking.py:281: in attend_kv_tiles\n    ...\n"
                 "stages/stage04_masking.py:172: in apply\n    ...\nE   ValueError: type mismatch\n")
    assert cli.learner_line(dsl, path) == 486
    assert cli.learner_line(mlir, path) == 172
    assert cli.learner_line(traceback, path) == 172  # the innermost frame in the learner's file
    assert cli.learner_line("solutions/stage04_masking.py:12: in apply\n", path) is None


def test_check_shows_the_whole_dsl_diagnostic_in_plain_text():
    from types import SimpleNamespace

    from course.tools import cli

    message = (f"cutlass.base_dsl.common.DSLUserCodeError: \n\x1b[91merror[ARG_WRONG_TYPE]:\x1b[0m Loop `stop`\n"
               f"   \x1b[94m-->\x1b[0m {stages.ROOT}/stages/stage04_masking.py:486\n" + "  | line\n" * 40)
    report = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message=message)))
    shown = cli.error_message(report).splitlines()
    assert shown[:3] == ["DSLUserCodeError:", "error[ARG_WRONG_TYPE]: Loop `stop`", "   --> stages/stage04_masking.py:486"]
    assert len(shown) == cli.MESSAGE_LINES + 1 and "add -v" in shown[-1]


@pytest.mark.compiles
def test_check_shows_a_trace_error_at_the_learners_line():
    """A learner's type error in a TODO: `course check` names the line and prints the DSL's diagnostic."""
    from course.tools import transcripts

    stage = stages.get(4)
    text = skeleton.expected_skeleton(stage)
    todo = text[text.index("        # TODO(stage 4): n_block_max"):text.index("\n", text.index("raise NotImplementedError"))]
    broken = ("        n_block_min = cutlass.Int32(0)\n"
              "        n_block_max = cutlass.Float32(self.seqlen_k)  # a float where the loops need an integer")
    out = transcripts.run({"check": ("check", "4", "-x")}, files={"stages/stage04_masking.py": text.replace(todo, broken)})
    failure = transcripts.first_failure(out["check"])
    line = next(i for i, source in enumerate(text.replace(todo, broken).splitlines(), start=1)
                if "# only the visible tiles" in source)  # the producer's loop: the trace reaches it first
    assert f"stages/stage04_masking.py:{line}: for n_block in cutlass.range(n_block_min, n_block_max" in failure, failure
    assert "error[ARG_WRONG_TYPE]: Loop `stop` must be an integer type, not `Float32`" in failure, failure
    assert f"--> stages/stage04_masking.py:{line}" in failure, failure
def test_sanitizer_report_separates_kernel_findings_from_host_api_noise():
    from course.tools import sanitize

    output = """========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuFuncGetAttribute.
=========     Saved host backtrace up to driver entry point at error
========= 
========= Invalid __global__ read of size 16 bytes
=========     at 0x1a30 in kernel_cutlass_x
========= 
========= ERROR SUMMARY: 2 errors
LAUNCHES OK
"""
    result = sanitize.classify("memcheck", output, 1)
    assert result.host_api_calls == {"cuFuncGetAttribute": 1}
    assert result.kernel_findings == ["Invalid __global__ read of size 16 bytes"]
    assert not result.clean and "1 kernel findings" in result.line()
    clean = sanitize.classify("racecheck", "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0)
    assert clean.clean and clean.summary_count == 0


def test_a_hint_continues_on_indented_comment_lines():
    """Comment lines right after an opening marker, two spaces further in, continue its hint: the TODO keeps
    the lines, the NotImplementedError's message joins them."""
    solution = ("def f():\n    # [exercise 3] The first line\n    #   and the second.\n    # a comment of the code\n"
                "    return 1\n    # [/exercise]\n")
    text = skeleton.skeleton_source(solution, 3, "stages/03-online-softmax.md")
    assert "    # TODO(stage 3): The first line\n    #   and the second.\n    raise NotImplementedError(" in text
    assert ("in f(): The first line and the second. Hints, one at a time: python -m course hint 3 "
            "(docs/stages/03-online-softmax.md as raw markdown shows them all at once)") in text
    assert "a comment of the code" not in text and "return 1" not in text


def test_executing_notebooks_without_a_gpu_keeps_the_sites_copies(monkeypatch, capsys):
    """`course notebooks --execute` on a machine without a Hopper GPU would replace the executed copies'
    GPU outputs with CPU skip messages: it refuses, unless told where else to write, or forced."""
    from course import testing
    from course.tools import notebooks

    monkeypatch.setattr(testing, "gpu_skip_reason", lambda: "no CUDA GPU on this machine")
    monkeypatch.setattr(notebooks, "write_executed", lambda out_dir: pytest.fail("it executed the notebooks"))
    assert main(["notebooks", "--execute"]) == 1
    assert "--out DIR" in capsys.readouterr().out


def test_notebooks_execute_in_process(tmp_path):
    """`course notebooks --execute --in-process` (for a machine without a Jupyter kernel) runs the code cells in
    one namespace from the notebook's folder: stdout and stderr become stream outputs, a figure an image; a cell
    that raises stops the run."""
    import nbformat

    from course.tools import notebooks

    cells = [nbformat.v4.new_markdown_cell("# title"),
             nbformat.v4.new_code_cell("import sys\nfrom pathlib import Path\nx = 6\nprint(x * 7)\n"
                                       "print('careful', file=sys.stderr)\nprint(Path.cwd().name)"),
             nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([x, 1])\nplt.show()"),
             nbformat.v4.new_code_cell("raise ValueError('stop here')"),
             nbformat.v4.new_code_cell("print('never')")]
    folder = tmp_path / "workshop"
    folder.mkdir()
    path = folder / "demo.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    with pytest.raises(ValueError, match="stop here"):
        notebooks.execute(path, in_process=True)
    cells[3].source = "y = x + 1"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    run = notebooks.execute(path, in_process=True)
    first, plot, third, last = (cell for cell in run.cells if cell.cell_type == "code")
    assert [(o.output_type, o.get("name"), o.get("text")) for o in first.outputs] == [
        ("stream", "stdout", "42\n"), ("stream", "stderr", "careful\n"), ("stream", "stdout", "workshop\n")]
    assert [o.output_type for o in plot.outputs] == ["display_data"] and "image/png" in plot.outputs[0].data
    assert third.outputs == [] and last.outputs[0].text == "never\n"
    assert [c.execution_count for c in (first, plot, third, last)] == [1, 2, 3, 4]
    nbformat.validate(run)


def test_notebooks_only_names_a_notebook(tmp_path, capsys):
    """`course notebooks --execute --only NAME` with a name no notebook has says which there are, running none."""
    assert main(["notebooks", "--execute", "--only", "11_backwards", "--out", str(tmp_path)]) == 2
    printed = capsys.readouterr().out
    assert "no notebook named 11_backwards" in printed and "there are: 01_single_tile" in printed
    assert not list(tmp_path.iterdir())


def test_notebooks_cli_passes_on_a_cells_error(tmp_path, monkeypatch):
    """A ValueError raised by a notebook's cell is the cell's, not an unknown --only name: the CLI lets it
    through (with its traceback) instead of printing the notebook list and exiting 2."""
    import nbformat

    from course.tools import notebooks

    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path)
    cells = [nbformat.v4.new_code_cell("raise ValueError('a cell failed')")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "demo.ipynb")
    with pytest.raises(ValueError, match="a cell failed"):
        main(["notebooks", "--execute", "--only", "demo", "--in-process", "--out", str(tmp_path / "out")])


def test_reset_backups_are_ignored_by_git():
    """`course reset` and `course skeletons --force` keep the learner's file next to the skeleton: git
    ignores those backups, so they never show as untracked work."""
    import subprocess

    backup = "stages/stage04_masking.py.bak-20260101-120000"
    ignored = subprocess.run(["git", "-C", str(stages.ROOT), "check-ignore", "-q", backup])
    assert ignored.returncode == 0, f"git does not ignore {backup}: add /stages/*.bak-* to .gitignore"


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out, "course --help prints reStructuredText markup literally"


def test_the_code_and_the_docs_carry_a_license():
    """A presenter may reuse the pages and notebooks, a model author ship the kernels: both licenses are in
    the repository, the README names them and the CuTe DSL's own license."""
    root = stages.ROOT
    assert "BSD 3-Clause" in (root / "LICENSE").read_text()
    assert "(CC BY 4.0)" in (root / "LICENSE-docs").read_text()
    readme = " ".join((root / "README.md").read_text().split())
    assert "`LICENSE`" in readme and "`LICENSE-docs`" in readme and "NVIDIA's own license" in readme


def make_dry_run(*arguments: str) -> str:
    """What `make` would run to set .venv up in a fresh copy (a dry run: nothing is installed)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX", "TORCH_SPEC")}
    return subprocess.run(["make", "-n", "-B", "VENV=/nonexistent/venv", "/nonexistent/venv/.ready", *arguments],
                          cwd=stages.ROOT, env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None,
                    reason="this machine has an NVIDIA driver: make installs the default (CUDA) build here")
def test_setup_without_a_driver_takes_the_cpu_build():
    """No NVIDIA driver: PyTorch's CPU index, said aloud, with the default index as the fallback; TORCH_INDEX
    (even empty) overrides; the installed choice is recorded so that a change starts a fresh .venv."""
    cpu = "https://download.pytorch.org/whl/cpu"
    plan = make_dry_run("TORCH_SPEC=torch==2.13.0")
    assert "No NVIDIA driver here" in plan and f'--index-url {cpu} --retries 1 "torch==2.13.0"' in plan
    assert f'|| {{ echo "{cpu} did not serve torch==2.13.0: from the default index instead"' in plan
    assert "cp /nonexistent/venv/.torch-choice /nonexistent/venv/.torch-installed" in plan
    assert "rm -rf /nonexistent/venv" in plan  # when the recorded choice differs
    default = make_dry_run("TORCH_SPEC=torch==2.13.0", "TORCH_INDEX=")
    assert "--index-url" not in default and "No NVIDIA driver" not in default


def exercise_body(stage: stages.Stage, first_words: str) -> str:
    """The solution's code of the stage's exercise region whose hint starts with ``first_words``."""
    text = stage.path("solutions").read_text()
    start = text.index(f"# [exercise {stage.number}] {first_words}")
    body = text[text.index("\n    for ", start) + 1:text.index("# [/exercise]", start)]
    return body.rstrip() + "\n"


def skeleton_with(stage: stages.Stage, first_words: str, body: str) -> str:
    """Stage ``stage``'s skeleton with the TODO whose hint starts with ``first_words`` replaced by ``body``."""
    text = skeleton.expected_skeleton(stage)
    start = text.index(f"# TODO(stage {stage.number}): {first_words}")
    start = text.rindex("\n", 0, start) + 1
    end = text.index("\n", text.index("raise NotImplementedError(", start)) + 1
    return text[:start] + body + text[end:]


@pytest.mark.compiles
def test_check_names_a_wrong_number_before_a_later_todo():
    """Stage 3 with a running sum that forgets the correction, and attend_kv_tiles not written yet: the
    cross-compile stops at the TODO first, but the thing to fix is the wrong number the CPU numerics found."""
    from course.tools import transcripts

    stage = stages.get(3)
    body = exercise_body(stage, "For each row r").replace("row_sum[r] * correction + thread_sum",
                                                          "row_sum[r] + thread_sum")
    out = transcripts.run({"check": ("check", "3")},
                          files={"stages/stage03_online_softmax.py": skeleton_with(stage, "For each row r", body)})
    failure = transcripts.first_failure(out["check"])
    assert failure.startswith("Not there yet. First thing to fix (test_on_cpu_online_softmax"), failure
    assert "TODO(stage 3) in attend_kv_tiles" not in failure, failure


def test_check_reports_a_syntax_error_as_such():
    from course.tools import transcripts

    stage = stages.get(1)
    text = skeleton.expected_skeleton(stage).replace("def scores_to_operand_a(", "def scores_to_operand_a((", 1)
    out = transcripts.run({"check": ("check", "1")}, files={"stages/stage01_single_tile.py": text})["check"]
    line = next(i for i, source in enumerate(text.splitlines(), start=1) if "def scores_to_operand_a((" in source)
    assert "stages/stage01_single_tile.py does not parse" in out, out
    assert f"stages/stage01_single_tile.py:{line}: SyntaxError" in out and "def scores_to_operand_a((" in out, out


def test_status_row_of_a_broken_file_says_what_is_wrong(course_copy):
    from contextlib import nullcontext

    from course.tools import cli

    stage = stages.get(2)
    stage.path("stages").write_text(stage.path("stages").read_text() + "\ndef broken(:\n")
    cells = cli._stage_cells(stage, "stages", gpu=False, spinner=nullcontext())
    assert cells[0].startswith("[red]stages/stage02_multi_tile.py:") and "SyntaxError" in cells[0], cells
    assert cells[1:] == ["-"]


def test_status_counts_each_todo_once(course_copy):
    """One TODO per unfinished region, however many lines its hint takes, and a stray mention is no TODO."""
    import re

    from course.tools import cli

    stage = stages.get(3)
    text = stage.path("stages").read_text()
    regions = len(re.findall(r"raise NotImplementedError\(.TODO\(stage 3\)", text))
    assert regions >= 2 and cli.todos_left(stage, "stages") == regions
    stage.path("stages").write_text(text + "\n# a note the learner left: see TODO(stage 3) above\n")
    assert cli.todos_left(stage, "stages") == regions


def test_sdpa_baseline_selects_its_backend_outside_the_timed_call():
    """A timing enters the SDPA baseline's setting around the call, so the call itself does not pay for
    selecting the backend; outside the setting it still selects it, so its result is the same."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    run = bench.sdpa(SDPBackend.MATH)
    q, k, v = torch.randn(3, 1, 5, 2, 8).unbind(0)
    outside = run(q, k, v, causal=True)
    assert not isinstance(bench._restricted_to(SDPBackend.MATH), contextlib.nullcontext)
    with bench.setting(run):
        assert isinstance(bench._restricted_to(SDPBackend.MATH), contextlib.nullcontext)
        assert not isinstance(bench._restricted_to(SDPBackend.CUDNN_ATTENTION), contextlib.nullcontext)
        inside = run(q, k, v, causal=True)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
    assert torch.equal(outside, expected) and torch.equal(inside, expected)
    assert isinstance(bench.setting(lambda: None), contextlib.nullcontext)


def test_ragged_rows_render_and_merge(tmp_path):
    """Stage 10's variable-length rows (bench.json's "varlen") make its results table, next to FA4, and a
    later run of them replaces theirs and keeps everything else."""
    import json

    shape = stages.RAGGED[0]
    rows = [{"stage": stage, "kernel": kernel, "shape": {}, "label": shape.label, "ms": ms,
             "tflops": shape.flops / ms / 1e9} for stage, kernel, ms in ((10, "stage 10", 6.0), (None, "FA4", 6.6))]
    earlier = fake_decode_results([(32, 8)])
    (tmp_path / "bench.json").write_text(json.dumps(earlier))
    run = {"environment": earlier["environment"], "varlen": {"rows": rows}}
    merged = results_page.merge_into(tmp_path, run)
    keys = [sorted((r["label"], r["kernel"]) for r in part) for part in (merged["decode"]["rows"],
                                                                       earlier["decode"]["rows"])]
    assert keys[0] == keys[1] and merged["varlen"]["rows"] == rows
    (tmp_path / "bench.json").write_text(json.dumps(merged))
    results_page.render(tmp_path)
    text = (tmp_path / results_page.stage_file(10)).read_text()
    assert "Not measured yet" not in text and f"| {shape.label} | **stage 10** | 6.000 |" in text
    assert "| 1.10x |" in text, "stage 10's row says how it compares with FA4 in the same rounds"


def test_serving_bench_times_one_section_again(tmp_path, monkeypatch):
    """`serving_bench --only prefill` times that section again into serving.json and keeps the others, and
    both tables are written from the result (stage 9's page includes one, stage 10's the other)."""
    import json

    from course.tools import serving_bench

    earlier = {"environment": {"gpu": "H100"}, "append": [], "quantized": [], "rolling": [],
               "prefill alibi": [{"causal": False, "no bias TFLOP/s": 600.0, "ALiBi TFLOP/s": 400.0}]}
    (tmp_path / "serving.json").write_text(json.dumps(earlier))
    again = [{"causal": True, "no bias TFLOP/s": 500.0, "ALiBi TFLOP/s": 450.0}]
    timed = []
    fake = {name: (stage, lambda module, name=name: timed.append(name) or again)
            for name, (stage, _) in serving_bench.SECTIONS.items()}
    monkeypatch.setattr(serving_bench, "SECTIONS", fake)
    monkeypatch.setattr(stages.Stage, "load", lambda self, impl: None)
    serving_bench.main(["--only", "prefill", "--out", str(tmp_path)])
    assert timed == ["prefill alibi"]
    saved = json.loads((tmp_path / "serving.json").read_text())
    assert saved == {**earlier, "prefill alibi": again}
    assert "| causal | 500 | 450 | 0.90 |" in (tmp_path / "alibi-prefill.md").read_text()
    assert "Append + RoPE" in (tmp_path / "serving.md").read_text()


# ---------------------------------------------------------------- course hint

@pytest.mark.parametrize("stage", [s for s in stages.STAGES if s.ready], ids=lambda s: f"stage{s.number}")
def test_every_exercise_has_its_hints_in_order(stage):
    """`course hint N` finds the page's hints: every stage with TODOs has exercises, each with Hint 1, 2, 3 in
    order (a nudge to nearly the answer), and together as many as the stage has exercise regions or fewer
    (one exercise may span two functions)."""
    from course.tools import hints

    found = hints.exercises((stages.ROOT / "docs" / stage.docs_page).read_text())
    todos = skeleton.exercise_functions(stage)
    assert found and len(found) <= len(todos), f"docs/{stage.docs_page}: {len(found)} hint groups for {todos}"
    for exercise in found:
        levels = [int(hints.HINT_TITLE.match(title)["level"]) for title, _ in exercise.hints]
        assert levels == [1, 2, 3], f"docs/{stage.docs_page}, {exercise.name}: hints {levels}; expected 1, 2, 3"
        assert all(text for _, text in exercise.hints), f"docs/{stage.docs_page}, {exercise.name}: an empty hint"


def test_course_hint_prints_one_hint_at_a_time(capsys):
    """`course hint 11 1` prints the first hint of the first exercise and not the second; the last hint
    points to the solutions; a wrong exercise lists the right ones."""
    from course.tools import hints

    found = hints.exercises((stages.ROOT / "docs" / stages.get(11).docs_page).read_text())
    assert hints.main(11, "1") == 0
    text = capsys.readouterr().out
    assert found[0].hints[0][1] in text and found[0].hints[1][1] not in text
    assert "hint 11 1 2" in text
    assert hints.main(11, "gradients", 3) == 0 and "Solutions" in capsys.readouterr().out
    assert hints.main(11, "no-such-exercise") == 1 and "1: KeyTileMask.m_block_range" in capsys.readouterr().out


def test_decode_variants_render_the_rules_choice_in_bold(tmp_path):
    """`decode_variants --render`: one table per section of forced stage 9 plans, cuDNN first, the variant the
    rules choose in bold (the split counts' rule in its own column), "Not measured yet" before any run."""
    import json

    from course.tools import decode_variants

    results = {"environment": {"gpu": "H100"},
               "split counts": [{"shape": [1, 4096, 32, 8], "rule": "16",
                                 "times": {"cuDNN": 9.8, "4": 16.3, "16": 9.9, "256": 20.0}}],
               "keys per split": [{"shape": [1, 256, 8, 1], "rule": "128", "times": {"cuDNN": 6.0, "256": 7.7,
                                                                                    "128": 6.9}}],
               "row tiles": []}
    (tmp_path / "decode-variants.json").write_text(json.dumps(results))
    decode_variants.main(["--render", "--out", str(tmp_path)])
    splits = (tmp_path / decode_variants.file_name("split counts")).read_text()
    assert "| 1, 4096, 32/8 | 9.8 | 16.3 | - | **9.9** | - | - | - | 20.0 | 16: 9.9 |" in splits
    keys = (tmp_path / decode_variants.file_name("keys per split")).read_text()
    assert "| 1, 256, 8/1 | 6.0 | - | 7.7 | **6.9** |" in keys and "512 keys per split" in keys
    assert "Not measured yet" in (tmp_path / decode_variants.file_name("row tiles")).read_text()


def test_tile_variants_render_shares_of_fa4_with_the_chosen_tiling_in_bold(tmp_path):
    """`tile_variants --render`: a row per shape, each tiling's TFLOP/s as a share of FA4's, TILES's choice in bold;
    every forced tiling fits in shared memory and TILES's choice for each head dim is one of those timed."""
    import json

    from course.tools import tile_variants

    stage = stages.get(8).load("solutions")
    for section in tile_variants.VARIANTS.values():
        for dims, variants in section.items():
            chosen = stage.TILES[dims]
            assert tile_variants.tiling_of(chosen) in variants, (dims, chosen)
            for tiling in variants:
                assert stage.shared_bytes(*dims, tile_variants.tiles_of(stage, tiling)) <= stage.SMEM_BYTES, tiling
    results = {"environment": {"gpu": "H100"}, "tilings": [
        {"label": "B=4 H=16 S_q=4096 S_k=4096 D=64 float16", "head_dim": 64,
         "tflops": {"FA4": 500.0, "SDPA cuDNN": 440.0, "2 x 128": 400.0, "3 x 128": 495.0}}]}
    (tmp_path / tile_variants.JSON).write_text(json.dumps(results))
    tile_variants.main(["--render", "--out", str(tmp_path)])
    text = (tmp_path / tile_variants.TABLES["tilings"]).read_text()
    # Columns no row has (tilings of other head dims, or newer than the run) are left out.
    assert "| shape | FA4 TFLOP/s | cuDNN | 2 x 128 | 3 x 128 |" in text
    assert "| B=4 H=16 S_q=4096 S_k=4096 D=64 float16 | 500 | 0.88 | 0.80 | **0.99** |" in text
    # The wide section is not in that run: its table is not written (another GPU's folder holds only some).
    assert not (tmp_path / tile_variants.TABLES["wide head dims"]).exists()
    tile_variants.write_tables({"environment": {}, **{section: [] for section in tile_variants.TABLES}}, tmp_path)
    for name in tile_variants.TABLES.values():
        assert "Not measured yet" in (tmp_path / name).read_text()


def test_paged_copies_render_times_with_the_chosen_copy_in_bold(tmp_path):
    """`paged_copies --render`: a row per (head dim, page size), each copy's time next to FA4's and the packed
    batch's, the copy stage 10 chooses (GATHER_PAGE_ROWS) in bold; the forced classes copy one way only."""
    import json

    from course.tools import paged_copies

    stage = stages.get(10).load("solutions")
    assert paged_copies.forced(stage, True).gathers(128, 128, 64) and not paged_copies.forced(stage, True).gathers(
        128, 128, 0)
    assert not paged_copies.forced(stage, False).gathers(64, 64, 16)
    ms = {"TMA per page": 2.6, "gather": 2.3, "FA4": 1.7, "packed": 1.68}
    results = {"environment": {"gpu": "H100"}, "paged copies": [
        {"label": "x", "head_dim": 128, "page_size": 16, "ms": ms},
        {"label": "x", "head_dim": 128, "page_size": 64, "ms": ms},
        {"label": "x", "head_dim": 64, "page_size": 32, "ms": ms}]}
    (tmp_path / paged_copies.JSON).write_text(json.dumps(results))
    paged_copies.main(["--render", "--out", str(tmp_path)])
    text = (tmp_path / paged_copies.TABLE).read_text()
    assert "| 128 | 16 | 2.600 | **2.300** | 1.700 | 1.680 |" in text
    assert "| 128 | 64 | **2.600** | 2.300 | 1.700 | 1.680 |" in text
    assert "| 64 | 32 | 2.600 | **2.300** | 1.700 | 1.680 |" in text
    paged_copies.write_tables({"environment": {}}, tmp_path)
    assert "Not measured yet" in (tmp_path / paged_copies.TABLE).read_text()


def test_kv_cache_bench_renders_speedups_sizes_and_logit_differences(tmp_path):
    """`kv_cache_bench --render`: a row per (model, batch, context): the three caches' step times, the bf16 time
    over each quantized one's, the caches' sizes and the logits' difference from the bf16 cache's."""
    import json

    from course.tools import kv_cache_bench

    def cache(ms, gib, difference):
        return {"ms": ms, "bytes": gib * 2**30, "max_logit_difference": difference,
                "mean_logit_difference": difference / 10}

    results = {"environment": {"gpu": "H100", "torch": "2.x", "transformers": "5.x"},
               "rows": {"llama": [{"batch": 8, "context": 32768, "logit_std": 2.5, "caches": {
                   "bfloat16": cache(4.0, 4.0, 0.0), "float8_e4m3fn": cache(2.5, 2.0, 0.031),
                   "int8": cache(2.0, 2.0, 0.02)}}]}}
    (tmp_path / kv_cache_bench.JSON).write_text(json.dumps(results))
    kv_cache_bench.main(["--render", "--out", str(tmp_path)])
    text = (tmp_path / kv_cache_bench.MD).read_text()
    assert ("| Llama, same attention | 8 | 32768 | 4.00 | 2.50 | 2.00 | 1.60x | 2.00x | 4.00 / 2.00 | 2.50 | "
            "0.003 / 0.031 | 0.002 / 0.020 |") in text, text


def test_padded_bench_renders_each_mode_against_no_padding_and_the_other_backend(tmp_path):
    """`padded_bench --render`: a row per (model, mode): the course backend padded and not, their ratio, the
    other backend padded and the course backend's speedup over it."""
    import json

    from course.tools import padded_bench

    results = {"environment": {"gpu": "H100", "torch": "2.x", "transformers": "5.x", "date": "today"},
               "batch": 8, "prompt": 1024, "steps": 32, "padding": [0, 128],
               "rows": [{"model": "llama", "mode": "static+compile", "other": "sdpa", "course": 1.5,
                         "course, no padding": 1.25, "sdpa": 3.0}]}
    (tmp_path / padded_bench.JSON).write_text(json.dumps(results))
    padded_bench.main(["--render", "--out", str(tmp_path)])
    text = (tmp_path / padded_bench.MD).read_text()
    assert "| Llama, same attention | static+compile | 1.500 | 1.250 | 1.20x | 3.000 (sdpa) | 2.00x |" in text, text
    assert "row b left-padded by 128 b tokens" in text


def test_stalls_cut_the_busiest_loop_at_its_waits(tmp_path):
    """`course.tools.stalls`: ncu's source page (a kernel line, a header, a row per SASS instruction at absolute
    addresses) -> each HGMMA loop's samples, the busiest one cut at its wait_group 1 and wait_group 0."""
    import json

    from course.tools import stalls

    base = 0x7F0000001000
    program = [("HGMMA.64x128x16.F32 R24, gdesc[UR20], RZ", 5, {"stall_math": 5}),
               ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 7, {"stall_barrier": 7}),
               ("FMNMX R1, R2, R3, !PT", 3, {"stall_wait": 3}),
               ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 4, {"stall_barrier": 4}),
               ("MUFU.EX2 R4, R4", 10, {"stall_wait": 6, "stall_selected": 4}),
               (f"@P0 BRA {base:#x}", 1, {"stall_branch_resolving": 1}),
               ("EXIT", 0, {})]
    reasons = ["stall_barrier", "stall_branch_resolving", "stall_math", "stall_selected", "stall_wait"]
    header = ["Address", "Source", stalls.ALL, *reasons, *(f"{r} (Not Issued)" for r in reasons)]
    lines = ['"Kernel Name","kernel_x",', ",".join(f'"{h}"' for h in header)]
    for i, (source, samples, stall) in enumerate(program):
        cells = [f"{base + 16 * i:#x}", f"      {source}", str(samples), *(str(stall.get(r, 0)) for r in reasons),
                 *("0" for _ in reasons)]
        lines.append(",".join(f'"{c}"' for c in cells))
    summary = stalls.summarize(stalls.instructions(stalls.parse_source_csv("\n".join(lines))))
    assert summary["samples"] == 30
    (loop,) = summary["loops"]
    assert (loop["start"], loop["instructions"], loop["samples"], loop["exp2"]) == (0, 6, 30, 1)
    cut = {name: region["samples"] for name, region in loop["regions"].items()}
    assert cut == {"issue": 5, "wait_group 1": 7, "between the waits": 3, "wait_group 0": 4, "after wait_group 0": 11}
    results = {"environment": {"gpu": "H100"}, "shape": "fp16", "non-causal": summary, "causal": summary}
    (tmp_path / stalls.JSON).write_text(json.dumps(results))
    stalls.main(["--render", "--out", str(tmp_path)])
    text = (tmp_path / stalls.MD).read_text()
    assert "| wait_group 0 | waiting for `P V` | 13.3% | 0 | barrier 100% |" in text, text
    assert "| after wait_group 0 | the rest of the softmax, P and O written | 36.7% | 1 | wait 55%, selected 36%" in text


def test_decode_variants_plans_are_ones_the_kernel_takes(monkeypatch, tmp_path):
    """Every section of `decode_variants`, run on the CPU with a stand-in for the timing (132 SMs): each forced
    plan passes stage 9's own `check_plan`, each row names the rules' choice among its variants, and the tables
    render from the results."""
    from course.runtime import stages
    from course.tools import decode_variants

    stage = stages.get(9).load("solutions")

    def fake_times(stage, shape, variants, fp8=False):
        for options in variants.values():
            stage.check_plan(options.get("plan"), shape[2] // shape[3], decode_variants.HEAD_DIM)
        return {decode_variants.CUDNN: 1.0, **{name: 2.0 for name in variants}}

    monkeypatch.setattr(decode_variants, "num_sms", lambda: 132)
    monkeypatch.setattr(decode_variants, "time_variants", fake_times)
    results = {"environment": {"gpu": "stand-in"},
               **{name: section(stage) for name, section in decode_variants.SECTIONS.items()}}
    for name, rows in results.items():
        for row in rows if name != "environment" else ():
            rules = row["rule"] if isinstance(row["rule"], list) else [row["rule"]]
            assert all(rule in row["times"] for rule in rules if rule is not None), (name, row)
    decode_variants.write_tables(results, tmp_path)
    warps = (tmp_path / decode_variants.file_name("warps")).read_text()
    assert "| 4 warps | 8 warps | 8 warps, half the splits | 8 warps, twice the splits |" in warps
    assert "**2.0**" in (tmp_path / decode_variants.file_name("tiles and warps")).read_text()
