"""Benchmarks: each stage's kernel next to PyTorch SDPA (flash and cuDNN), same GPU, same run.

Timing: CUDA events around each call, after warm-up, median of many repeats,
the kernels compared on one shape called in rounds (``time_in_rounds``).
Results go to ``bench.json`` (with the GPU, driver and versions), ``bench.md``
(the tables the docs include, rendered by ``course.tools.results``) and the plots.
Never edit those by hand: rerun ``python -m course bench --out docs/results``
on a Hopper GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import statistics
import subprocess
from dataclasses import asdict, replace
from functools import partial
from importlib import metadata
from pathlib import Path

from course.runtime import stages, varlen
from course.runtime.shapes import DecodeShape, PrefillShape, RaggedShape
from course.tools import results as results_page

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "results"


def kernel_features(shape: PrefillShape, heads: int) -> dict:
    """The keyword arguments of ``attention`` for this shape's features (random sink logits)."""
    import torch

    features = dict(shape.features)
    if shape.sinks:
        features["sink_logits"] = torch.randn(heads, device="cuda")
    return features


# --8<-- [start:time_in_rounds]
def time_in_rounds(fns: dict, *, warmup: int = 10, repeats: int = 50) -> dict:
    """{name: median milliseconds of one ``fn()``} measured with CUDA events, the fns called in rounds.

    Each round calls every fn once, so the kernels compared share the GPU's
    state at each moment: when the SM clock drifts (an H100 reaches its power
    limit within seconds of full load), all of them see it. The calls are queued
    back to back and synchronized once at the end, so while the host runs ahead
    of the GPU each pair of events brackets GPU work only, for our kernels and
    PyTorch's alike.
    """
    import torch

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(repeats)] for name in fns}
    torch.cuda.synchronize()
    for i in range(repeats):
        for name, fn in fns.items():
            start, end = events[name][i]
            with setting(fn):
                start.record()
                fn()
                end.record()
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}
# --8<-- [end:time_in_rounds]


def time_cuda(fn, *, warmup: int = 10, repeats: int = 50) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events (``time_in_rounds`` of one function)."""
    return time_in_rounds({"fn": fn}, warmup=warmup, repeats=repeats)["fn"]


def called_once(fn):
    """``fn``, after one call: ``runnable``'s check of an eager call."""
    fn()
    return fn


def runnable(calls: dict, label: str, prepare=called_once) -> dict:
    """{name: prepare(call)} for the calls that run on the shape ``label``.

    A call whose preparation (one call, or a graph capture) raises RuntimeError,
    a backend that refuses the shape or a feature, or runs out of memory, is
    reported and left out.
    """
    import torch

    ok = {}
    for name, fn in calls.items():
        try:
            ok[name] = prepare(fn)
        except RuntimeError as error:
            print(f"  {name} on {label}: not run ({str(error).splitlines()[0]})")
            torch.cuda.empty_cache()
    return ok


GRAPH_CALLS = 10  # decode calls per captured CUDA graph


def capture_graph(fn, *, calls: int = GRAPH_CALLS, warmup: int = 3):
    """A CUDA graph of ``calls`` back-to-back ``fn()`` calls, captured after ``warmup`` eager calls.

    A decode call on a short cache is a few microseconds of GPU work but tens
    of microseconds of Python and launch overhead: timed eagerly, it measures
    the host. Serving engines capture decode steps in CUDA graphs, and so does
    this: the graph holds only GPU work, the same for every kernel compared.
    """
    import torch

    side = torch.cuda.Stream()  # warm up (allocations, compiles, cuDNN plans) off the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graphs(graphs: dict, *, calls: int = GRAPH_CALLS, warmup: int = 3, repeats: int = 20) -> dict:
    """{name: median milliseconds of one call} for graphs of ``calls`` calls each, replayed in rounds."""
    times = time_in_rounds({name: graph.replay for name, graph in graphs.items()}, warmup=warmup, repeats=repeats)
    return {name: ms / calls for name, ms in times.items()}


def host_microseconds(fn, *, calls: int = 50) -> float:
    """Median host time of one eager call (Python, validation, allocation, launch), in microseconds.

    Each call is timed on its own with the GPU already busy, so the launch
    returns as soon as the work is queued: what is measured is the host's part.
    """
    import time

    import torch

    times = []
    with setting(fn):
        for _ in range(5):
            fn()
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


_PINNED: list = []  # the SDPA backend a ``setting`` has selected, innermost last


def sdpa(backend):
    """PyTorch SDPA restricted to one backend, on [B, S, H, D] tensors like the kernels.

    Causal only (SDPA has no sliding window); its causal mask is top-left aligned,
    which equals the contract's bottom-right one when S_q == S_k, as in the benchmarks.
    """
    import torch.nn.functional as F

    def run(q, k, v, causal=False, window_size=(-1, -1), sink_logits=None, return_lse=False):
        if window_size != (-1, -1) or sink_logits is not None or return_lse:
            raise RuntimeError("SDPA has no sliding-window attention, sink logits or LSE output here")
        with _restricted_to(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal)

    run.setting = partial(_pinned, backend)
    return run


def setting(fn):
    """The context that the timings enter around a call of ``fn``, outside the timed part.

    SDPA restricted to one backend (``sdpa``, ``sdpa_decode``) selects it
    there: selecting a backend for each call (``sdpa_kernel``) costs the host
    more than SDPA's own call, which is not what a model pays (it selects once,
    or never). Inside the setting the call is plain SDPA; elsewhere it selects
    the backend itself, so it is right everywhere and cheap where timed.
    """
    return getattr(fn, "setting", contextlib.nullcontext)()


@contextlib.contextmanager
def _pinned(backend):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        _PINNED.append(backend)
        try:
            yield
        finally:
            _PINNED.pop()


def _restricted_to(backend):
    from torch.nn.attention import sdpa_kernel

    return contextlib.nullcontext() if _PINNED and _PINNED[-1] == backend else sdpa_kernel(backend)


