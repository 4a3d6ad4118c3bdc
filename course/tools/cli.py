"""What ``course status`` and ``course check`` print."""

from __future__ import annotations

import io
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from course import testing
from course.runtime import stages

console = Console()


def todos_left(stage: stages.Stage, impl: str) -> int:
    """The stage's TODO comments still in the file (one per unfinished region; its hint may go on for lines)."""
    return len(re.findall(rf"^\s*# TODO\(stage {stage.number}\)", stage.path(impl).read_text(), re.MULTILINE))


def syntax_error(path: Path) -> str | None:
    """``path:line: SyntaxError: message`` when the file does not parse, else None."""
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError as error:
        return f"{path.relative_to(stages.ROOT).as_posix()}:{error.lineno}: SyntaxError: {error.msg}"
    return None


def _todo_name(error: NotImplementedError) -> str:
    """The function a TODO's message names ("TODO(stage 3) in online_softmax(): ...")."""
    found = re.search(r"TODO\(stage \d+\) in (\w+)\(\)", str(error))
    return f"{found[1]}()" if found else "a TODO"


def _compile_cell(module) -> str:
    """Cross-compile the stage's last configuration (every feature on); a skeleton stops at its first TODO."""
    try:
        report = module.cross_compile_config(module.KERNEL_CONFIGS[-1])
    except NotImplementedError as error:
        return f"[yellow]TODO[/] in {_todo_name(error)}"
    except Exception as error:  # a learner's trace error is the useful thing to show
        return f"[red]fails[/]: {type(error).__name__}"
    if report.wgmma_serialized:  # correct, and several times slower: the learner's loop should show it
        return f"[yellow]serialized WGMMAs[/] ({report.wgmma_serialized.split(':')[0]}; see `course check`)"
    return f"[green]yes[/] ({report.registers} regs, {report.spill_bytes} B spill)"


def _cpu_numerics_cell(stage: stages.Stage, impl: str) -> str:
    """The stage's CPU numerics tests (``on_cpu``) on ``impl``: pass, fail, or the TODO they stop at."""
    import pytest

    if not stage.cpu_numerics:
        return "-"
    collector = _Collector(None)
    test_file = stages.ROOT / "tests" / f"test_{stage.module_name}.py"
    with redirect_stdout(io.StringIO()):
        pytest.main(pytest_arguments(test_file, impl, "on_cpu", exitfirst=False, verbose=False), plugins=[collector])
    if not collector.failed:
        return f"[green]pass[/] ({len(collector.passed)})" if collector.passed else "-"
    real = [r for r in collector.failed if not _is_todo(r)]
    if real:
        return f"[red]fail[/] ({len(real)} of {len(collector.passed) + len(collector.failed)})"
    return "[yellow]TODO[/]"


def _gpu_cells(stage: stages.Stage, module) -> tuple[str, str]:
    """(numerics, throughput) on the GPU, both with the features of the stage's first bench
    shape (its mask, sinks, LSE): one awkward shape checked, the bench shape timed."""
    import torch
    from torch.nn.attention import SDPBackend

    from course.tools import bench

    shape = stage.bench_shapes[0]
    q, k, v = testing.random_qkv(2, 200, 100, 8, 2, 128, torch.float16, seed=1)
    features = bench.kernel_features(shape, heads=8)
    out = module.attention(q, k, v, out=testing.poisoned_like(q), **features)
    features.pop("return_lse", None)
    report = testing.compare_with_reference(out[0] if isinstance(out, tuple) else out, q, k, v, **features)
    numerics = "[green]pass[/]" if report.ok else f"[red]fail[/] (max err {report.max_error:.1e})"
    q, k, v = testing.random_qkv(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads,
                                 shape.head_dim, getattr(torch, shape.dtype))
    features = bench.kernel_features(shape, heads=shape.heads)
    calls = {"ours": lambda: module.attention(q, k, v, **features)}
    try:
        calls["cuDNN"] = bench.called_once(lambda: bench.sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, **features))
    except RuntimeError:  # a feature SDPA does not have
        pass
    times = bench.time_in_rounds(calls, repeats=10)
    speed = f"{shape.flops / times['ours'] / 1e9:.0f} TFLOP/s"
    speed += f" (cuDNN {shape.flops / times['cuDNN'] / 1e9:.0f})" if "cuDNN" in times else " (no SDPA equivalent)"
    return numerics, speed


