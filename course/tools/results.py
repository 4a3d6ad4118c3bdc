"""Every results table, generated from the benchmark's raw numbers: the one renderer.

``python -m course bench --out docs/results`` (on a Hopper GPU) writes
``bench.json``; this module turns it into ``results-tables.md`` (the
environment, then one table per stage and stage 8's ablation: the results
page), ``stageNN.md`` (one stage's rows next to the baselines: its page) and
``bench.md`` (every row). Regenerate them with

    python -m course.tools.results                     # docs/results/bench.json -> the tables
    python -m course.tools.results --merge a.json b.json   # several runs on one GPU -> bench.json, then the tables

and never edit them by hand: a test checks they equal ``render()``'s output.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from course.runtime import stages
from course.runtime.shapes import DecodeShape, PrefillShape

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "docs" / "results"
TABLES = "results-tables.md"
BENCH_MD = "bench.md"
BASELINE = "SDPA cuDNN"
PEER = "FA4"  # FlashAttention-4's Hopper kernel, in the same DSL: a column where it ran
FP8_SUFFIX = " fp8"  # "stage 9 fp8": stage 9's kernel on the FP8 (e4m3) copy of the same cache
GROUPINGS_PLOT = "bench-decode-groupings.png"  # stage 9: GB/s against L, per head grouping and batch size
LONG_CONTEXT = 32 * 1024  # stage 9's summary: copy share and FP8 speed-up from this many keys on (its targets')


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


def _with_eager(rows: list[dict]) -> bool:
    """Were these decode rows also timed eagerly (runs from stage 9 on)?"""
    return any("eager_ms" in r for r in rows)


def decode_timing(decode: dict) -> str:
    text = (f"Time per call is GPU time, replayed from a CUDA graph of {decode['graph_calls']} calls (as serving "
            "engines run decode); \"host\" is the Python and launch time of one eager call, which is what an eager "
            "call on a short cache waits for.")
    if _with_eager(decode["rows"]):
        text += (" \"eager\" times the same calls without a graph, in the same rounds: what a caller without "
                 "CUDA graphs gets, host included where the host is the slower side.")
    return text


def decode_table(rows: list[dict], all_rows: list[dict]) -> list[str]:
    """Paged rows compare with SDPA on the same cache stored contiguously (SDPA has no paged cache). Rows
    timed eagerly too add their eager time and tokens/s (B * L / time, comparable across cache dtypes)."""
    with_eager = _with_eager(rows)
    lines = [
        "| shape | kernel | time (ms) | K/V GB/s | of copy bandwidth | vs SDPA cuDNN | host (us) |"
        + (" eager (ms) | M tokens/s |" if with_eager else ""),
        "|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if with_eager else ""),
    ]
    for r in rows:
        contiguous = {**r["shape"], "paged": False}
        baseline = next((b["ms"] for b in all_rows if b["kernel"] == BASELINE and b["shape"] == contiguous), None)
        fraction = f"{100 * r['copy_fraction']:.0f}%" if "copy_fraction" in r else "-"
        host = f"{r['host_us']:.0f}" if "host_us" in r else "-"
        line = (f"| {r['label']} | {_kernel(r)} | {r['ms']:.3f} | {r['gbps']:.0f} | {fraction} | "
                f"{_ratio(baseline, r['ms'])} | {host} |")
        if with_eager:
            line += f" {_value(r, 'eager_ms', '{:.3f}')} | {_value(r, 'tokens_per_s', '{:,.0f}', 1e6)} |"
        lines.append(line)
    return lines


def _value(row: dict | None, key: str, spec: str, unit: float = 1.0) -> str:
    """``row[key] / unit`` formatted with ``spec``, or "-" when the row or the value is missing."""
    return spec.format(row[key] / unit) if row is not None and key in row else "-"


# ---------------------------------------------------------------- decode over head groupings (stage 9)

def decode_shape(row: dict) -> DecodeShape:
    return DecodeShape(**row["shape"])


def rows_on(rows: list[dict], shapes) -> list[dict]:
    """The decode rows measured on one of ``shapes`` (DecodeShapes), in their order."""
    shapes = set(shapes)
    return [r for r in rows if decode_shape(r) in shapes]


def grouping(row: dict) -> tuple[int, int]:
    """(H_q, H_kv) of a decode row's shape."""
    return row["shape"]["heads_q"], row["shape"]["heads_kv"]


