"""Stage 9's forced variants, timed: the tables of the engineering-notes page that ``course bench`` does not run.

    python -m course.tools.decode_variants --out docs/results   # Hopper GPU: decode-variants.json and .md
    python -m course.tools.decode_variants --render             # decode-variants.json -> the tables, on any machine
    python -m course.tools.decode_variants --only warps --out docs/results   # one section again, the rest kept

Each variant is stage 9's ``decode_attention`` with its launch plan forced (``plan=DecodePlan(...)`` or
``num_splits=n``), captured in a CUDA graph of 10 calls (``bench.capture_graph``) and timed next to SDPA's
cuDNN backend on the same inputs, in the same rounds (``bench.time_graphs``): fp16, D = 128, a contiguous
cache of B full sequences. The plan the rules choose (``choose_plan``) is marked in each row.

- Split counts: ``num_splits = n`` for a few n, and the rule's own count.
- Keys per split for short sequences: 512, 256 or 128 keys per split on 8 warps, one row tile.
- Row tiles: one tile per CTA or ``row_tiles(G, D)``, each with its automatic warps and splits, on the
  16-bit cache and on an FP8 copy of it.
- Warps: 4 or 8 warps per CTA, and 8 warps with half and twice their automatic split count.
- Tiles and warps: row tiles or one tile, each on 4 or 8 warps.

Never edit the outputs by hand.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

from course.runtime.shapes import DecodeShape
from course.tools import bench

DEFAULT_OUT = bench.DEFAULT_OUT
HEAD_DIM = 128
SPLIT_SHAPES = [(1, 4096, 32, 8), (1, 32768, 32, 8), (1, 32768, 32, 2), (1, 32768, 8, 1), (1, 131072, 8, 1),
                (8, 32768, 8, 1), (1, 131072, 64, 1)]
SPLIT_COUNTS = (4, 8, 16, 32, 64, 128, 256)
SHORT_SHAPES = [(1, 256, 8, 1), (1, 512, 8, 1), (1, 1024, 8, 1), (1, 1024, 32, 8), (1, 1024, 64, 1),
                (8, 1024, 8, 1), (1, 2048, 8, 1), (1, 2048, 32, 8), (1, 2048, 64, 1), (1, 3072, 8, 1)]
KEYS_PER_SPLIT = (512, 256, 128)
ROW_TILE_SHAPES = [(1, 32768, 64, 1), (1, 131072, 64, 1), (8, 4096, 64, 1), (8, 32768, 64, 1), (8, 65536, 64, 1),
                   (4, 131072, 64, 1), (16, 32768, 64, 1), (8, 131072, 64, 1), (64, 4096, 64, 1),
                   (64, 32768, 64, 1), (64, 131072, 64, 1), (8, 32768, 64, 2), (8, 131072, 32, 1),
                   (64, 32768, 48, 2)]
WARP_SHAPES = [(1, 4096, 8, 1), (1, 32768, 8, 1), (1, 131072, 8, 1), (1, 4096, 32, 2), (1, 32768, 32, 2),
               (1, 131072, 32, 2), (1, 4096, 64, 1), (1, 32768, 64, 1), (1, 131072, 64, 1), (8, 32768, 64, 1),
               (1, 4096, 32, 8), (1, 4096, 32, 32), (64, 4096, 32, 2), (64, 4096, 64, 1)]
TILE_WARP_SHAPES = [(8, 65536, 64, 1), (8, 131072, 64, 1), (4, 131072, 64, 1), (16, 32768, 64, 1),
                    (64, 32768, 64, 1), (64, 131072, 64, 1), (64, 4096, 64, 1), (8, 32768, 128, 2),
                    (8, 32768, 64, 2), (8, 131072, 32, 1), (64, 32768, 48, 2)]
CUDNN = "cuDNN"


def num_sms() -> int:
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def plan_args(shape: tuple, cache_dtype: str = "float16") -> tuple:
    """``choose_plan``'s arguments for (B, L, H_q, H_kv) on this GPU."""
    batch, length, heads_q, heads_kv = shape
    return batch, heads_kv, heads_q // heads_kv, length, num_sms(), HEAD_DIM, cache_dtype