def environment() -> dict:
    import torch

    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    try:
        env["nvidia_cutlass_dsl"] = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        import cutlass

        env["nvidia_cutlass_dsl"] = getattr(cutlass, "__version__", "unknown")
    try:
        env["flash_attn_4"] = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        env["flash_attn_4"] = "not installed"
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["driver"] = "unknown"
    return env


# ---------------------------------------------------------------- a tool's results file and its tables

def save_results(out_dir: Path, json_name: str, results: dict) -> None:
    """``results`` as ``out_dir / json_name`` (the folder made if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / json_name).write_text(json.dumps(results, indent=1) + "\n")


def render_results(out_dir: Path, json_name: str, md_name: str, table) -> str:
    """``out_dir / md_name`` = ``table(results)`` of the results saved in ``out_dir / json_name``; the Markdown."""
    text = table(json.loads((Path(out_dir) / json_name).read_text()))
    (Path(out_dir) / md_name).write_text(text)
    return text


def run_sections(out_dir: Path, json_name: str, sections: dict, only: str | None = None) -> dict:
    """Time every section ({name: a function of no arguments that returns the section's rows}) into
    ``out_dir / json_name`` with this machine's environment, or only the section named ``only``: its rows
    replace that section's, and the others keep theirs (and the environment they were measured in)."""
    results = json.loads((out_dir / json_name).read_text()) if only else {"environment": environment()}
    for name, section in sections.items():
        if only in (None, name):
            results[name] = section()
    save_results(out_dir, json_name, results)
    return results


def run_stage_sections(out_dir: Path, json_name: str, sections: dict, write_tables, only: str | None = None) -> dict:
    """``run_sections`` of ``sections`` ({name: (stage number, fn(the stage's solution module) -> rows)}), then
    the tables from the results (``write_tables(results, out_dir)``)."""
    from course.runtime import stages

    out_dir = Path(out_dir)
    bound = {name: (lambda number=number, fn=fn: fn(stages.get(number).load("solutions")))
             for name, (number, fn) in sections.items()}
    results = run_sections(out_dir, json_name, bound, only)
    write_tables(results, out_dir)
    return results


def sections_command(argv, description: str, json_name: str, sections: dict, run, write_tables) -> None:
    """The command line of a tool that times named sections into one results file (``run(out_dir, only)``)
    and writes its tables from it (``write_tables(results, out_dir)``): --out, --render (the tables from
    the saved results, no GPU) and --only (the first word of a section's name: time it again)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--render", action="store_true", help=f"{json_name} -> the tables (no GPU)")
    choices = {name.split()[0]: name for name in sections}
    parser.add_argument("--only", choices=choices,
                        help=f"time one section again; the others keep their {json_name} entries")
    args = parser.parse_args(argv)
    if args.render:
        write_tables(json.loads((args.out / json_name).read_text()), args.out)
    else:
        run(args.out, choices.get(args.only))


def fa4():
    """FlashAttention-4's Hopper kernel (``flash-attn-4``, written in the same DSL), on the course's
    arguments; None when it is not installed (``pip install -e .[bench]``)."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def run(q, k, v, causal=False, window_size=(-1, -1), sink_logits=None, num_sink_tokens=0, return_lse=False):
        if num_sink_tokens:
            raise RuntimeError("FlashAttention-4 has no sink tokens")
        left, right = (None if side < 0 else side for side in window_size)
        return flash_attn_func(q, k, v, causal=causal, window_size=(left, right), learnable_sink=sink_logits,
                               return_lse=return_lse)

    return run


def baselines() -> dict:
    """The kernels every prefill shape is compared with: PyTorch SDPA's flash (FA2) and cuDNN backends, and FA4."""
    from torch.nn.attention import SDPBackend

    kernels = {"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}
    if fa4() is not None:
        kernels["FA4"] = fa4()
    return kernels


def time_prefill_shape(shape: PrefillShape, kernels: dict, repeats: int) -> list[dict]:
    """Rows of {stage, kernel, shape, label, ms, tflops, gbps}: ``kernels`` ({name: (stage or None,
    fn(q, k, v, **features))}) on one shape's random inputs, timed in the same rounds."""
    import torch

    from course import testing

    qkv = list(testing.random_qkv(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads,
                                  shape.head_dim, getattr(torch, shape.dtype), head_dim_v=shape.dv))
    features = kernel_features(shape, shape.heads)
    calls = runnable({name: partial(fn, *qkv, **features) for name, (_, fn) in kernels.items()}, shape.label)
    rows = []
    for name, ms in time_in_rounds(calls, repeats=repeats).items():
        rows.append({"stage": kernels[name][0], "kernel": name, "shape": asdict(shape), "label": shape.label,
                     "ms": ms, "tflops": shape.flops / ms / 1e9, "gbps": shape.bytes_moved / ms / 1e6})
        print(f"  {name:>20} {shape.label}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s, "
              f"{rows[-1]['gbps']:.0f} GB/s")
    del calls, qkv
    torch.cuda.empty_cache()
    return rows


def with_starting_stages(stage_numbers) -> list[int]:
    """``stage_numbers`` and the stages they start from (``Stage.starts_from``): every stage a bench loads."""
    starts = [stages.get(n).starts_from for n in stage_numbers if stages.get(n).starts_from]
    return list(dict.fromkeys([*stage_numbers, *starts]))


def timed_stages(shape, stage_numbers) -> list[int]:
    """The stages timed on ``shape``: those of ``stage_numbers`` it is a bench shape of, then the stages
    they start from, so that a stage's table shows the kernel it improves on the same inputs."""
    return with_starting_stages([n for n in stage_numbers if shape in stages.get(n).bench_shapes])


def bench_prefill(stage_numbers, *, impl: str = "solutions", repeats: int = 50, head_dims=None) -> list[dict]:
    """Every stage on its bench shapes (only those of ``head_dims``, (D, D_v) pairs, if given; next to the stage
    it starts from, if any), and the baselines once per distinct shape, all in the same rounds."""
    modules = {number: stages.get(number).load(impl) for number in with_starting_stages(stage_numbers)}
    shapes = dict.fromkeys(shape for number in stage_numbers for shape in stages.get(number).bench_shapes
                           if head_dims is None or (shape.head_dim, shape.dv) in head_dims)
    rows = []
    for shape in shapes:
        kernels = {f"stage {n}": (n, modules[n].attention) for n in timed_stages(shape, stage_numbers)}
        kernels.update({name: (None, fn) for name, fn in baselines().items()})
        rows += time_prefill_shape(shape, kernels, repeats)
    return rows


def bench_ablation(*, impl: str = "solutions", repeats: int = 50) -> list[dict]:
    """Stage 8's ablation: stage 6, then the kernel after each of stage 8's steps, next to FA4 and cuDNN."""
    from course.runtime import prefill

    stage6, stage8 = stages.get(6).load(impl), stages.get(8).load(impl)
    rows = []
    for shape in stages.FA3_REFERENCE:
        kernels = {"stage 6": (6, stage6.attention)}
        for label, kernel_class in stage8.ABLATION.items():
            kernels[f"stage 8 {label}"] = (8, lambda q, k, v, cls=kernel_class, **f: prefill.attention(8, cls, q, k, v, **f))
        kernels.update({name: (None, fn) for name, fn in baselines().items() if name != "SDPA flash"})
        rows += time_prefill_shape(shape, kernels, repeats)
    return rows


# --8<-- [start:ragged]
def fa4_varlen():
    """FlashAttention-4's ``flash_attn_varlen_func`` on stage 10's inputs (packed, or a paged cache through
    ``page_table``), None when it is not installed."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, block_table=None,
            causal=False):
        try:
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                                          page_table=block_table, causal=causal)
        except Exception as error:  # a baseline that refuses the inputs is left out
            raise RuntimeError(f"FlashAttention-4 does not run it: {type(error).__name__}: {error}") from error

    return run


def ragged_inputs(shape: RaggedShape) -> dict:
    """``attention_varlen``'s arguments for ``shape``, random; a paged pool without NaN (FA4 reads every slot
    of a page) and with every unused block-table entry pointing at page 0."""
    import torch

    from course import testing

    inputs = testing.random_varlen_inputs(shape.lengths_q, shape.lengths_k, shape.heads_q, shape.heads_kv,
                                          shape.head_dim, getattr(torch, shape.dtype), page_size=shape.page_size or None)
    if shape.page_size:
        inputs.update(k=torch.nan_to_num(inputs["k"]), v=torch.nan_to_num(inputs["v"]),
                      block_table=inputs["block_table"].clamp(min=0))
    return inputs


def ragged_calls(shape: RaggedShape, inputs: dict, modules: dict) -> dict:
    """{name: (stage, fn())} of one ragged shape: stage 10, FA4's varlen kernel, and (packed batches of
    whole prompts) stage 8 on the batch padded to its longest sequence, or (a few draft tokens against a
    cache, which stage 10 hands to stage 9's decode kernel) stage 10's own prefill kernel on them and
    stage 9 decoding one token per sequence on the same cache. The comparisons have no stage number:
    their rows belong to stage 10's table, not to stage 8's or 9's."""
    import torch

    calls = {"stage 10": (10, lambda: modules[10].attention_varlen(**inputs, causal=shape.causal))}
    fa4 = fa4_varlen()
    if fa4 is not None:
        calls["FA4"] = (None, lambda: fa4(**inputs, causal=shape.causal))
    dtype, batch = getattr(torch, shape.dtype), len(shape.lengths_q)
    if shape.decode_sized and 9 in modules:
        last = inputs["q"].view(batch, -1, shape.heads_q, shape.head_dim)[:, -1].contiguous()
        calls["stage 9, one token"] = (None, lambda: modules[9].decode_attention(
            last, inputs["k"], inputs["v"], inputs["seqused_k"], block_table=inputs["block_table"]))
        calls["stage 10, prefill kernel"] = (None, lambda: varlen.attention_varlen(
            10, modules[10].VarlenAttention, **inputs, causal=shape.causal))
    elif not shape.page_size and 8 in modules:
        padded = batch * max(shape.lengths_q) * shape.heads_q * shape.head_dim * 2
        if padded < 4 << 30:  # the padded batch must fit next to everything else
            q = torch.randn(batch, max(shape.lengths_q), shape.heads_q, shape.head_dim, device="cuda", dtype=dtype)
            k = torch.randn(batch, max(shape.lengths_k), shape.heads_kv, shape.head_dim, device="cuda", dtype=dtype)
            calls["stage 8, padded"] = (None, lambda: modules[8].attention(q, k, k, causal=shape.causal))
    return calls


def bench_ragged(stage_numbers, *, impl: str = "solutions", repeats: int = 50) -> list[dict]:
    """Stage 10's variable-length batches (``Stage.ragged_shapes``) next to FA4 and the stages they are
    compared with, in the same rounds; decode-sized ones replayed in CUDA graphs."""
    import torch

    ragged = [n for n in stage_numbers if stages.get(n).ragged_shapes]
    modules = {n: stages.get(n).load(impl) for n in (*ragged, 8, 9)}
    rows = []
    for number in ragged:
        for shape in stages.get(number).ragged_shapes:
            inputs = ragged_inputs(shape)
            calls = ragged_calls(shape, inputs, modules)
            fns = runnable({name: fn for name, (_, fn) in calls.items()}, shape.label,
                           capture_graph if shape.decode_sized else called_once)
            times = time_graphs(fns, repeats=repeats) if shape.decode_sized else time_in_rounds(fns, repeats=repeats)
            for name, ms in times.items():
                rows.append({"stage": calls[name][0], "kernel": name, "shape": asdict(shape), "label": shape.label,
                             "ms": ms, "tflops": shape.flops / ms / 1e9})
                print(f"  {name:>20} {shape.label}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s")
            del fns, calls, inputs
            torch.cuda.empty_cache()
    return rows
# --8<-- [end:ragged]


# --8<-- [start:backward]
BACKWARD_FLOPS = 2.5  # a backward's FLOPs per forward FLOP (five GEMMs for two): FlashAttention's convention


def fa4_backward():
    """FlashAttention-4's Hopper backward through autograd: fn(q, k, v, do, causal) -> a call that runs
    only the backward (the forward's graph is kept); None when flash-attn-4 is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def prepare(q, k, v, do, causal=False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return lambda: torch_grad(out, leaves, do)

    return prepare


def torch_grad(out, leaves, grad):
    import torch

    return torch.autograd.grad(out, leaves, grad, retain_graph=True)


def sdpa_backward(backend):
    """SDPA restricted to ``backend``, forward once; the call returned runs its backward."""
    import torch.nn.functional as F

    def prepare(q, k, v, do, causal=False):
        leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
        with _restricted_to(backend):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        grad = do.transpose(1, 2)

        def run():
            with _restricted_to(backend):
                return torch_grad(out, leaves, grad)
        run.setting = partial(_pinned, backend)
        return run

    return prepare


def backward_calls(shape: PrefillShape, module, baselines=("SDPA flash", "SDPA cuDNN", "FA4"),
                   deterministic: bool = True) -> dict:
    """{name: (stage or None, fn())}: stage 11's backward (and with ``deterministic`` its deterministic mode) and
    the ``baselines`` (SDPA's flash and cuDNN backward, FA4's), each after its own forward on the same random
    inputs (only the backward is timed)."""
    import torch
    from torch.nn.attention import SDPBackend

    from course import testing

    q, k, v = testing.random_qkv(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads,
                                 shape.head_dim, getattr(torch, shape.dtype), head_dim_v=shape.dv)
    out, lse = module.attention(q, k, v, causal=shape.causal, return_lse=True)
    do = torch.randn_like(out)
    modes = (("", False), (" deterministic", True)) if deterministic else (("", False),)
    calls = {f"stage {module.STAGE}{suffix}": (module.STAGE, partial(module.attention_backward, do, q, k, v, out, lse,
                                                                    causal=shape.causal, deterministic=mode))
             for suffix, mode in modes}
    preparers = {"SDPA flash": lambda: sdpa_backward(SDPBackend.FLASH_ATTENTION),
                 "SDPA cuDNN": lambda: sdpa_backward(SDPBackend.CUDNN_ATTENTION), "FA4": fa4_backward}
    for name in baselines:
        prepare = preparers[name]()
        if prepare is None:
            continue
        try:
            calls[name] = (None, prepare(q, k, v, do, causal=shape.causal))
        except RuntimeError as error:
            print(f"  {name} on {shape.label}: not run ({str(error).splitlines()[0]})")
    return calls


def bench_backward(stage_numbers, *, impl: str = "solutions", repeats: int = 50, head_dims=None) -> list[dict]:
    """The backward stages on their shapes (only those of ``head_dims``, (D, D_v) pairs, if given) next to
    SDPA's and FA4's backward, in the same rounds; TFLOP/s count BACKWARD_FLOPS times the forward's FLOPs."""
    import torch

    rows = []
    for number in stage_numbers:
        module = stages.get(number).load(impl)
        for shape in stages.get(number).bench_shapes:
            if head_dims is not None and (shape.head_dim, shape.dv) not in head_dims:
                continue
            calls = backward_calls(shape, module)
            fns = runnable({name: fn for name, (_, fn) in calls.items()}, shape.label)
            for name, ms in time_in_rounds(fns, repeats=repeats).items():
                tflops = BACKWARD_FLOPS * shape.flops / ms / 1e9
                rows.append({"stage": calls[name][0], "kernel": name, "shape": asdict(shape), "label": shape.label,
                             "ms": ms, "tflops": tflops})
                print(f"  {name:>20} {shape.label}: {ms:.3f} ms, {tflops:.0f} TFLOP/s (backward)")
            del fns, calls
            torch.cuda.empty_cache()
    return rows
# --8<-- [end:backward]


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, facecolor="white")  # an opaque background reads in light and dark mode alike
    import matplotlib.pyplot as plt

    plt.close(fig)


KERNEL_STYLES = {"SDPA cuDNN": ("tab:green", "s"), "SDPA flash": ("tab:gray", "v"), "FA4": ("tab:purple", "D")}


def _style(kernel: str, index: int):
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    return KERNEL_STYLES.get(kernel, (colors[index % len(colors)], "o"))


def plot_prefill(rows: list[dict], path: Path, title: str, sweep=stages.FA3_SWEEP) -> bool:
    """The FA3 paper's figure: TFLOP/s against the sequence length, one panel per (head dim, causal),
    at B * S = 16k and H * D = 2048 (``sweep``: stages.FA3_SWEEP, or stages.BACKWARD for the backward's).
    False when no row is on those shapes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqlens = sorted({shape.seqlen_q for shape in sweep})
    swept = [r for r in rows if PrefillShape(**{**r["shape"], "window": tuple(r["shape"]["window"])}) in sweep]
    if not swept:
        return False
    def dims(row: dict) -> tuple[int, int]:
        return row["shape"]["head_dim"], row["shape"].get("head_dim_v") or row["shape"]["head_dim"]

    present = {dims(r) for r in swept}
    head_dims = [pair for pair in stages.SWEEP_HEAD_DIMS if pair in present]
    panels = [(pair, causal) for pair in head_dims for causal in (False, True)]
    fig, axes = plt.subplots(len(head_dims), 2, figsize=(11, 3.4 * len(head_dims) + 0.6), sharex=True,
                             squeeze=False)
    kernels = list(dict.fromkeys(r["kernel"] for r in swept))
    for ax, (pair, causal) in zip(axes.flat, panels):
        for i, name in enumerate(kernels):
            points = sorted((r["shape"]["seqlen_q"], r["tflops"]) for r in swept if r["kernel"] == name
                            and dims(r) == pair and r["shape"]["causal"] == causal)
            if points:
                color, marker = _style(name, i)
                ax.plot(*zip(*points), marker=marker, color=color, label=name, linewidth=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        d, d_v = pair
        ax.set_title(f"head dim {d}" + (f" (V {d_v})" if d_v != d else "") + f", {'causal' if causal else 'no mask'}",
                     fontsize=11)
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length (B x S = 16k, H x D = 2048)")
    axes[0, 0].legend(fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))  # room for the title above the panels
    _save(fig, path)
    return True


def plot_ablation(rows: list[dict], path: Path, title: str) -> None:
    """One group of bars per reference shape: stage 6, stage 8 after each step, FA4, cuDNN."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 5.5))
    width = 0.85 / len(kernels)
    for i, name in enumerate(kernels):
        values = [next((r["tflops"] for r in rows if r["label"] == lab and r["kernel"] == name), 0) for lab in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name, color=_style(name, i)[0])
    ax.set_xticks([x + width * (len(kernels) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels([lab.replace(" S_k", "\nS_k").replace(" D=", "\nD=") for lab in labels], fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


# ---------------------------------------------------------------- decode (stages 7 and 9)

def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written per second): the memory roofline."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_cuda(partial(dst.copy_, src), repeats=repeats)
    del src, dst
    return 2 * nbytes / ms / 1e6


def sdpa_decode(backend):
    """PyTorch SDPA restricted to one backend, on decode inputs: q [B, H_q, D], a contiguous cache [B, L, H_kv, D]
    (cheap inside its ``setting``, like ``sdpa``)."""
    import torch.nn.functional as F

    def run(q, k, v, *unused):
        with _restricted_to(backend):
            return F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=True)

    run.setting = partial(_pinned, backend)
    return run


def fa4_decode():
    """FlashAttention-4's Hopper kernel on decode inputs, None when it is not installed: q [B, H_q, D] as
    one query token [B, 1, H_q, D]; a contiguous cache [B, L, H_kv, D], or a paged one with its block table.

    On Hopper FA4 runs without split-KV (its interface allows one split on SM 9.0): one CTA per sequence
    and KV head streams the whole cache, so a small batch leaves most SMs idle. A paged cache goes
    through ``flash_attn_varlen_func``'s ``page_table``; pages of 64 tokens are not its 128-key tile, so
    it loads them without TMA.
    """
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None

    def run(q, k, v, seqlens, block_table=None):
        try:
            if block_table is None:
                return flash_attn_func(q[:, None], k, v)
            return flash_attn_varlen_func(q[:, None], k, v, seqused_k=seqlens, page_table=block_table)
        except Exception as error:  # FA4 refuses with assertions, ValueErrors, DSL errors: a baseline left out
            raise RuntimeError(f"FlashAttention-4 does not run it: {type(error).__name__}: {error}") from error

    return run


def decode_baselines() -> dict:
    """{name: fn(q, k, v, seqlens)} on a contiguous cache: SDPA's cuDNN and flash backends, and FA4 if installed."""
    from torch.nn.attention import SDPBackend

    kernels = {"SDPA cuDNN": sdpa_decode(SDPBackend.CUDNN_ATTENTION),
               "SDPA flash": sdpa_decode(SDPBackend.FLASH_ATTENTION)}
    if fa4_decode() is not None:
        kernels["FA4"] = fa4_decode()
    return kernels


def decode_inputs(shape: DecodeShape, seed: int = 0):
    """q [B, H_q, D], the K/V cache of B full sequences of L tokens, seqlens and (paged) the block table.

    The paged cache is the contiguous one seen as B * L / page_size pages, visited
    through a shuffled block table: no second copy of the cache in memory. The
    contiguous and the paged shape of one (B, L) get the same q, K and V.
    """
    import torch

    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(shape.batch, shape.heads_q, shape.head_dim, device="cuda", dtype=dtype, generator=gen)
    cache_shape = (shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim)
    k = torch.randn(cache_shape, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(cache_shape, device="cuda", dtype=dtype, generator=gen)
    seqlens = torch.full((shape.batch,), shape.seqlen_k, dtype=torch.int32, device="cuda")
    return q, k, v, seqlens, shuffled_block_table(shape, seed) if shape.paged else None


def shuffled_block_table(shape: DecodeShape, seed: int = 0):
    """[B, L / page_size] int32: the B * L / page_size pages of the cache, in a random order."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = shape.batch * shape.seqlen_k // shape.page_size
    return torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(shape.batch, -1)


def decode_groups(shapes) -> dict:
    """{contiguous shape: [its shapes]}: the layouts of one (B, L) are timed together, on one cache."""
    groups = {}
    for shape in shapes:
        groups.setdefault(replace(shape, paged=False, page_size=DecodeShape.page_size), []).append(shape)
    return groups


def as_pages(cache, shape: DecodeShape):
    """``cache`` [B, L, H_kv, D] as ``shape``'s pages [B * L / page_size, page_size, H_kv, D] when it is
    paged (a view: both layouts read the same memory), else the cache itself."""
    return cache.view(-1, shape.page_size, *cache.shape[2:]) if shape.paged else cache


def reads_fp8_cache(module) -> bool:
    """Does a decode stage's ``decode_attention`` take an FP8 cache (``k_scale``, ``v_scale``: stage 9 on)?"""
    return "k_scale" in inspect.signature(module.decode_attention).parameters


# quantize_kv_cache holds float32 copies of what it quantizes (|x|, x / scale, its clamp): about 13 bytes
# per element at its peak, 16 with the allocator's rounding.
QUANTIZE_BYTES_PER_ELEMENT = 16


def fp8_bytes(shape: DecodeShape) -> int:
    """GPU memory the FP8 copy of ``shape``'s cache needs: its own bytes (half of the 16-bit cache's) and
    the temporaries of quantizing one KV head of K or V (``fp8_copy``)."""
    return shape.kv_bytes // 2 + QUANTIZE_BYTES_PER_ELEMENT * shape.batch * shape.seqlen_k * shape.head_dim


def fp8_copy_fits(shape: DecodeShape) -> bool:
    """Is there GPU memory for the FP8 copy of ``shape``'s cache next to the 16-bit one? If not, say so."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    if fp8_bytes(shape) <= free:
        return True
    print(f"  the FP8 copy of {shape.label}: not made (no fp8 rows), it and the quantization's temporaries "
          f"need {fp8_bytes(shape) / 2**30:.1f} GiB next to the 16-bit cache, {free / 2**30:.1f} GiB are free")
    return False


def fp8_copy(k, v):
    """``quantize_kv_cache(k, v)`` computed one KV head at a time: (k_fp8, v_fp8, k_scale, v_scale).

    Its scales are per KV head, so head by head gives the same cache, while its float32
    temporaries are those of one head instead of the whole cache: what lets the largest
    shapes (32 GiB of fp16 K and V) keep their 16 GiB FP8 copy next to them on an 80 GB GPU.
    """
    import torch

    from course.runtime.kv_cache import quantize_kv_cache

    k8, v8 = (torch.empty_like(x, dtype=torch.float8_e4m3fn) for x in (k, v))
    k_scale, v_scale = (torch.empty(k.shape[2], dtype=torch.float32, device=k.device) for _ in range(2))
    for h in range(k.shape[2]):
        head = slice(h, h + 1)
        k8[:, :, head], v8[:, :, head], k_scale[head], v_scale[head] = quantize_kv_cache(k[:, :, head], v[:, :, head])
    return k8, v8, k_scale, v_scale


def layout_calls(shape: DecodeShape, numbers, modules: dict, q, k, v, seqlens, fp8) -> dict:
    """{(kernel, shape): (stage or None, bytes read, a call with no arguments)} on one cache layout: the
    stages ``numbers`` on the 16-bit cache ``k``, ``v`` [B, L, H_kv, D] and, where a stage reads one, on
    its FP8 copy ``fp8`` (None: not made); on a paged layout also FA4, which the baselines leave out."""
    table = shuffled_block_table(shape) if shape.paged else None
    cache = [as_pages(x, shape) for x in (k, v)]
    calls = {}
    for n in numbers:
        decode = partial(modules[n].decode_attention, block_table=table, check_lengths=False)
        calls[f"stage {n}", shape] = (n, shape.kv_bytes, partial(decode, q, *cache, seqlens))
        if fp8 is not None and reads_fp8_cache(modules[n]):
            k8, v8, k_scale, v_scale = fp8
            calls[f"stage {n}{results_page.FP8_SUFFIX}", shape] = (n, shape.kv_bytes // 2, partial(
                decode, q, as_pages(k8, shape), as_pages(v8, shape), seqlens, k_scale=k_scale, v_scale=v_scale))
    fa4 = fa4_decode()
    if shape.paged and fa4 is not None:
        calls["FA4", shape] = (None, shape.kv_bytes, partial(fa4, q, *cache, seqlens, table))
    return calls


def decode_row(kernel: str, shape: DecodeShape, *, stage, kv_bytes: int, ms: float, eager_ms: float,
               host_us: float, copy_gbps: float) -> dict:
    """One kernel on one shape: ``ms`` from CUDA graph replays, ``eager_ms`` from eager calls, GB/s of the
    bytes it reads (an FP8 cache: half), tokens/s = B * L / time, comparable across cache dtypes."""
    gbps = kv_bytes / ms / 1e6
    return {"stage": stage, "kernel": kernel, "shape": asdict(shape), "label": shape.label, "ms": ms,
            "eager_ms": eager_ms, "kv_bytes": kv_bytes, "gbps": gbps, "copy_fraction": gbps / copy_gbps,
            "tokens_per_s": shape.batch * shape.seqlen_k / ms * 1e3, "host_us": host_us}


def add_fp8_speedups(rows: list[dict]) -> None:
    """Each FP8 row gets ``speedup_vs_fp16``: its tokens/s over the same stage's on the 16-bit cache of the
    same shape, what halving the bytes bought."""
    by_key = {(r["kernel"], r["label"]): r for r in rows}
    for row in rows:
        fp16 = by_key.get((row["kernel"].removesuffix(results_page.FP8_SUFFIX), row["label"]))
        if row["kernel"].endswith(results_page.FP8_SUFFIX) and fp16 is not None:
            row["speedup_vs_fp16"] = row["tokens_per_s"] / fp16["tokens_per_s"]


def print_decode_row(row: dict) -> None:
    line = (f"  {row['kernel']:>11} {row['label']}: {row['ms']:.3f} ms (eager {row['eager_ms']:.3f}), "
            f"{row['gbps']:.0f} GB/s ({100 * row['copy_fraction']:.0f}% of the copy bandwidth), "
            f"{row['tokens_per_s'] / 1e6:.0f} M tokens/s; host {row['host_us']:.0f} us per eager call")
    if "speedup_vs_fp16" in row:
        line += f"; {row['speedup_vs_fp16']:.2f}x the tokens/s on the 16-bit cache"
    print(line)


def time_decode_group(contiguous: DecodeShape, group: list, stage_numbers, modules: dict, *, copy_gbps: float,
                      repeats: int) -> list[dict]:
    """Rows of every kernel on one (B, L, head grouping), all timed in the same rounds, replayed from CUDA
    graphs and called eagerly: the stages on each layout of ``group`` (and on an FP8 copy of the cache where
    a stage reads one), FA4 on the paged layout, the baselines on the contiguous cache.

    The tensors live in this function's frame, so the cache is freed when it returns.
    """
    q, k, v, seqlens, _ = decode_inputs(contiguous)
    numbers = {shape: timed_stages(shape, stage_numbers) for shape in group}
    wants_fp8 = any(reads_fp8_cache(modules[n]) for timed in numbers.values() for n in timed)
    fp8 = fp8_copy(k, v) if wants_fp8 and fp8_copy_fits(contiguous) else None
    calls = {}
    for shape in group:
        calls.update(layout_calls(shape, numbers[shape], modules, q, k, v, seqlens, fp8))
    for name, fn in decode_baselines().items():
        calls[name, contiguous] = (None, contiguous.kv_bytes, partial(fn, q, k, v, seqlens))
    graphs = {}
    for (name, shape), (_, _, fn) in calls.items():
        for graph in runnable({name: fn}, shape.label, prepare=capture_graph).values():
            graphs[name, shape] = graph
    graph_ms = time_graphs(graphs, repeats=repeats)
    eager_ms = time_in_rounds({key: calls[key][2] for key in graphs}, repeats=repeats)
    rows = [decode_row(name, shape, stage=calls[name, shape][0], kv_bytes=calls[name, shape][1], ms=ms,
                       eager_ms=eager_ms[name, shape], host_us=host_microseconds(calls[name, shape][2]),
                       copy_gbps=copy_gbps)
            for (name, shape), ms in graph_ms.items()]
    add_fp8_speedups(rows)
    for row in rows:
        print_decode_row(row)
    return rows


def grouping_text(groupings) -> str:
    return ", ".join(f"{h_q}/{h_kv}" for h_q, h_kv in groupings)


def decode_shapes(stage_numbers, groupings=None) -> list[DecodeShape]:
    """The bench shapes of the decode stages ``stage_numbers``, only those of the head groupings
    ``groupings`` ((H_q, H_kv) pairs; None: all), in the registry's order."""
    shapes = dict.fromkeys(shape for n in stage_numbers for shape in stages.get(n).bench_shapes)
    chosen = [s for s in shapes if groupings is None or (s.heads_q, s.heads_kv) in groupings]
    if not chosen:
        present = dict.fromkeys((s.heads_q, s.heads_kv) for s in shapes)
        raise SystemExit(f"no bench shape of stage {', '.join(map(str, stage_numbers))} has the head grouping "
                         f"{grouping_text(groupings)} (H_q/H_kv); its groupings are {grouping_text(present)}")
    return chosen


def bench_decode(stage_numbers, *, impl: str = "solutions", repeats: int = 50, groupings=None) -> dict:
    """{copy_gbps, graph_calls, rows}: every decode stage on its bench shapes (only those of ``groupings``,
    (H_q, H_kv) pairs, if given) next to the stage it starts from, SDPA (cuDNN, flash) with enable_gqa and FA4.

    Effective bandwidth = bytes of K and V read once / time. SDPA sees the
    contiguous cache as [B, H_kv, L, D] (a transposed view) and q as
    [B, H_q, 1, D]. All kernels of one (B, L, grouping), both cache layouts, the
    FP8 cache and the baselines, are timed in the same rounds, from CUDA graphs
    (``time_graphs``) and eagerly (``time_in_rounds``). A (B, L, grouping)
    whose cache does not fit in the free GPU memory is skipped, and so is an FP8
    copy that does not fit next to it.
    """
    import torch

    shapes = decode_shapes(stage_numbers, groupings)
    copy_gbps = copy_bandwidth()
    print(f"  device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    modules = {number: stages.get(number).load(impl) for number in with_starting_stages(stage_numbers)}
    rows = []
    for contiguous, group in decode_groups(shapes).items():
        free, _ = torch.cuda.mem_get_info()
        if contiguous.kv_bytes * 1.15 > free:
            print(f"  {contiguous.label}: skipped with its other layouts, the cache "
                  f"({contiguous.kv_bytes / 2**30:.1f} GiB) does not fit in the free GPU memory "
                  f"({free / 2**30:.1f} GiB)")
            continue
        rows += time_decode_group(contiguous, group, stage_numbers, modules, copy_gbps=copy_gbps, repeats=repeats)
        torch.cuda.empty_cache()
    return {"copy_gbps": copy_gbps, "graph_calls": GRAPH_CALLS, "rows": rows}


def plot_decode(results: dict, path: Path) -> bool:
    """Bars of GB/s per kernel on stage 7's shapes (stages.DECODE), one panel per batch size, a bar group per
    context length and cache layout; False when no row is on them. Stage 9's head groupings get a line
    plot of their own (``plot_decode_groupings``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results_page.rows_on(results["decode"]["rows"], stages.DECODE)
    if not rows:
        return False
    batches = sorted({r["shape"]["batch"] for r in rows})
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    columns = min(2, len(batches))  # panels two a row: the figure stays about as tall as it is wide
    panel_rows = -(-len(batches) // columns)
    fig, axes = plt.subplots(panel_rows, columns, figsize=(6.2 * columns, 3.6 * panel_rows + 0.8), sharey=True,
                             squeeze=False)
    width = 0.8 / len(kernels)
    for ax, batch in zip(axes.flat, batches):
        groups = sorted({(r["shape"]["seqlen_k"], r["shape"]["paged"]) for r in rows if r["shape"]["batch"] == batch})
        for i, name in enumerate(kernels):
            values = [next((r["gbps"] for r in rows if r["kernel"] == name and r["shape"]["batch"] == batch
                            and (r["shape"]["seqlen_k"], r["shape"]["paged"]) == group), 0) for group in groups]
            ax.bar([x + i * width for x in range(len(groups))], values, width, label=name, color=_style(name, i)[0])
        ax.axhline(results["decode"]["copy_gbps"], color="gray", linestyle="--", linewidth=1, label="copy bandwidth")
        ax.set_xticks([x + width * (len(kernels) - 1) / 2 for x in range(len(groups))],
                      [f"L={seqlen // 1024}k\n{'paged' if paged else 'contiguous'}" for seqlen, paged in groups],
                      fontsize=8)
        ax.set_title(f"B={batch}", fontsize=10)
    for ax in axes.flat[len(batches):]:
        ax.remove()
    for ax in axes[:, 0]:
        ax.set_ylabel("effective K/V bandwidth (GB/s)")
    shape = stages.DECODE[0]
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"Decode on {results['environment']['gpu']}: H_q/H_kv {shape.heads_q}/{shape.heads_kv}, "
                 f"D={shape.head_dim}, fp16 (fp8: GB/s of its half-size cache; SDPA: contiguous caches only)", fontsize=10)
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _grouping_points(rows: list[dict], kernel: str, batch: int, grouping: tuple, paged: bool) -> list[tuple]:
    """(L, GB/s) of one kernel at one batch size, head grouping and cache layout, by L."""
    return sorted((r["shape"]["seqlen_k"], r["gbps"]) for r in rows if r["kernel"] == kernel
                  and r["shape"]["batch"] == batch and results_page.grouping(r) == grouping
                  and r["shape"]["paged"] == paged)


def decode_groupings_figure(results: dict):
    """GB/s against the context length, one line per kernel and cache layout (contiguous solid, paged
    dashed), one panel per head grouping (columns) and batch size (rows), the copy bandwidth dotted.
    None when no stage timed on several head groupings (stage 9) has rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = results_page.grouping_rows(results["decode"]["rows"])
    if not rows:
        return None
    groupings = results_page.groupings_of(rows)
    batches = sorted({r["shape"]["batch"] for r in rows})
    seqlens = sorted({r["shape"]["seqlen_k"] for r in rows})
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    height = 2.8 * len(batches) + 1.2  # inches: the panels, then the title and a legend of two lines
    fig, axes = plt.subplots(len(batches), len(groupings), figsize=(max(8.0, 3.4 * len(groupings)), height),
                             sharex=True, sharey=True, squeeze=False)
    for row_axes, batch in zip(axes, batches):
        for ax, (h_q, h_kv) in zip(row_axes, groupings):
            for i, kernel in enumerate(kernels):
                color, marker = _style(kernel, i)
                for paged in (False, True):
                    points = _grouping_points(rows, kernel, batch, (h_q, h_kv), paged)
                    if points:
                        ax.plot(*zip(*points), color=color, marker=marker, markersize=4, linewidth=1.5,
                                linestyle="--" if paged else "-")
            ax.axhline(results["decode"]["copy_gbps"], color="gray", linestyle=":", linewidth=1)
            ax.set_ylim(bottom=0)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_title(f"H_q/H_kv {h_q}/{h_kv} ({results_page.grouping_name(h_q, h_kv)}), B={batch}", fontsize=9)
            ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s")
    for ax in axes[-1]:
        ax.set_xlabel("context length L")
    handles = [Line2D([], [], color=_style(k, i)[0], marker=_style(k, i)[1], label=k) for i, k in enumerate(kernels)]
    handles += [Line2D([], [], color="black", label="contiguous cache"),
                Line2D([], [], color="black", linestyle="--", label="paged cache"),
                Line2D([], [], color="gray", linestyle=":", label="copy bandwidth")]
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // 2), fontsize=9)
    fig.suptitle(f"Decode on {results['environment']['gpu']}: GB/s of the K/V cache read (fp8: of its half-size cache)")
    fig.tight_layout(rect=(0, 0.7 / height, 1, 1))
    return fig


def plot_decode_groupings(results: dict, path: Path) -> bool:
    """Write ``decode_groupings_figure`` to ``path``; False when there is nothing to draw."""
    fig = decode_groupings_figure(results)
    if fig is None:
        return False
    _save(fig, path)
    return True


def write_plots(results: dict, out_dir: Path) -> list[str]:
    """Draw every plot ``results`` has rows for in ``out_dir``; the names of the files written."""
    gpu = results["environment"]["gpu"]
    written = []
    if plot_prefill(results.get("rows", []), out_dir / "bench-prefill.png", f"Attention forward, fp16, on {gpu}"):
        written.append("bench-prefill.png")
    if plot_prefill(results.get("backward", {}).get("rows", []), out_dir / "bench-backward.png",
                    f"Attention backward, bf16, on {gpu} (TFLOP/s: {BACKWARD_FLOPS}x the forward's FLOPs)",
                    sweep=stages.BACKWARD):
        written.append("bench-backward.png")
    if results.get("ablation"):
        plot_ablation(results["ablation"], out_dir / "bench-ablation.png", f"Stage 8, step by step, on {gpu}")
        written.append("bench-ablation.png")
    if results.get("decode", {}).get("rows"):
        if plot_decode(results, out_dir / "bench-decode.png"):
            written.append("bench-decode.png")
        if plot_decode_groupings(results, out_dir / results_page.GROUPINGS_PLOT):
            written.append(results_page.GROUPINGS_PLOT)
    return written


def replot(out_dir: Path = DEFAULT_OUT) -> list[str]:
    """Redraw the plots from ``out_dir``/bench.json (after ``python -m course.tools.results --merge``); no GPU needed."""
    out_dir = Path(out_dir)
    written = write_plots(json.loads((out_dir / "bench.json").read_text()), out_dir)
    print(f"wrote {', '.join(written) or 'no plot (bench.json has no rows to draw)'} in {out_dir}")
    return written


def run(stage_numbers=None, *, out_dir: Path = DEFAULT_OUT, impl: str = "solutions", repeats: int = 50,
        groupings=None, head_dims=None) -> dict:
    """Time ``stage_numbers`` (default: every ready stage; ``groupings``: only the decode shapes of these
    (H_q, H_kv) pairs; ``head_dims``: only the prefill and backward shapes of these (D, D_v) pairs), merge
    the rows into ``out_dir``'s bench.json (``results.merge_into``: the rows of what was not timed stay),
    write the tables (``course.tools.results``) and the plots there."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("course bench times kernels on the GPU: it needs a Hopper GPU (sm_90)")
    numbers = stage_numbers or [s.number for s in stages.STAGES if s.ready]
    prefill = [n for n in numbers if stages.get(n).kind == "prefill"]
    decode = [n for n in numbers if stages.get(n).kind == "decode"]
    backward = [n for n in numbers if stages.get(n).kind == "backward"]
    results = {"environment": environment(),
               "rows": bench_prefill(prefill, impl=impl, repeats=repeats, head_dims=head_dims)}
    everything = head_dims is None  # else the prefill and backward rows of those head dims only
    if backward:
        results["backward"] = {"rows": bench_backward(backward, impl=impl, repeats=repeats, head_dims=head_dims)}
    if 8 in prefill and everything:
        results["ablation"] = bench_ablation(impl=impl, repeats=repeats)
    if decode and everything:
        results["decode"] = bench_decode(decode, impl=impl, repeats=repeats, groupings=groupings)
    if any(stages.get(n).ragged_shapes for n in prefill) and everything:
        results["varlen"] = {"rows": bench_ragged(prefill, impl=impl, repeats=repeats)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = results_page.merge_into(out_dir, results)  # a partial run keeps every other row
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    results_page.render(out_dir)
    written = ["bench.json", results_page.TABLES, results_page.BENCH_MD, *write_plots(results, out_dir)]
    print(f"wrote {', '.join(written)} in {out_dir}")
    return results