def grouping_name(heads_q: int, heads_kv: int) -> str:
    if heads_q == heads_kv:
        return "MHA"
    return "MQA" if heads_kv == 1 else f"GQA, group {heads_q // heads_kv}"


def groupings_of(rows: list[dict]) -> list[tuple[int, int]]:
    """The head groupings of ``rows``: the registry's (stages.GROUPINGS) in its order, then any other."""
    present = set(map(grouping, rows))
    return [g for g in stages.GROUPINGS if g in present] + sorted(present - set(stages.GROUPINGS))


def spans_groupings(number: int) -> bool:
    """Is stage ``number`` a decode stage timed on several head groupings (stage 9)? Its results are then one
    table per grouping and a plot, instead of one row per (shape, kernel)."""
    stage = stages.get(number)
    return stage.kind == "decode" and len({(s.heads_q, s.heads_kv) for s in stage.bench_shapes}) > 1


def grouping_rows(rows: list[dict]) -> list[dict]:
    """Every decode row on the shapes of the stages timed on several head groupings: what their plot draws."""
    shapes = {s for n in _stage_numbers(rows) if spans_groupings(n) for s in stages.get(n).bench_shapes}
    return rows_on(rows, shapes)


def grouping_columns(rows: list[dict], number: int) -> list[str]:
    """The kernels of stage ``number``'s grouping tables, in reading order: the stage, its FP8 variant, the stage
    it starts from, the baselines, then any other kernel measured."""
    starts_from = stages.get(number).starts_from
    preferred = [f"stage {number}", f"stage {number}{FP8_SUFFIX}", *([f"stage {starts_from}"] if starts_from else []),
                 BASELINE, "SDPA flash", PEER]
    present = list(dict.fromkeys(r["kernel"] for r in rows))
    return [k for k in preferred if k in present] + [k for k in present if k not in preferred]


