"""Benchmarks: each stage's kernel next to PyTorch SDPA (flash and cuDNN), same GPU, same run.

Timing: CUDA events around each call, after warm-up, median of many repeats,
the kernels compared on one shape called in rounds (``time_in_rounds``).
Results go to ``bench.json`` (with the GPU, driver and versions), ``bench.md``
(the tables the docs include, rendered by ``course.results``) and the plots.
Never edit those by hand: rerun ``python -m course bench --out docs/results``
on a Hopper GPU.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path

from course import results as results_page
from course import stages
from course.shapes import DecodeShape, PrefillShape

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results"


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

    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def sdpa(backend):
    """PyTorch SDPA restricted to one backend, on [B, S, H, D] tensors like the kernels.

    Causal only (SDPA has no sliding window); its causal mask is top-left aligned,
    which equals the contract's bottom-right one when S_q == S_k, as in the benchmarks.
    """
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal=False, window_size=(-1, -1), sink_logits=None, return_lse=False):
        if window_size != (-1, -1) or sink_logits is not None or return_lse:
            raise RuntimeError("SDPA has no sliding-window attention, sink logits or LSE output here")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal)

    return run


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

    q, k, v = testing.random_qkv(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads,
                                 shape.head_dim, getattr(torch, shape.dtype))
    features = kernel_features(shape, shape.heads)
    calls = runnable({name: lambda fn=fn: fn(q, k, v, **features) for name, (_, fn) in kernels.items()}, shape.label)
    rows = []
    for name, ms in time_in_rounds(calls, repeats=repeats).items():
        rows.append({"stage": kernels[name][0], "kernel": name, "shape": asdict(shape), "label": shape.label,
                     "ms": ms, "tflops": shape.flops / ms / 1e9, "gbps": shape.bytes_moved / ms / 1e6})
        print(f"  {name:>20} {shape.label}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s, "
              f"{rows[-1]['gbps']:.0f} GB/s")
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def bench_prefill(stage_numbers, *, impl: str = "solutions", repeats: int = 50) -> list[dict]:
    """Every stage on its bench shapes (next to the stage it starts from, if any), and the baselines
    once per distinct shape, all in the same rounds."""
    numbers = list(dict.fromkeys(list(stage_numbers) + [stages.get(n).starts_from for n in stage_numbers
                                                        if stages.get(n).starts_from]))
    modules = {number: stages.get(number).load(impl) for number in numbers}
    shapes = dict.fromkeys(shape for number in stage_numbers for shape in stages.get(number).bench_shapes)
    rows = []
    for shape in shapes:
        timed = [n for n in stage_numbers if shape in stages.get(n).bench_shapes]
        timed += [stages.get(n).starts_from for n in timed if stages.get(n).starts_from]
        kernels = {f"stage {n}": (n, modules[n].attention) for n in dict.fromkeys(timed)}
        kernels.update({name: (None, fn) for name, fn in baselines().items()})
        rows += time_prefill_shape(shape, kernels, repeats)
    return rows


def bench_ablation(*, impl: str = "solutions", repeats: int = 50) -> list[dict]:
    """Stage 8's ablation: stage 6, then the kernel after each of stage 8's steps, next to FA4 and cuDNN."""
    from course import prefill

    stage6, stage8 = stages.get(6).load(impl), stages.get(8).load(impl)
    rows = []
    for shape in stages.FA3_REFERENCE:
        kernels = {"stage 6": (6, stage6.attention)}
        for label, kernel_class in stage8.ABLATION.items():
            kernels[f"stage 8 {label}"] = (8, lambda q, k, v, cls=kernel_class, **f: prefill.attention(8, cls, q, k, v, **f))
        kernels.update({name: (None, fn) for name, fn in baselines().items() if name != "SDPA flash"})
        rows += time_prefill_shape(shape, kernels, repeats)
    return rows


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, facecolor="white")  # an opaque background reads in light and dark mode alike
    import matplotlib.pyplot as plt

    plt.close(fig)


KERNEL_STYLES = {"SDPA cuDNN": ("tab:green", "s"), "SDPA flash": ("tab:gray", "v"), "FA4": ("tab:purple", "D")}


def _style(kernel: str, index: int):
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    return KERNEL_STYLES.get(kernel, (colors[index % len(colors)], "o"))


def plot_prefill(rows: list[dict], path: Path, title: str) -> bool:
    """The FA3 paper's figure: TFLOP/s against the sequence length, one panel per (head dim, causal),
    at B * S = 16k and H * D = 2048 (stages.FA3_SWEEP). False when no row is on those shapes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqlens = sorted({shape.seqlen_q for shape in stages.FA3_SWEEP})
    swept = [r for r in rows if PrefillShape(**{**r["shape"], "window": tuple(r["shape"]["window"])})
             in stages.FA3_SWEEP]
    if not swept:
        return False
    panels = [(d, causal) for d in (64, 128) for causal in (False, True)]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    kernels = list(dict.fromkeys(r["kernel"] for r in swept))
    for ax, (d, causal) in zip(axes.flat, panels):
        for i, name in enumerate(kernels):
            points = sorted((r["shape"]["seqlen_q"], r["tflops"]) for r in swept if r["kernel"] == name
                            and r["shape"]["head_dim"] == d and r["shape"]["causal"] == causal)
            if points:
                color, marker = _style(name, i)
                ax.plot(*zip(*points), marker=marker, color=color, label=name, linewidth=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        ax.set_title(f"head dim {d}, {'causal' if causal else 'no mask'}", fontsize=11)
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[1, 0].set_xlabel("sequence length (B x S = 16k, H x D = 2048)")
    axes[1, 1].set_xlabel("sequence length (B x S = 16k, H x D = 2048)")
    axes[0, 0].legend(fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
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


# ---------------------------------------------------------------- decode (stage 7)

def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written per second): the memory roofline."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), repeats=repeats)
    del src, dst
    return 2 * nbytes / ms / 1e6


def sdpa_decode(backend):
    """PyTorch SDPA restricted to one backend, on decode inputs: q [B, H_q, D], a contiguous cache [B, L, H_kv, D]."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, *unused):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=True)

    return run


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


def bench_decode(stage_numbers, *, impl: str = "solutions", repeats: int = 50) -> dict:
    """{copy_gbps, rows}: every decode stage on its BENCH_SHAPES next to SDPA (cuDNN, flash) with enable_gqa.

    Effective bandwidth = bytes of K and V read once / time. SDPA sees the
    contiguous cache as [B, H_kv, L, D] (a transposed view) and q as
    [B, H_q, 1, D]. All kernels of one (B, L), both cache layouts and the
    baselines, are timed in the same rounds (``time_graphs``). Shapes whose
    cache does not fit in the free GPU memory are skipped.
    """
    import torch
    from torch.nn.attention import SDPBackend

    baselines = {"SDPA cuDNN": sdpa_decode(SDPBackend.CUDNN_ATTENTION),
                 "SDPA flash": sdpa_decode(SDPBackend.FLASH_ATTENTION)}
    copy_gbps = copy_bandwidth()
    print(f"  device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    modules = {number: stages.get(number).load(impl) for number in stage_numbers}
    shapes = dict.fromkeys(shape for number in stage_numbers for shape in stages.get(number).bench_shapes)
    rows = []
    for contiguous, group in decode_groups(shapes).items():
        free, _ = torch.cuda.mem_get_info()
        if contiguous.kv_bytes * 1.15 > free:
            print(f"  {contiguous.label}: skipped, the cache ({contiguous.kv_bytes / 2**30:.1f} GiB) does not fit "
                  f"in the free GPU memory ({free / 2**30:.1f} GiB)")
            continue
        q, k, v, seqlens, _ = decode_inputs(contiguous)
        kernels = {}  # (name, shape) -> (stage number, a call with no arguments)
        for shape in group:
            table = shuffled_block_table(shape) if shape.paged else None
            kv = [x.view(-1, shape.page_size, *x.shape[2:]) if shape.paged else x for x in (k, v)]
            for n, m in modules.items():
                if shape in stages.get(n).bench_shapes:
                    kernels[f"stage {n}", shape] = (n, lambda m=m, kv=kv, table=table: m.decode_attention(
                        q, *kv, seqlens, block_table=table, check_lengths=False))
        kernels.update({(name, contiguous): (None, lambda fn=fn: fn(q, k, v)) for name, fn in baselines.items()})
        graphs = {}
        for (name, shape), (_, fn) in kernels.items():
            for graph in runnable({name: fn}, shape.label, prepare=capture_graph).values():
                graphs[name, shape] = graph
        times = time_graphs(graphs, repeats=repeats)
        for (name, shape), ms in times.items():
            number, fn = kernels[name, shape]
            host_us = host_microseconds(fn)
            gbps = shape.kv_bytes / ms / 1e6
            rows.append({"stage": number, "kernel": name, "shape": asdict(shape), "label": shape.label,
                         "ms": ms, "gbps": gbps, "copy_fraction": gbps / copy_gbps, "host_us": host_us})
            print(f"  {name:>11} {shape.label}: {ms:.3f} ms, {gbps:.0f} GB/s of K and V "
                  f"({100 * gbps / copy_gbps:.0f}% of the copy bandwidth); host {host_us:.0f} us per eager call")
        del q, k, v, seqlens, graphs
        torch.cuda.empty_cache()
    return {"copy_gbps": copy_gbps, "graph_calls": GRAPH_CALLS, "rows": rows}


def plot_decode(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["decode"]["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4.5))
    width = 0.8 / len(kernels)
    for i, name in enumerate(kernels):
        values = [next((r["gbps"] for r in rows if r["label"] == lab and r["kernel"] == name), 0) for lab in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.axhline(results["decode"]["copy_gbps"], color="gray", linestyle="--", linewidth=1, label="copy bandwidth")
    ax.set_xticks([x + width * (len(kernels) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels([lab.replace(" H_q", "\nH_q").replace(" float16", "\nfloat16") for lab in labels], fontsize=6)
    ax.set_ylabel("effective K/V bandwidth (GB/s)")
    ax.set_title(f"Decode on {results['environment']['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(stage_numbers=None, *, out_dir: Path = DEFAULT_OUT, impl: str = "solutions", repeats: int = 50) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("course bench times kernels on the GPU: it needs a Hopper GPU (sm_90)")
    numbers = stage_numbers or [s.number for s in stages.STAGES if s.ready]
    prefill = [n for n in numbers if stages.get(n).kind == "prefill"]
    decode = [n for n in numbers if stages.get(n).kind == "decode"]
    results = {"environment": environment(), "rows": bench_prefill(prefill, impl=impl, repeats=repeats)}
    if 8 in prefill:
        results["ablation"] = bench_ablation(impl=impl, repeats=repeats)
    if decode:
        results["decode"] = bench_decode(decode, impl=impl, repeats=repeats)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    results_page.render(out_dir)
    gpu = results["environment"]["gpu"]
    written = ["bench.json", results_page.TABLES, results_page.BENCH_MD]
    if plot_prefill(results["rows"], out_dir / "bench-prefill.png", f"Attention forward, fp16, on {gpu}"):
        written.append("bench-prefill.png")
    if results.get("ablation"):
        plot_ablation(results["ablation"], out_dir / "bench-ablation.png", f"Stage 8, step by step, on {gpu}")
        written.append("bench-ablation.png")
    if results.get("decode", {}).get("rows"):
        plot_decode(results, out_dir / "bench-decode.png")
        written.append("bench-decode.png")
    print(f"wrote {', '.join(written)} in {out_dir}")
    return results
