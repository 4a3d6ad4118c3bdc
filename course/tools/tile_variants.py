"""Stage 8's tilings per head dim, forced and timed: the table of its page's "what decides the tiles".

    python -m course.tools.tile_variants --out docs/results   # Hopper GPU: stage08-tilings.json and the tables
    python -m course.tools.tile_variants --only wide --out docs/results   # the wide head dims' section again
    python -m course.tools.tile_variants --only d128 --out docs/results/h200   # D = 128's wider tiles
    python -m course.tools.tile_variants --render             # stage08-tilings.json -> the tables, on any machine

Each variant is stage 8's kernel compiled with a forced ``Tiles`` (``Attention.forced_tiles``: MMA
warpgroups x keys per KV tile, whether P V reads P from shared memory, and whether O takes Q's bytes) and timed by
``bench.time_prefill_shape`` next to FlashAttention-4 and SDPA's cuDNN backend on the same inputs, in the
same rounds: fp16, causal and not, at the head dims where more than one tiling fits. Each table gives each
variant's TFLOP/s as a share of FA4's, the tiling ``TILES`` chooses in bold. Never edit the outputs by hand.
"""

from __future__ import annotations

from functools import cache, partial
from pathlib import Path

from course.runtime.shapes import PrefillShape
from course.runtime.validation import distinct_head_dim_v
from course.tools import bench

DEFAULT_OUT = bench.DEFAULT_OUT
JSON = "stage08-tilings.json"
P_IN_SMEM, O_IN_Q = "P in smem", "O in Q"  # Tiles.p_in_smem, Tiles.o_in_q
# (MMA warpgroups, keys per KV tile, *options) per (D, D_v), each within shared memory
VARIANTS = {
    "tilings": {
        (64, 64): [(2, 128), (2, 160), (2, 192), (3, 80), (3, 96), (3, 112), (3, 128)],
        (80, 80): [(2, 128), (2, 160), (3, 80), (3, 128, P_IN_SMEM), (3, 144, P_IN_SMEM), (3, 160, P_IN_SMEM)],
        (96, 96): [(2, 128), (2, 160), (3, 80), (3, 96), (3, 128, P_IN_SMEM), (3, 144, P_IN_SMEM, O_IN_Q),
                   (3, 160, P_IN_SMEM, O_IN_Q)],
    },
    "d128 tilings": {  # 128 keys against FlashAttention-3's 176 without a mask, the wider ones with O in Q
        (128, 128): [(2, 128), (2, 128, O_IN_Q), (2, 160, O_IN_Q), (2, 176, O_IN_Q)],
    },
    "wide head dims": {  # the widest tile with O buffers of its own, then narrower and wider ones with O in Q
        (192, 128): [(2, 112), (2, 96, O_IN_Q), (2, 128, O_IN_Q)],
        (192, 192): [(2, 80), (2, 96, O_IN_Q), (2, 112, O_IN_Q)],
        (256, 256): [(2, 48), (2, 64, O_IN_Q), (2, 80, O_IN_Q)],
    },
}
TABLES = {"tilings": "stage08-tilings.md", "d128 tilings": "stage08-tilings-128.md",
          "wide head dims": "stage08-tilings-wide.md"}


def section_shapes(section: str) -> list[PrefillShape]:
    """4k and 8k tokens, causal and not: 16 heads (32 at D = 64 and 8k) below D = 192; from there H x D about 2048,
    the FA3 paper's sweep (10 heads at D = 192, 8 at 256)."""
    def heads(d: int, heads_at_64: int) -> int:
        return heads_at_64 if d == 64 else 16 if d < 192 else 2048 // d

    shapes = [PrefillShape(batch, heads(d, heads_at_64), seqlen, seqlen, d, causal=causal,
                           head_dim_v=distinct_head_dim_v(d, d_v))
              for d, d_v in VARIANTS[section] for causal in (False, True)
              for batch, heads_at_64, seqlen in ((4, 16, 4096), (2, 32, 8192))]
    if section == "tilings":  # short sequences: the last 192-row tile is mostly empty
        shapes.append(PrefillShape(16, 32, 1024, 1024, 64, causal=True))
    return shapes


PEERS = ("FA4", "SDPA cuDNN")


def variant_name(tiling) -> str:
    return ", ".join((f"{tiling[0]} x {tiling[1]}", *tiling[2:]))