def _backward_gpu_cells(stage: stages.Stage, module) -> tuple[str, str]:
    """(numerics, throughput) of the backward: an awkward GQA shape with a window checked against the
    reference's autograd, the B=2 S=8k D=128 bench shape timed next to cuDNN's backward."""
    import torch

    from course.tools import bench

    q, k, v = testing.random_qkv(2, 200, 300, 8, 2, 128, torch.bfloat16, seed=1)
    do = torch.randn_like(q)
    features = {"window_size": (64, 0), "num_sink_tokens": 2}
    out, lse = module.attention(q, k, v, return_lse=True, **features)
    grads = module.attention_backward(do, q, k, v, out, lse, **features)
    try:
        testing.assert_gradients_match(grads, q, k, v, do, "status", out=out, **features)
        numerics = "[green]pass[/]"
    except AssertionError:
        numerics = "[red]fail[/]"
    shape = next(s for s in stage.bench_shapes if s.seqlen_q == 8192 and s.head_dim == 128 and not s.causal)
    calls = bench.backward_calls(shape, module, baselines=("SDPA cuDNN",), deterministic=False)
    times = bench.time_in_rounds({name: fn for name, (_, fn) in calls.items()}, repeats=10)
    flops = bench.BACKWARD_FLOPS * shape.flops
    speed = f"{flops / times[f'stage {stage.number}'] / 1e9:.0f} TFLOP/s backward"
    speed += f" (cuDNN {flops / times['SDPA cuDNN'] / 1e9:.0f})" if "SDPA cuDNN" in times else ""
    return numerics, speed


def _decode_gpu_cells(stage: stages.Stage, module) -> tuple[str, str]:
    """(numerics, bandwidth) of a decode stage: a ragged paged batch checked, one bench shape timed."""
    import torch
    from torch.nn.attention import SDPBackend

    from course.tools import bench

    inputs = testing.random_decode_inputs([1, 300, 5000], 8, 2, 128, torch.float16, page_size=64, seed=1)
    out = module.decode_attention(**inputs, out=testing.poisoned_like(inputs["q"]))
    report = testing.compare_decode_with_reference(out, **inputs)
    ok = report.ok and not torch.isnan(out).any()
    numerics = "[green]pass[/]" if ok else f"[red]fail[/] (max err {report.max_error:.1e})"
    shape = next(s for s in stage.bench_shapes if (s.batch, s.seqlen_k, s.paged) == (8, 32768, False))
    q, k, v, seqlens, _ = bench.decode_inputs(shape)
    times = bench.time_graphs({
        "ours": bench.capture_graph(lambda: module.decode_attention(q, k, v, seqlens, check_lengths=False)),
        "cuDNN": bench.capture_graph(lambda: bench.sdpa_decode(SDPBackend.CUDNN_ATTENTION)(q, k, v)),
    })
    ours, cudnn = times["ours"], times["cuDNN"]
    speed = (f"{shape.kv_bytes / ours / 1e6:.0f} GB/s of K/V at B=8 L=32k "
             f"(cuDNN {shape.kv_bytes / cudnn / 1e6:.0f})")
    return numerics, speed


def gpu_columns_note(reason: str) -> str:
    return f"GPU columns left out: {reason}."


STATUS_WIDTH = 100  # the table is laid out for 100 columns, whatever the terminal reports