def _seqlen(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _cudnn_row(by_key: dict, shape: DecodeShape) -> dict | None:
    """SDPA cuDNN's row on ``shape``'s cache stored contiguously (SDPA has no paged cache), or None."""
    return by_key.get((BASELINE, replace(shape, paged=False).label))


def grouping_table(rows: list[dict], number: int) -> list[str]:
    """One head grouping's rows of stage ``number``: a line per (B, L, layout), GB/s per kernel, then the
    stage's ratio to cuDNN (a paged row: to cuDNN on the same cache stored contiguously), its FP8
    variant's tokens/s and speed-up over the 16-bit cache, and the stage's graph and eager times."""
    ours, fp8 = f"stage {number}", f"stage {number}{FP8_SUFFIX}"
    kernels = grouping_columns(rows, number)
    with_fp8, with_eager = fp8 in kernels, _with_eager(rows)
    header = ["B", "L", "layout", *kernels, f"{ours} vs cuDNN"]
    header += [f"{fp8} M tokens/s", "fp8 vs 16-bit tokens/s"] if with_fp8 else []
    header += [f"{ours} graph (ms)", f"{ours} eager (ms)"] if with_eager else []
    lines = ["| " + " | ".join(header) + " |", "|---:|---:|---|" + "---:|" * (len(header) - 3)]
    by_key = {(r["kernel"], r["label"]): r for r in rows}
    for shape in sorted(set(map(decode_shape, rows)), key=lambda s: (s.batch, s.seqlen_k, s.paged)):
        row = {kernel: by_key.get((kernel, shape.label)) for kernel in kernels}
        cudnn = _cudnn_row(by_key, shape)
        cells = [str(shape.batch), _seqlen(shape.seqlen_k), f"paged {shape.page_size}" if shape.paged else "contiguous"]
        cells += [_value(row[kernel], "gbps", "{:.0f}") for kernel in kernels]
        cells.append(_ratio(cudnn["ms"], row[ours]["ms"]) if cudnn and row.get(ours) else "-")
        if with_fp8:
            cells += [_value(row[fp8], "tokens_per_s", "{:,.0f}", 1e6), _value(row[fp8], "speedup_vs_fp16", "{:.2f}x")]
        if with_eager:
            cells += [_value(row.get(ours), "ms", "{:.3f}"), _value(row.get(ours), "eager_ms", "{:.3f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _shape_name(shape: DecodeShape) -> str:
    return f"B{shape.batch} {_seqlen(shape.seqlen_k)}" + (" paged" if shape.paged else "")


def _span(values: list[float], spec: str, unit: str) -> str:
    """The lowest and highest of ``values`` as "lo-hi" and the unit (one value once), or "-" for none."""
    if not values:
        return "-"
    lo, hi = spec.format(min(values)), spec.format(max(values))
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def summary_table(rows: list[dict], number: int) -> list[str]:
    """One line per head grouping, stage ``number`` measured the way its targets are stated: its ratio to
    cuDNN (the median over contiguous shapes; the lowest over all, paged against cuDNN on the contiguous
    cache), how far its paged rows trail its contiguous ones (the largest ratio gap), its share of the
    device-to-device copy bandwidth (its lowest, next to cuDNN's on that shape) and its FP8 cache's tokens/s
    over the 16-bit cache's, both from LONG_CONTEXT keys on, for one sequence and for more."""
    from statistics import median

    ours, fp8 = f"stage {number}", f"stage {number}{FP8_SUFFIX}"
    header = ["grouping", "vs cuDNN: median", "vs cuDNN: lowest", "paged behind contiguous: most",
              "copy share, B = 1: lowest", "copy share, B > 1: lowest", "fp8 speed-up, B = 1", "fp8 speed-up, B > 1"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    by_key = {(r["kernel"], r["label"]): r for r in rows}
    for h_q, h_kv in groupings_of(rows):
        mine = [r for r in rows if r["kernel"] == ours and grouping(r) == (h_q, h_kv)]
        ratios = {}  # DecodeShape -> ratio to cuDNN
        for r in mine:
            shape = decode_shape(r)
            cudnn = _cudnn_row(by_key, shape)
            if cudnn:
                ratios[shape] = cudnn["ms"] / r["ms"]
        contiguous = [ratio for shape, ratio in ratios.items() if not shape.paged]
        lowest = min(ratios, key=ratios.get, default=None)
        gaps = {shape: ratios[replace(shape, paged=False)] - ratio for shape, ratio in ratios.items()
                if shape.paged and replace(shape, paged=False) in ratios}
        widest = max(gaps, key=gaps.get, default=None)
        long = [r for r in rows if grouping(r) == (h_q, h_kv) and r["shape"]["seqlen_k"] >= LONG_CONTEXT]
        cells = [f"{h_q}/{h_kv}",
                 f"{median(contiguous):.2f}x" if contiguous else "-",
                 f"{ratios[lowest]:.2f}x ({_shape_name(lowest)})" if lowest else "-",
                 f"{max(gaps[widest], 0.0):.2f} ({_shape_name(replace(widest, paged=False))})" if widest else "-"]
        for many in (False, True):
            shares = [r for r in long if r["kernel"] == ours and "copy_fraction" in r and (r["shape"]["batch"] > 1) == many]
            low = min(shares, key=lambda r: r["copy_fraction"], default=None)
            if low is None:
                cells.append("-")
                continue
            cudnn = _cudnn_row(by_key, decode_shape(low))
            beside = f"; cuDNN {100 * cudnn['copy_fraction']:.0f}%" if cudnn and "copy_fraction" in cudnn else ""
            cells.append(f"{100 * low['copy_fraction']:.0f}% ({_shape_name(decode_shape(low))}{beside})")
        cells += [_span([r["speedup_vs_fp16"] for r in long if r["kernel"] == fp8 and "speedup_vs_fp16" in r
                         and (r["shape"]["batch"] > 1) == many], "{:.2f}", "x") for many in (False, True)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def groupings_section(rows: list[dict], number: int, images: str) -> list[str]:
    """Stage ``number``'s decode results over head groupings: what the columns mean, the plot, a table per grouping."""
    text = (f"GB/s = bytes of the K/V cache read once / time, from CUDA graph replays, one table per head grouping "
            f"(H_q query heads on H_kv KV heads). **stage {number}{FP8_SUFFIX}** reads the same cache quantized to "
            "e4m3 (`course.runtime.kv_cache.quantize_kv_cache`), half the bytes: its GB/s are of its own bytes, and its "
            "tokens/s (B x L / time) compare with the 16-bit cache's. SDPA has no paged cache: a paged row's ratio "
            "to cuDNN is against cuDNN on the same cache stored contiguously.")
    if any(r["kernel"] == PEER for r in rows):
        text += (" FA4 runs without split-KV on Hopper (its interface allows one split on SM 9.0): at a small "
                 "batch most SMs wait.")
    text += " \"-\": not measured (the bench's log says why: no such layout, a refused shape, or memory)."
    lines = [text, "", f"![Decode: GB/s against the context length, per head grouping and batch size]"
                       f"({images}/{GROUPINGS_PLOT})"]
    lines += ["", f"**Per grouping**: stage {number}'s ratio to cuDNN over the tables' shapes, the largest lead of a "
                  f"contiguous row over the paged row of the same shape, and from L = {_seqlen(LONG_CONTEXT)} on its "
                  "lowest share of "
                  "the device-to-device copy bandwidth (the copy's read + write GB/s, measured in the same run; "
                  "cuDNN's share on the same shape beside it) and the FP8 cache's speed-up in tokens/s over the "
                  "16-bit cache.", "", *summary_table(rows, number)]
    for h_q, h_kv in groupings_of(rows):
        lines += ["", f"**H_q = {h_q}, H_kv = {h_kv} ({grouping_name(h_q, h_kv)})**", "",
                  *grouping_table([r for r in rows if grouping(r) == (h_q, h_kv)], number)]
    return lines


def decode_stage_lines(decode: dict, number: int, images: str) -> list[str]:
    """Decode stage ``number``'s results on its own bench shapes (where a later stage times it too, it has more
    rows): a row per (shape, kernel), or for a stage timed on several head groupings a table per grouping."""
    rows = rows_on(_rows_of_stage(decode["rows"], number), stages.get(number).bench_shapes)
    if spans_groupings(number):
        return groupings_section(rows, number, images)
    return decode_table(rows, decode["rows"])


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
        "<!-- Generated by `python -m course.tools.results` from docs/results/bench.json. Do not edit by hand. -->",
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
                  "device-to-device copy bandwidth measured in the same run. " + decode_timing(results["decode"])]
        if rows_on(decode, stages.DECODE):
            lines += ["", "![Decode: effective K/V bandwidth of each kernel, per shape](results/bench-decode.png)"]
        for number in _stage_numbers(decode):
            lines += ["", f"### {stage_heading(number)}", "", *decode_stage_lines(results["decode"], number, "results")]
    if not prefill and not decode:
        lines += ["", "No measurements yet: run `python -m course bench --out docs/results` on a Hopper GPU."]
    return "\n".join(lines) + "\n"


def stage_md(results: dict, number: int) -> str:
    """One stage's results for its page: its rows next to the baselines (and stage 8's ablation)."""
    lines = ["<!-- Generated by `python -m course.tools.results` from docs/results/bench.json. Do not edit by hand. -->",
             "", measured_on(results["environment"]), ""]
    if stages.get(number).kind == "decode":
        lines += [decode_timing(results["decode"]), "", *decode_stage_lines(results["decode"], number, "../results")]
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
    ``stageNN.md`` per ready stage next to it (a stage without rows says so: no page keeps a table
    that no data is behind); return the text of ``results-tables.md``."""
    results_dir = Path(results_dir)
    results = json.loads((results_dir / "bench.json").read_text())
    (results_dir / BENCH_MD).write_text(bench_md(results))
    measured = measured_stages(results)
    for stage in stages.STAGES:
        if stage.ready:
            text = stage_md(results, stage.number) if stage.number in measured else not_measured_md(stage.number)
            (results_dir / stage_file(stage.number)).write_text(text)
    text = tables(results)
    (results_dir / TABLES).write_text(text)
    return text


def not_measured_md(number: int) -> str:
    return ("<!-- Generated by `python -m course.tools.results` from docs/results/bench.json. Do not edit by hand. -->"
            f"\n\nNot measured yet: bench.json has no rows of stage {number}. On a Hopper GPU, `python -m course "
            f"bench --stage {number}` times it next to the baselines and merges its rows into bench.json.\n")


def merge_into(out_dir: Path, results: dict) -> dict:
    """``results`` of a run merged into ``out_dir``'s bench.json, if it has one from the same GPU: a run
    of some stages or groupings replaces their rows and keeps every other one. Rows from another GPU
    are not mixed in: the run then replaces them (and says so)."""
    path = Path(out_dir) / "bench.json"
    if not path.exists():
        return results
    earlier = json.loads(path.read_text())
    if earlier.get("environment", {}).get("gpu") != results["environment"].get("gpu"):
        print(f"{path}: its rows come from {earlier.get('environment', {}).get('gpu')}, this run's from "
              f"{results['environment'].get('gpu')}: the earlier rows are replaced, not merged")
        return results
    return merge([earlier, results])


def stage_file(number: int) -> str:
    return f"stage{number:02d}.md"


def merged_rows(earlier: list[dict], later: list[dict]) -> list[dict]:
    """``earlier``'s rows that ``later`` did not time again, then ``later``'s: rows are keyed by shape and kernel."""
    timed = {(r["label"], r["kernel"]) for r in later}
    return [r for r in earlier if (r["label"], r["kernel"]) not in timed] + later


def in_shape_order(rows: list[dict]) -> list[dict]:
    """Rows grouped by shape (in the order shapes first appear), the stages' rows before the baselines'."""
    shape_order = {label: i for i, label in enumerate(dict.fromkeys(r["label"] for r in rows))}
    return sorted(rows, key=lambda r: (shape_order[r["label"]], r["stage"] is None, r["stage"] or 0))


def merge(runs: list[dict]) -> dict:
    """One results dict from several bench runs on the same GPU: prefill and decode rows are keyed by shape
    and kernel, and a later run's row replaces an earlier run's, so runs of a part each (`course bench
    --groupings`) add up; the environment and the decode copy bandwidth are the first run's (with every
    run's date), stage 8's ablation the last run's that has one."""
    dates = sorted({run["environment"]["date"] for run in runs if "date" in run["environment"]})
    merged = {"environment": {**runs[0]["environment"], **({"date": ", ".join(dates)} if dates else {})}, "rows": []}
    for run in runs:
        merged["rows"] = merged_rows(merged["rows"], run.get("rows", []))
        if run.get("ablation"):
            merged["ablation"] = run["ablation"]
        if run.get("decode"):
            decode = merged.setdefault("decode", {**run["decode"], "rows": []})
            decode["rows"] = merged_rows(decode["rows"], run["decode"]["rows"])
    merged["rows"] = in_shape_order(merged["rows"])
    if "decode" in merged:
        merged["decode"]["rows"] = in_shape_order(merged["decode"]["rows"])
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course.tools.results",
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
    if args.merge:  # the plots come from course.tools.bench, which draws them from the merged rows without a GPU
        print(f"the plots still show the runs before the merge: redraw them with "
              f"`{stages.COURSE_COMMAND} bench --replot --out {args.dir}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