def time_variants(stage, shape: tuple, variants: dict, fp8: bool = False) -> dict:
    """{name: microseconds per call} of cuDNN and of ``variants`` ({name: decode_attention keyword arguments},
    an "fp8 " name prefix reading an FP8 copy of the cache), in the same rounds."""
    from torch.nn.attention import SDPBackend

    q, k, v, seqlens, _ = bench.decode_inputs(DecodeShape(*shape, head_dim=HEAD_DIM))
    calls = {CUDNN: partial(bench.sdpa_decode(SDPBackend.CUDNN_ATTENTION), q, k, v, seqlens)}
    caches = {False: (k, v, {})}
    if fp8:
        k8, v8, k_scale, v_scale = bench.fp8_copy(k, v)
        caches[True] = (k8, v8, {"k_scale": k_scale, "v_scale": v_scale})
    for name, options in variants.items():
        kk, vv, scales = caches[name.startswith("fp8 ")]
        calls[name] = partial(stage.decode_attention, q, kk, vv, seqlens, **scales, **options)
    graphs = bench.runnable(calls, DecodeShape(*shape).label, prepare=bench.capture_graph)
    return {name: ms * 1000 for name, ms in bench.time_graphs(graphs).items()}


def timed_rows(shapes, variants_of, fp8: bool = False):
    """A section: for each shape, ``variants_of(stage, shape)`` gives (variants, the rules' choice), which
    ``time_variants`` times into a row; returns the function of ``stage`` that makes the section's rows."""
    def rows(stage) -> list[dict]:
        made = []
        for shape in shapes:
            variants, rule = variants_of(stage, shape)
            made.append({"shape": shape, "times": time_variants(stage, shape, variants, fp8), "rule": rule})
            print(made[-1], flush=True)
        return made
    return rows


def split_counts(stage, shape):
    rule = stage.choose_plan(*plan_args(shape)).num_splits
    return {f"{n}": {"num_splits": n} for n in sorted({*SPLIT_COUNTS, rule})}, f"{rule}"


def keys_per_split(stage, shape):
    plan = stage.choose_plan(*plan_args(shape))
    variants = {f"{keys}": {"plan": stage.DecodePlan(1, 8, math.ceil(shape[1] / keys))}
                for keys in KEYS_PER_SPLIT if keys <= shape[1]}
    return variants, next((name for name, options in variants.items() if options["plan"] == plan), None)


def row_tiles(stage, shape):
    variants, rules = {}, []
    for cache_dtype, prefix in (("float16", ""), ("float8_e4m3fn", "fp8 ")):
        args = plan_args(shape, cache_dtype)
        for tiles, name in ((1, "1 tile"), (stage.row_tiles(args[2], HEAD_DIM), "row tiles")):
            variants[prefix + name] = {"plan": stage.DecodePlan(tiles, stage.pick_warps(*args, tiles))}
        rules.append(prefix + ("row tiles" if stage.pick_row_tiles(*args) > 1 else "1 tile"))
    return variants, rules


