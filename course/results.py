"""Every results table, generated from the benchmark's raw numbers: the one renderer.

``python -m course bench --out docs/results`` (on a Hopper GPU) writes
``bench.json``; this module turns it into ``results-tables.md`` (the
environment, then one table per stage and stage 8's ablation: the results
page), ``stageNN.md`` (one stage's rows next to the baselines: its page) and
``bench.md`` (every row). Regenerate them with

    python -m course.results                     # docs/results/bench.json -> the tables
    python -m course.results --merge a.json b.json   # several runs on one GPU -> bench.json, then the tables

and never edit them by hand: a test checks they equal ``render()``'s output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from course import stages
from course.shapes import PrefillShape

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "docs" / "results"
TABLES = "results-tables.md"
BENCH_MD = "bench.md"
BASELINE = "SDPA cuDNN"
PEER = "FA4"  # FlashAttention-4's Hopper kernel, in the same DSL: a column where it ran


def cudnn_version(version) -> str:
    """torch.backends.cudnn.version() as a dotted version: 91900 -> 9.19.0, 8907 -> 8.9.7."""
    if not isinstance(version, int):
        return str(version)
    if version >= 10000:  # cuDNN 9 and later: major * 10000 + minor * 100 + patch
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def environment_table(env: dict) -> list[str]:
    rows = [
        ("GPU", env.get("gpu", "unknown")),
        ("NVIDIA driver", env.get("driver", "unknown")),
        ("CUDA (PyTorch's build)", env.get("cuda", "unknown")),
        ("cuDNN", cudnn_version(env.get("cudnn", "unknown"))),
        ("PyTorch", env.get("torch", "unknown")),
        ("nvidia-cutlass-dsl", env.get("nvidia_cutlass_dsl", "unknown")),
        ("flash-attn-4 (FA4)", env.get("flash_attn_4", "not measured")),
        ("date", env.get("date", "unknown")),
    ]
    return ["| measured with | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]


def _ratio(baseline_ms, ms) -> str:
    return f"{baseline_ms / ms:.2f}x" if baseline_ms else "-"


def _kernel(row: dict) -> str:
    return f"**{row['kernel']}**" if row["kernel"].startswith("stage") else row["kernel"]


def _rows_of_stage(rows: list[dict], number: int) -> list[dict]:
    """Every row measured on the shapes of stage ``number``: its kernel, other stages' and the baselines."""
    labels = list(dict.fromkeys(r["label"] for r in rows if r.get("stage") == number))
    return [r for label in labels for r in rows if r["label"] == label]


def _time_of(rows: list[dict], label: str, kernel: str):
    return next((r["ms"] for r in rows if r["label"] == label and r["kernel"] == kernel), None)


def prefill_table(rows: list[dict]) -> list[str]:
    """One row per (shape, kernel); a "vs FA4" column when FA4 ran on any of the shapes."""
    with_peer = any(r["kernel"] == PEER for r in rows)
    lines = [
        "| shape | kernel | time (ms) | TFLOP/s | GB/s (Q, K, V, O once) | vs SDPA cuDNN |" + (" vs FA4 |" if with_peer else ""),
        "|---|---|---:|---:|---:|---:|" + ("---:|" if with_peer else ""),
    ]
    for r in rows:
        line = (f"| {r['label']} | {_kernel(r)} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['gbps']:.0f} | "
                f"{_ratio(_time_of(rows, r['label'], BASELINE), r['ms'])} |")
        if with_peer:
            line += f" {_ratio(_time_of(rows, r['label'], PEER), r['ms'])} |"
        lines.append(line)
    return lines


def ablation_table(rows: list[dict]) -> list[str]:
    """Stage 8's ablation: TFLOP/s of each kernel (columns) per shape (rows), then the final kernel's ratios."""
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    final = next((k for k in reversed(kernels) if k.startswith("stage")), None)
    lines = ["| shape | " + " | ".join(kernels) + f" | {final} vs cuDNN | {final} vs FA4 |",
             "|---|" + "---:|" * (len(kernels) + 2)]
    for label in dict.fromkeys(r["label"] for r in rows):
        cells = [f"{r['tflops']:.0f}" for k in kernels for r in rows if r["label"] == label and r["kernel"] == k]
        ms = _time_of(rows, label, final)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_ratio(_time_of(rows, label, BASELINE), ms)} | "
                     f"{_ratio(_time_of(rows, label, PEER), ms)} |")
    return lines