def tiling_of(tiles) -> tuple:
    """A stage's ``Tiles`` as a tiling of VARIANTS."""
    return (tiles.mma_warpgroups, tiles.tile_n, *((P_IN_SMEM,) if tiles.p_in_smem else ()),
            *((O_IN_Q,) if tiles.o_in_q else ()))


def tiles_of(stage, tiling):
    """``tiling`` as the stage's ``Tiles``."""
    return stage.Tiles(tiling[0], tiling[1], o_in_q=O_IN_Q in tiling[2:], p_in_smem=P_IN_SMEM in tiling[2:])


@cache
def variant(stage, tiling: tuple):
    """fn(q, k, v, **features): stage 8 compiled with ``tiling`` as its ``Tiles`` (one kernel class per tiling, so
    each configuration compiles once)."""
    from course.runtime import prefill

    tiles = tiles_of(stage, tiling)
    suffix = ("p" if tiles.p_in_smem else "") + ("q" if tiles.o_in_q else "")
    kernel_class = type(f"Attention{tiling[0]}x{tiling[1]}{suffix}", (stage.Attention,), {"forced_tiles": tiles})
    return partial(prefill.attention, stage.STAGE, kernel_class)


def timed_rows(stage, section: str) -> list[dict]:
    """A row per shape: its label, head dims and {kernel: TFLOP/s}, the variants and the peers in the same rounds."""
    rows = []
    for shape in section_shapes(section):
        dims = (shape.head_dim, shape.dv)
        kernels = {variant_name(t): (8, variant(stage, t)) for t in VARIANTS[section][dims]}
        kernels.update({name: (None, fn) for name, fn in bench.baselines().items() if name in PEERS})
        timed = bench.time_prefill_shape(shape, kernels, repeats=50)
        rows.append({"label": shape.label, "head_dim": dims[0], "head_dim_v": dims[1],
                     "tflops": {row["kernel"]: row["tflops"] for row in timed}})
    return rows


def _share(row: dict, name: str, chosen: str) -> str:
    tflops, fa4 = row["tflops"], row["tflops"].get("FA4")
    if name not in tflops or not fa4:
        return "-"
    text = f"{tflops[name] / fa4:.2f}"
    return f"**{text}**" if name == chosen else text


def table(results: dict, section: str = "tilings") -> str:
    from course.runtime import stages

    tiles = stages.get(8).load("solutions").TILES
    names = list(dict.fromkeys(variant_name(t) for variants in VARIANTS[section].values() for t in variants))
    if results.get(section):  # a run of some head dims only (or from before a tiling existed): its columns
        names = [name for name in names if any(name in row["tflops"] for row in results[section])]
    env = results.get("environment", {})
    lines = ["<!-- generated by python -m course.tools.tile_variants; do not edit -->",
             f"GPU: {env.get('gpu', '?')}; stage 8 with each tiling (MMA warpgroups x keys per KV tile): TFLOP/s "
             "as a share of FlashAttention-4's in the same rounds; fp16; `TILES`'s choice in bold.", "",
             "| shape | FA4 TFLOP/s | cuDNN | " + " | ".join(names) + " |",
             "|---|" + "---:|" * (len(names) + 2)]
    for row in results.get(section, []):
        tiling = tiles[row["head_dim"], row.get("head_dim_v", row["head_dim"])]
        chosen = variant_name(tiling_of(tiling))
        fa4 = row["tflops"].get("FA4")
        cells = [f"{fa4:.0f}" if fa4 else "-", *(_share(row, name, chosen) for name in ("SDPA cuDNN", *names))]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    if not results.get(section):
        lines.append("| Not measured yet: run the command above on a Hopper GPU. |" + " |" * (len(names) + 2))
    return "\n".join(lines) + "\n"


def write_tables(results: dict, out_dir: Path) -> None:
    """The tables of the sections in ``results`` (another GPU's folder may hold only some of them)."""
    for section, name in TABLES.items():
        if section in results:
            (Path(out_dir) / name).write_text(table(results, section))


SECTIONS = {section: partial(timed_rows, section=section) for section in VARIANTS}


def run(out_dir: Path = DEFAULT_OUT, only: str | None = None) -> dict:
    return bench.run_stage_sections(out_dir, JSON, {name: (8, fn) for name, fn in SECTIONS.items()}, write_tables, only)


def main(argv=None) -> None:
    bench.sections_command(argv, __doc__.splitlines()[0], JSON, SECTIONS, run, write_tables)


if __name__ == "__main__":
    main()