def _stage_cells(stage: stages.Stage, impl: str, gpu: bool, spinner) -> list[str]:
    """The cells after the TODO count: cross-compile, CPU numerics, and with a GPU its numerics and speed.
    A file that does not parse or import gets one cell that says so, the others "-"."""
    columns = 4 if gpu else 2
    broken = syntax_error(stage.path(impl))
    if broken is None:
        try:
            with redirect_stdout(io.StringIO()):
                module = stage.load(impl)
        except Exception as error:
            broken = f"does not import: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if broken is not None:
        return [f"[red]{escape(broken)}[/]", *["-"] * (columns - 1)]
    spinner.update(f"stage {stage.number} ({impl}): cross-compiling for sm_90a...")
    with redirect_stdout(io.StringIO()):
        cells = [_compile_cell(module)]
    spinner.update(f"stage {stage.number} ({impl}): CPU numerics...")
    cells.append(_cpu_numerics_cell(stage, impl))
    if gpu:
        spinner.update(f"stage {stage.number} ({impl}): running on the GPU...")
        with redirect_stdout(io.StringIO()):
            gpu_cells = {"decode": _decode_gpu_cells, "backward": _backward_gpu_cells}.get(stage.kind, _gpu_cells)
            try:
                cells += list(gpu_cells(stage, module))
            except NotImplementedError:
                cells += ["[yellow]TODO[/]", "-"]
            except Exception as error:
                cells += [f"[red]error[/]: {type(error).__name__}", "-"]
    return cells


def status() -> int:
    gpu_reason = testing.gpu_skip_reason()
    table = Table(title="Hopper FMHA course: stages", show_lines=True)
    for column in ("#", "stage", "code", "TODOs", "compiles (sm_90a)", "CPU numerics"):
        table.add_column(column, no_wrap=column in ("code", "TODOs", "compiles (sm_90a)"))
    if gpu_reason is None:
        table.add_column("numerics (GPU)")
        table.add_column("speed")
    out = Console(width=STATUS_WIDTH)
    with out.status("compiling...") as spinner:
        for stage in stages.STAGES:
            if not stage.ready:
                table.add_row(str(stage.number), stage.title, "planned", "-", "-", "-",
                              *(["-", "-"] if gpu_reason is None else []))
                continue
            for impl in ("stages", "solutions"):
                table.add_row(str(stage.number), stage.title, f"{impl}/", str(todos_left(stage, impl)),
                              *_stage_cells(stage, impl, gpu_reason is None, spinner))
    out.print(table)
    if gpu_reason:
        out.print(gpu_columns_note(gpu_reason))
    out.print(f"Next: [bold]{stages.COURSE_COMMAND} check 1[/] runs stage 1's tests on your code in stages/.")
    return 0


# `course check` prints lines, not tables: the terminal wraps them, so a long message or path stays copyable.
lines = Console(soft_wrap=True, highlight=False)


class _Collector:
    """A pytest plugin: the reports of a run, and one progress line per test that runs on this machine's own
    terms: those that compile (marker ``compiles``) and the CPU checks of the learner's functions (``on_cpu`` in
    their names); unless ``progress`` is None (with -v pytest reports every test itself)."""

    def __init__(self, progress: Console | None):
        self.passed, self.failed, self.skipped = [], [], []
        self.progress = progress
        self.shown: set[str] = set()

    def pytest_collection_modifyitems(self, items):
        if self.progress is not None:
            self.shown = {item.nodeid for item in items if item.get_closest_marker("compiles") or "on_cpu" in item.name}

    def pytest_runtest_logstart(self, nodeid, location):
        if nodeid in self.shown:  # outside the test's own output capture: this reaches the terminal
            self.progress.print(f"  {escape(nodeid.split('::')[-1])} ...", end="")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            getattr(self, report.outcome if report.outcome != "error" else "failed").append(report)
        if report.nodeid in self.shown and (report.when == "call" or report.outcome != "passed"):
            verdict = {"passed": "[green]ok[/]", "skipped": "[yellow]skipped[/]"}.get(report.outcome, "[red]failed[/]")
            self.progress.print(f" {verdict} ({report.duration:.1f} s)")


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Where an error points into a file: the DSL's diagnostics ("--> path:line"), MLIR locations
# ("path":line:col) and pytest's traceback entries ("path:line: in function").
LOCATIONS = (re.compile(r"-->\s*(?P<path>\S+?\.py):(?P<line>\d+)"), re.compile(r'"(?P<path>[^"\s]+?\.py)":(?P<line>\d+)'),
             re.compile(r"^(?P<path>\S+?\.py):(?P<line>\d+): ", re.MULTILINE))
MESSAGE_LINES = 25