def warps(stage, shape):
    """4 or 8 warps per CTA (the rules' row tiles), and 8 warps with half and twice their split count."""
    args = plan_args(shape)
    tiles = stage.pick_row_tiles(*args)
    splits = stage.auto_num_splits(*args, tiles, 8)
    plans = {"4 warps": stage.DecodePlan(tiles, 4), "8 warps": stage.DecodePlan(tiles, 8),
             "8 warps, half the splits": stage.DecodePlan(tiles, 8, max(1, splits // 2)),
             "8 warps, twice the splits": stage.DecodePlan(tiles, 8, 2 * splits)}
    return {name: {"plan": plan} for name, plan in plans.items()}, f"{stage.pick_warps(*args, tiles)} warps"


def tiles_and_warps(stage, shape):
    """Row tiles (``row_tiles(G, D)``) or one tile, each on 4 or 8 warps, with the automatic split count."""
    args = plan_args(shape)
    tiles = stage.row_tiles(args[2], HEAD_DIM)
    plans = {"tiles, 4 warps": stage.DecodePlan(tiles, 4), "tiles, 8 warps": stage.DecodePlan(tiles, 8),
             "1 tile, 8 warps": stage.DecodePlan(1, 8), "1 tile, 4 warps": stage.DecodePlan(1, 4)}
    chosen = stage.choose_plan(*args)
    rule = next(name for name, plan in plans.items() if (plan.row_tiles, plan.warps) == (chosen.row_tiles, chosen.warps))
    return {name: {"plan": plan} for name, plan in plans.items()}, rule


# Each section's variant columns; the split counts' rule gets one column of its own, whatever count it picked.
COLUMNS = {"split counts": [f"{n}" for n in SPLIT_COUNTS] + ["rule"], "keys per split": [f"{k}" for k in KEYS_PER_SPLIT],
           "row tiles": ["1 tile", "row tiles", "fp8 1 tile", "fp8 row tiles"],
           "warps": ["4 warps", "8 warps", "8 warps, half the splits", "8 warps, twice the splits"],
           "tiles and warps": ["tiles, 4 warps", "tiles, 8 warps", "1 tile, 8 warps", "1 tile, 4 warps"]}
SECTIONS = {"split counts": timed_rows(SPLIT_SHAPES, split_counts),
            "keys per split": timed_rows(SHORT_SHAPES, keys_per_split),
            "row tiles": timed_rows(ROW_TILE_SHAPES, row_tiles, fp8=True),
            "warps": timed_rows(WARP_SHAPES, warps), "tiles and warps": timed_rows(TILE_WARP_SHAPES, tiles_and_warps)}


def _cell(row: dict, name: str) -> str:
    if name not in row["times"]:
        return "-"
    rules = row["rule"] if isinstance(row["rule"], list) else [row["rule"]]
    text = f"{row['times'][name]:.1f}"
    return f"**{text}**" if name in rules else text


def render_section(results: dict, section: str) -> str:
    """One section's table: B, L, H_q/H_kv, cuDNN, then each variant (the rule's choice in bold)."""
    rows = results.get(section, [])
    names = COLUMNS[section]
    header = {"split counts": lambda n: n if n == "rule" else f"{n} splits",
              "keys per split": lambda n: f"{n} keys per split",
              "row tiles": lambda n: n.replace("fp8 ", "") + (", FP8" if n.startswith("fp8 ") else "")
              }.get(section, lambda n: n)
    env = results.get("environment", {})
    lines = ["<!-- generated by python -m course.tools.decode_variants; do not edit -->",
             f"GPU: {env.get('gpu', '?')}; microseconds per call in CUDA graphs of {bench.GRAPH_CALLS} calls, "
             "median of rounds; fp16, D = 128, contiguous cache; the rules' choice in bold.", "",
             "| B, L, H_q/H_kv | cuDNN | " + " | ".join(header(n) for n in names) + " |",
             "|---|" + "---:|" * (len(names) + 1)]
    for row in rows:
        batch, length, heads_q, heads_kv = row["shape"]
        cells = [f"{row['times'][CUDNN]:.1f}" if CUDNN in row["times"] else "-"]
        for name in names:
            if name == "rule":
                rule = row["rule"]
                cells.append(f"{rule}: {row['times'][rule]:.1f}" if rule in row["times"] else "-")
            else:
                cells.append(_cell(row, name))
        lines.append(f"| {batch}, {length}, {heads_q}/{heads_kv} | " + " | ".join(cells) + " |")
    if not rows:
        lines.append("| Not measured yet: run the command above on a Hopper GPU. |" + " |" * (len(names) + 1))
    return "\n".join(lines) + "\n"


def file_name(section: str) -> str:
    return "decode-variants-" + section.replace(" ", "-") + ".md"


def write_tables(results: dict, out_dir: Path) -> None:
    for section in SECTIONS:
        (out_dir / file_name(section)).write_text(render_section(results, section))


def run(out_dir: Path = DEFAULT_OUT, only: str | None = None) -> dict:
    """Every section, or (``only``) one section timed again into the existing decode-variants.json."""
    return bench.run_stage_sections(out_dir, "decode-variants.json", {name: (9, fn) for name, fn in SECTIONS.items()},
                                    write_tables, only)


def main(argv=None) -> None:
    bench.sections_command(argv, __doc__.splitlines()[0], "decode-variants.json", SECTIONS, run, write_tables)


if __name__ == "__main__":
    main()
