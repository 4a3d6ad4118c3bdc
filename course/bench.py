"""Benchmarks: each stage's kernel next to PyTorch SDPA (flash and cuDNN), same GPU, same run.

Timing: CUDA events around each call, after warm-up, median of many repeats.
Results go to ``bench.json`` (with the GPU, driver and versions), ``bench.md``
(the table the docs include) and ``bench.png`` (the plot). Never edit those by
hand: rerun ``python -m course bench --out docs/results`` on a Hopper GPU.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from course import stages

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results"


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "float16"

    @property
    def label(self) -> str:
        return f"B={self.batch} H={self.heads} S_q={self.seqlen_q} S_k={self.seqlen_k} D={self.head_dim} {self.dtype}"

    @property
    def flops(self) -> int:
        """Two GEMMs of 2*S_q*S_k*D flops per head (non-causal)."""
        return 4 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim

    @property
    def bytes_moved(self) -> int:
        """Q, K, V read and O written once: the least any kernel must move."""
        rows = 2 * self.seqlen_q + 2 * self.seqlen_k
        return 2 * self.batch * self.heads * rows * self.head_dim


def time_cuda(fn, *, warmup: int = 10, repeats: int = 50) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events.

    The calls are queued back to back and synchronized once at the end, so
    while the host runs ahead of the GPU each pair of events brackets GPU work
    only, for our kernels and PyTorch's alike.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def sdpa(backend):
    """PyTorch SDPA restricted to one backend, on [B, S, H, D] tensors like the kernels."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

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
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["driver"] = "unknown"
    return env


def bench_prefill(stage_numbers, *, impl: str = "solutions", repeats: int = 50) -> list[dict]:
    """Rows of {stage, kernel, shape, ms, tflops, gbps} for each stage's BENCH_SHAPES."""
    import torch
    from torch.nn.attention import SDPBackend

    from course import testing

    baselines = {"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}
    rows = []
    for number in stage_numbers:
        stage = stages.get(number)
        module = stage.load(impl)
        for shape in module.BENCH_SHAPES:
            q, k, v = testing.random_qkv(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads,
                                         shape.head_dim, getattr(torch, shape.dtype))
            kernels = {f"stage {number}": module.attention, **baselines}
            for name, fn in kernels.items():
                try:
                    ms = time_cuda(lambda: fn(q, k, v), repeats=repeats)
                except RuntimeError as error:  # a backend that refuses the shape
                    print(f"  {name} on {shape.label}: not run ({str(error).splitlines()[0]})")
                    continue
                rows.append({
                    "stage": number, "kernel": name, "shape": asdict(shape), "label": shape.label,
                    "ms": ms, "tflops": shape.flops / ms / 1e9, "gbps": shape.bytes_moved / ms / 1e6,
                })
                print(f"  {name:>11} {shape.label}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s, "
                      f"{rows[-1]['gbps']:.0f} GB/s")
    return rows


def markdown_table(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"Measured on {env['gpu']} (driver {env['driver']}), PyTorch {env['torch']} (CUDA {env['cuda']}, "
        f"cuDNN {env['cudnn']}), nvidia-cutlass-dsl {env['nvidia_cutlass_dsl']}, {env['date']}. "
        "Median of CUDA-event timings after warm-up.",
        "",
        "| shape | kernel | time (ms) | TFLOP/s | GB/s (Q, K, V, O once) | vs SDPA cuDNN |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label in dict.fromkeys(r["label"] for r in results["rows"]):
        group = [r for r in results["rows"] if r["label"] == label]
        cudnn = next((r["ms"] for r in group if r["kernel"] == "SDPA cuDNN"), None)
        for r in group:
            ratio = f"{cudnn / r['ms']:.2f}x" if cudnn else "-"
            lines.append(f"| {label} | {r['kernel']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['gbps']:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in results["rows"]))
    kernels = list(dict.fromkeys(r["kernel"] for r in results["rows"]))
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(labels)), 4))
    width = 0.8 / len(kernels)
    for i, name in enumerate(kernels):
        values = [next((r["tflops"] for r in results["rows"] if r["label"] == lab and r["kernel"] == name), 0)
                  for lab in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(kernels) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels([lab.replace(" S_q", "\nS_q") for lab in labels], fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Attention forward on {results['environment']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(stage_numbers=None, *, out_dir: Path = DEFAULT_OUT, impl: str = "solutions", repeats: int = 50) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("course bench times kernels on the GPU: it needs a Hopper GPU (sm_90)")
    numbers = stage_numbers or [s.number for s in stages.STAGES if s.ready]
    results = {"environment": environment(), "rows": bench_prefill(numbers, impl=impl, repeats=repeats)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "bench.md").write_text(markdown_table(results))
    plot(results, out_dir / "bench.png")
    print(f"wrote {out_dir / 'bench.json'}, bench.md and bench.png")
    return results