def decode_timing(decode: dict) -> str:
    return (f"Time per call is GPU time, replayed from a CUDA graph of {decode['graph_calls']} calls (as serving "
            "engines run decode); \"host\" is the Python and launch time of one eager call, which is what an eager "
            "call on a short cache waits for.")


def decode_table(rows: list[dict], all_rows: list[dict]) -> list[str]:
    """Paged rows compare with SDPA on the same cache stored contiguously (SDPA has no paged cache)."""
    lines = [
        "| shape | kernel | time (ms) | K/V GB/s | of copy bandwidth | vs SDPA cuDNN | host (us) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        contiguous = {**r["shape"], "paged": False}
        baseline = next((b["ms"] for b in all_rows if b["kernel"] == BASELINE and b["shape"] == contiguous), None)
        fraction = f"{100 * r['copy_fraction']:.0f}%" if "copy_fraction" in r else "-"
        host = f"{r['host_us']:.0f}" if "host_us" in r else "-"
        lines.append(f"| {r['label']} | {_kernel(r)} | {r['ms']:.3f} | {r['gbps']:.0f} | {fraction} | "
                     f"{_ratio(baseline, r['ms'])} | {host} |")
    return lines


def stage_heading(number: int) -> str:
    try:
        return f"Stage {number}: {stages.get(number).title}"
    except ValueError:
        return f"Stage {number}"


def _stage_numbers(rows: list[dict]) -> list[int]:
    return sorted({r["stage"] for r in rows if r.get("stage") is not None})


def measured_on(env: dict) -> str:
    return (f"Measured on {env['gpu']} (driver {env['driver']}), PyTorch {env['torch']} (CUDA {env['cuda']}, "
            f"cuDNN {cudnn_version(env['cudnn'])}), nvidia-cutlass-dsl {env['nvidia_cutlass_dsl']}, "
            f"flash-attn-4 {env.get('flash_attn_4', 'not measured')}, {env['date']}. Median of CUDA-event "
            "timings after warm-up; the kernels of one shape timed in the same rounds.")


def in_sweep(row: dict) -> bool:
    """Is the row on one of the shapes of the FA3-style plot (stages.FA3_SWEEP)?"""
    return PrefillShape(**{**row["shape"], "window": tuple(row["shape"]["window"])}) in stages.FA3_SWEEP


def ablation_section(results: dict, images: str) -> list[str]:
    return ["Stage 6, then stage 8 after each of its steps (each a kernel of its own: `ABLATION` in "
            "`solutions/stage08_fa3_prefill.py`), FlashAttention-4's Hopper kernel and cuDNN, TFLOP/s:", "",
            *ablation_table(results["ablation"]), "",
            f"![TFLOP/s after each step of stage 8]({images}/bench-ablation.png)"]


def tables(results: dict) -> str:
    """The Markdown of results-tables.md for the parsed bench.json."""
    prefill = results.get("rows", [])
    decode = results.get("decode", {}).get("rows", [])
    lines = [
        "<!-- Generated by `python -m course.results` from docs/results/bench.json. Do not edit by hand. -->",
        "",
        "## Where and when",
        "",
        *environment_table(results["environment"]),
    ]
    if "copy_gbps" in results.get("decode", {}):
        lines.append(f"| device-to-device copy | {results['decode']['copy_gbps']:.0f} GB/s (read + write) |")
    if prefill:
        lines += ["", "## Prefill", "",
                  "Kernels in bold are the course's stages; the others are PyTorch's SDPA backends (flash is "
                  "FlashAttention-2, cuDNN) and FlashAttention-4's Hopper kernel (FA4) on the same inputs."]
        if any(in_sweep(r) for r in prefill):
            lines += ["", "![TFLOP/s against sequence length, per head dim, causal or not](results/bench-prefill.png)"]
        for number in _stage_numbers(prefill):
            lines += ["", f"### {stage_heading(number)}", "", *prefill_table(_rows_of_stage(prefill, number))]
    if results.get("ablation"):
        lines += ["", "## Stage 8, step by step", "", *ablation_section(results, "results")]
    if decode:
        lines += ["", "## Decode", "",
                  "Effective bandwidth = bytes of K and V read once / time; the dashed line of the plot is the "
                  "device-to-device copy bandwidth measured in the same run. " + decode_timing(results["decode"]), "",
                  "![Decode: effective K/V bandwidth of each kernel, per shape](results/bench-decode.png)"]
        for number in _stage_numbers(decode):
            lines += ["", f"### {stage_heading(number)}", "", *decode_table(_rows_of_stage(decode, number), decode)]
    if not prefill and not decode:
        lines += ["", "No measurements yet: run `python -m course bench --out docs/results` on a Hopper GPU."]
    return "\n".join(lines) + "\n"


def stage_md(results: dict, number: int) -> str:
    """One stage's results for its page: its rows next to the baselines (and stage 8's ablation)."""
    lines = ["<!-- Generated by `python -m course.results` from docs/results/bench.json. Do not edit by hand. -->",
             "", measured_on(results["environment"]), ""]
    if stages.get(number).kind == "decode":
        decode = results["decode"]
        lines += [decode_timing(decode), "", *decode_table(_rows_of_stage(decode["rows"], number), decode["rows"])]
    else:
        rows = _rows_of_stage(results["rows"], number)
        if number == 8 and any(in_sweep(r) for r in rows):
            lines += ["![TFLOP/s against sequence length, per head dim, causal or not](../results/bench-prefill.png)",
                      ""]
        lines += prefill_table(rows)
        if number == 8 and results.get("ablation"):
            lines += ["", *ablation_section(results, "../results")]
    return "\n".join(lines) + "\n"


def bench_md(results: dict) -> str:
    """The Markdown of bench.md: every prefill row in one table, then every decode row, under the environment."""
    lines = [measured_on(results["environment"])]
    if results.get("rows"):
        lines += ["", *prefill_table(results["rows"])]
    decode = results.get("decode")
    if decode and decode["rows"]:
        lines += ["", f"Decode: effective bandwidth = bytes of K and V read once / time. Device-to-device copy on "
                  f"the same GPU in the same run: {decode['copy_gbps']:.0f} GB/s (read + write). "
                  + decode_timing(decode), "", *decode_table(decode["rows"], decode["rows"])]
    return "\n".join(lines) + "\n"


def measured_stages(results: dict) -> list[int]:
    return _stage_numbers(results.get("rows", []) + results.get("decode", {}).get("rows", []))


def render(results_dir: Path | str = DEFAULT_DIR) -> str:
    """Read ``bench.json`` in ``results_dir``; write ``results-tables.md``, ``bench.md`` and one
    ``stageNN.md`` per measured stage next to it; return the text of ``results-tables.md``."""
    results_dir = Path(results_dir)
    results = json.loads((results_dir / "bench.json").read_text())
    (results_dir / BENCH_MD).write_text(bench_md(results))
    for number in measured_stages(results):
        (results_dir / stage_file(number)).write_text(stage_md(results, number))
    text = tables(results)
    (results_dir / TABLES).write_text(text)
    return text


def stage_file(number: int) -> str:
    return f"stage{number:02d}.md"


def merge(runs: list[dict]) -> dict:
    """One results dict from several bench runs on the same GPU: rows are keyed by shape and kernel, and a
    later run's row replaces an earlier run's; the environment is the first run's."""
    merged = {"environment": runs[0]["environment"], "rows": []}
    for run in runs:
        timed = {(r["label"], r["kernel"]) for r in run.get("rows", [])}
        merged["rows"] = [r for r in merged["rows"] if (r["label"], r["kernel"]) not in timed] + run.get("rows", [])
        for key in ("ablation", "decode"):
            if run.get(key):
                merged[key] = run[key]
    shape_order = {label: i for i, label in enumerate(dict.fromkeys(r["label"] for r in merged["rows"]))}
    merged["rows"].sort(key=lambda r: (shape_order[r["label"]], r["stage"] is None, r["stage"] or 0))
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course.results",
        description="Write the docs' results tables (results-tables.md, stageNN.md, bench.md) from bench.json.",
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help="the folder with bench.json (default: docs/results)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="BENCH_JSON",
                        help="bench.json files of several runs on one GPU: merged into DIR/bench.json first")
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge([json.loads(path.read_text()) for path in args.merge])
        (args.dir / "bench.json").write_text(json.dumps(merged, indent=2) + "\n")
    render(args.dir)
    print(f"wrote {args.dir / TABLES}, {args.dir / BENCH_MD} and the stage tables from {args.dir / 'bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
