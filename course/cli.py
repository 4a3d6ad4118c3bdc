"""What ``course status`` and ``course check`` print."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from course import stages, testing

console = Console()


def todos_left(stage: stages.Stage, impl: str) -> int:
    return len(re.findall(rf"TODO\(stage {stage.number}\)", stage.path(impl).read_text())) // 2


def _compile_cell(module) -> str:
    """Cross-compile the stage's last configuration (every feature on); a skeleton stops at its first TODO."""
    try:
        report = module.cross_compile_config(module.KERNEL_CONFIGS[-1])
    except NotImplementedError as error:
        return f"[yellow]stops at TODO[/] ({str(error).split(':')[0].split(' in ')[-1]})"
    except Exception as error:  # a learner's trace error is the useful thing to show
        return f"[red]fails[/]: {type(error).__name__}: {str(error).splitlines()[0][:60]}"
    return f"[green]yes[/] ({report.summary()})"


def _gpu_cells(stage: stages.Stage, module) -> tuple[str, str]:
    """(numerics, throughput) on the GPU, both with the features of the stage's first bench
    shape (its mask, sinks, LSE): one awkward shape checked, the bench shape timed."""
    import torch
    from torch.nn.attention import SDPBackend

    from course import bench

    try:
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
    except NotImplementedError:
        return "[yellow]TODO[/]", "-"
    except Exception as error:
        return f"[red]error[/]: {type(error).__name__}", "-"


def _decode_gpu_cells(stage: stages.Stage, module) -> tuple[str, str]:
    """(numerics, bandwidth) of a decode stage: a ragged paged batch checked, one bench shape timed."""
    import torch
    from torch.nn.attention import SDPBackend

    from course import bench

    try:
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
    except NotImplementedError:
        return "[yellow]TODO[/]", "-"
    except Exception as error:
        return f"[red]error[/]: {type(error).__name__}", "-"


def status() -> int:
    gpu_reason = testing.gpu_skip_reason()
    table = Table(title="Hopper FMHA course: stages", show_lines=True)
    for column in ("#", "stage", "adds", "code", "TODOs left", "cross-compiles (sm_90a)"):
        table.add_column(column)
    if gpu_reason is None:
        table.add_column("numerics (H100)")
        table.add_column("throughput")
    with console.status("compiling...") as spinner:
        for stage in stages.STAGES:
            if not stage.ready:
                table.add_row(str(stage.number), stage.title, stage.adds, "planned", "-", "-",
                              *(["-", "-"] if gpu_reason is None else []))
                continue
            for impl in ("stages", "solutions"):
                spinner.update(f"stage {stage.number} ({impl}): cross-compiling for sm_90a...")
                with redirect_stdout(io.StringIO()):
                    module = stage.load(impl)
                    cells = [_compile_cell(module)]
                    if gpu_reason is None:
                        spinner.update(f"stage {stage.number} ({impl}): running on the GPU...")
                        cells += list(_decode_gpu_cells(stage, module) if stage.kind == "decode"
                                      else _gpu_cells(stage, module))
                table.add_row(str(stage.number), stage.title, stage.adds, f"{impl}/",
                              str(todos_left(stage, impl)), *cells)
    console.print(table)
    if gpu_reason:
        console.print(f"GPU columns left out: {gpu_reason}.")
    console.print("Next: [bold]python -m course check 1[/] runs stage 1's tests on your code in stages/.")
    return 0


class _Collector:
    def __init__(self):
        self.passed, self.failed, self.skipped = [], [], []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            getattr(self, report.outcome if report.outcome != "error" else "failed").append(report)


def check(number: int, impl: str) -> int:
    import pytest

    stage = stages.get(number)
    if not stage.ready:
        console.print(f"Stage {number} ({stage.title}) is planned and has no tests yet.")
        return 2
    test_file = stages.ROOT / "tests" / f"test_{stage.module_name}.py"
    collector = _Collector()
    console.print(f"Checking stage {number} ({stage.title}) against [bold]{impl}/{stage.module_name}.py[/] ...")
    with redirect_stdout(io.StringIO()):
        code = pytest.main([str(test_file), f"--impl={impl}", "-q", "-p", "no:cacheprovider"], plugins=[collector])
    passed, failed, skipped = len(collector.passed), len(collector.failed), len(collector.skipped)
    console.print(f"{passed} passed, {failed} failed, {skipped} skipped")
    if collector.skipped and testing.gpu_skip_reason():
        console.print(f"[yellow]Skipped GPU tests[/]: {testing.gpu_skip_reason()}.")
    if failed:
        first = collector.failed[0]
        message = first.longrepr.reprcrash.message if hasattr(first.longrepr, "reprcrash") else str(first.longrepr)
        console.print(f"[red]Not there yet.[/] First thing to fix ({escape(first.nodeid.split('::')[-1])}):")
        first_line = message.splitlines()[0][:1000] if message else "(no message)"
        console.print(first_line, markup=False)
        if "Hints:" not in first_line:
            console.print(f"Hints: docs/{stage.docs_page}")
        return 1
    if code != 0 and not failed:
        console.print("[red]pytest could not run the tests[/] (see `python -m pytest " f"{test_file} --impl={impl}`)")
        return int(code)
    console.print(f"[green]Stage {number} passes[/] on {impl}/." +
                  ("" if testing.gpu_skip_reason() is None else " (CPU checks only: run on a Hopper GPU for numerics.)"))
    return 0