def _report_text(report) -> str:
    """The failure's traceback and the test's captured stderr (where the DSL also prints diagnostics), plain text."""
    sections = [content for title, content in report.sections if "stderr" in title]
    return ANSI.sub("", "\n".join([str(report.longrepr), *sections]))


def learner_line(text: str, path: Path) -> int | None:
    """The line of ``path`` an error's text points at (the innermost one), or None.

    The DSL's and MLIR's own locations are exact; pytest's traceback entries come from
    outer to inner, so the last one in ``path`` is the deepest call into the learner's code.
    """
    suffix = path.relative_to(stages.ROOT).as_posix()
    for pattern in LOCATIONS:
        found = [int(m["line"]) for m in pattern.finditer(text) if m["path"].replace("\\", "/").endswith(suffix)]
        if found:
            return found[-1]
    return None


def error_message(report) -> str:
    """The exception as the test saw it: type and message, every line of a DSL diagnostic, plain text."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = ANSI.sub("", crash.message if crash else str(report.longrepr))
    message = message.replace(f"{stages.ROOT}/", "")  # the DSL prints absolute paths
    message = re.sub(r"^(?:[a-z_]+\.)+(?=[A-Z]\w*(?:Error|Exception)\b)", "", message)  # cutlass.base_dsl.common.
    kept = [line.rstrip() for line in message.splitlines() if line.strip()]
    if len(kept) > MESSAGE_LINES:
        kept = kept[:MESSAGE_LINES] + [f"... ({len(kept) - MESSAGE_LINES} more lines: add -v for pytest's full report)"]
    return "\n".join(kept)


def _is_todo(report) -> bool:
    """Did the test fail on a TODO not written yet (the skeleton's NotImplementedError)?"""
    return "NotImplementedError: TODO(stage" in _report_text(report)


def first_to_fix(failed: list):
    """The failure to show first: a wrong result or an error of the learner's own code beats a TODO that is
    simply not written yet (which the later tests reach first), else the first failure."""
    return next((report for report in failed if not _is_todo(report)), failed[0])


def _print_first_failure(stage: stages.Stage, impl: str, report) -> None:
    lines.print(f"[red]Not there yet.[/] First thing to fix ({escape(report.nodeid.split('::')[-1])}):")
    path = stage.path(impl)
    line = learner_line(_report_text(report), path)
    if line is not None:
        source_lines = path.read_text().splitlines()
        source = source_lines[line - 1].strip() if line <= len(source_lines) else ""
        todo = source.startswith("raise NotImplementedError(") and "TODO(stage" in source  # the message says it all
        lines.print(f"{path.relative_to(stages.ROOT).as_posix()}:{line}" + ("" if todo else f": {source}"), markup=False)
    message = error_message(report)
    lines.print(message or "(no message)", markup=False)
    earlier = re.search(r"TODO\(stage (\d+)\)", message or "")
    if earlier and int(earlier.group(1)) != stage.number:  # a TODO of a stage this one imports from
        number = int(earlier.group(1))
        lines.print(f"That TODO is stage {number}'s: stage {stage.number} imports it from your "
                    f"{stages.get(number).path(impl).relative_to(stages.ROOT).as_posix()}. Finish stage {number} "
                    f"first: python -m course check {number}", markup=False)
    elif "Hints" not in message:
        from course.tools import skeleton

        lines.print(skeleton.hints_pointer(stage.number, stage.docs_page), markup=False)


def _coverage_line(stage: stages.Stage) -> str:
    """Which of the stage's TODOs the CPU checks run, and which only a Hopper GPU checks."""
    from course.tools import skeleton

    todos = skeleton.exercise_functions(stage)
    on_cpu = [f"{name}()" for name in todos if name in stage.cpu_numerics]
    sync = [f"{name}()" for name in todos if name in stage.cpu_sync]
    gpu_only = [f"{name}()" for name in todos if name not in stage.cpu_numerics + stage.cpu_sync]
    parts = []
    if on_cpu:
        parts.append(f"CPU numerics (your code run on the CPU against course.testing.reference) cover {', '.join(on_cpu)}")
    if sync:
        parts.append(f"the CPU synchronization model (barriers, wait groups, buffer releases) covers {', '.join(sync)}")
    if gpu_only:
        parts.append(f"only a Hopper GPU checks the numerics of {', '.join(gpu_only)}")
    return "; ".join(parts) + "."


def _next_step(stage: stages.Stage) -> str:
    later = [s for s in stages.STAGES if s.number > stage.number and s.ready]
    if later:
        return (f"Next: [bold]{stages.COURSE_COMMAND} check {later[0].number}[/] "
                f"(read docs/{later[0].docs_page} first).")
    return (f"Next: time your kernels next to PyTorch's with [bold]{stages.COURSE_COMMAND} bench --impl stages[/] "
            "on a Hopper GPU (docs/results.md).")


def _verdict(stage: stages.Stage, impl: str, selected: bool) -> str:
    """What a run without failures proves: off Hopper, only the compile and the CPU checks."""
    on_gpu = testing.gpu_skip_reason() is None
    if selected:
        return (f"[green]The selected tests of stage {stage.number} pass on {impl}/[/]"
                + ("." if on_gpu else " (those that need a Hopper GPU are skipped here)."))
    if on_gpu:
        return f"[green]Stage {stage.number} passes on {impl}/[/]: compiles for sm_90a, numerics match the reference."
    return (f"[green]Stage {stage.number} on {impl}/: compiles for sm_90a, the CPU checks pass[/]; "
            "the kernel's numerics are not checked: no Hopper GPU.")


def pytest_arguments(test_file: Path, impl: str, keyword: str | None, exitfirst: bool, verbose: bool) -> list[str]:
    args = [str(test_file), f"--impl={impl}", "-p", "no:cacheprovider", "-v" if verbose else "-q"]
    if keyword:
        args += ["-k", keyword]
    if exitfirst:
        args.append("-x")
    return args


def check(number: int, impl: str, *, keyword: str | None = None, exitfirst: bool = False, verbose: bool = False) -> int:
    """Run stage ``number``'s tests on ``impl`` with pytest and print the verdict; 0 when they pass."""
    import pytest

    stage = stages.get(number)
    if not stage.ready:
        lines.print(f"Stage {number} ({stage.title}) is planned and has no tests yet.")
        return 2
    test_file = stages.ROOT / "tests" / f"test_{stage.module_name}.py"
    broken = syntax_error(stage.path(impl))
    if broken is not None:  # every test would fail on the import, each under its own name
        lines.print(f"[red]Not there yet.[/] {stage.path(impl).relative_to(stages.ROOT).as_posix()} does not parse:",
                    markup=True)
        lines.print(broken, markup=False)
        source = stage.path(impl).read_text().splitlines()
        line = int(broken.split(":")[1])
        if 1 <= line <= len(source):
            lines.print(f"    {source[line - 1].strip()}", markup=False)
        return 1
    progress = None if verbose else Console(file=sys.stdout, soft_wrap=True, highlight=False)  # before the redirect
    collector = _Collector(progress)
    lines.print(f"Checking stage {number} ({stage.title}) against [bold]{impl}/{stage.module_name}.py[/] ...")
    lines.print(_coverage_line(stage))
    with redirect_stdout(sys.stdout if verbose else io.StringIO()):  # pytest's own report only with -v
        code = pytest.main(pytest_arguments(test_file, impl, keyword, exitfirst, verbose), plugins=[collector])
    passed, failed, skipped = len(collector.passed), len(collector.failed), len(collector.skipped)
    lines.print(f"{passed} passed, {failed} failed, {skipped} skipped")
    if collector.skipped and testing.gpu_skip_reason():
        lines.print(f"[yellow]Skipped GPU tests[/]: {testing.gpu_skip_reason()}.")
    if failed:
        _print_first_failure(stage, impl, first_to_fix(collector.failed))
        return 1
    if code != 0:
        lines.print("[red]pytest could not run the tests[/] (see `.venv/bin/python -m pytest "
                    f"{test_file.relative_to(stages.ROOT)} --impl={impl}`)")
        return int(code)
    lines.print(_verdict(stage, impl, selected=bool(keyword)))
    if not keyword:
        lines.print(_next_step(stage))
    return 0
