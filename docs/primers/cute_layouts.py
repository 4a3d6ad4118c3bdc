"""The examples of the CuTe primer (docs/primers/cute.md), runnable on any machine.

    python docs/primers/cute_layouts.py

Layout algebra happens while the DSL traces a ``@cute.jit`` function, so these
examples run on a CPU: Python's ``print`` inside a jit function prints at trace
time, with every static shape, stride and coordinate already known. Nothing is
launched. The page shows this file's sections and what they print (the
``.txt`` next to it, which a test compares with a fresh run).
"""

import os
import sys
from pathlib import Path

# Build sm_90a objects (the WGMMA tiled MMA) on a machine without a GPU. This
# is only for tracing; the course's cross-compiles pass --gpu-arch instead.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# The repository root, for solutions/:
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.tensor_utils import LayoutEnum

from solutions.stage01_single_tile import acc_layout_as_operand_a, rows_cols_view


_open_section = []


def section(name=None):
    """Mark where an example's output starts (and the previous one ends)."""
    if _open_section:
        print(f"--8<-- [end:{_open_section.pop()}]")
    if name:
        print(f"--8<-- [start:{name}]")
        _open_section.append(name)


def offsets(layout, coords):
    return ", ".join(f"{c} -> {layout(c)}" for c in coords)


@cute.jit
def examples():
    section("shape_stride")
    # --8<-- [start:shape_stride]
    col_major = cute.make_layout((4, 8))        # stride (1, 4) by default
    row_major = cute.make_layout((4, 8), stride=(8, 1))
    print("col_major:", col_major, "   row_major:", row_major)
    print("(1, 2):", col_major((1, 2)), "in col_major,",
          row_major((1, 2)), "in row_major")
    print("1-D index 9 is coordinate", cute.idx2crd(9, col_major.shape),
          "of the (4, 8) shape")
    # --8<-- [end:shape_stride]

    section("hierarchical")
    # --8<-- [start:hierarchical]
    # 8 x 8 as 4 x 4 blocks: column-major inside a block,
    # and the blocks themselves column-major.
    blocked = cute.make_layout(((4, 2), (4, 2)), stride=((1, 16), (4, 32)))
    print("blocked:", blocked, " size", cute.size(blocked),
          " rank", cute.rank(blocked), " depth", cute.depth(blocked))
    print(offsets(blocked, [(0, 0), (3, 3), (4, 0), (0, 4), (5, 2)]))
    print("row 5 as a hierarchical coordinate:",
          cute.idx2crd(5, blocked.shape[0]))
    print("the same element, two ways:",
          blocked((5, 2)), blocked(((1, 1), (2, 0))))
    # --8<-- [end:hierarchical]

    section("composition")
    # --8<-- [start:composition]
    a = cute.make_layout((4, 8), stride=(8, 1))   # row-major 4 x 8
    b = cute.make_layout((8, 4), stride=(4, 1))   # picks elements of a, in order
    a_t = cute.composition(a, b)                  # a_t(i, j) = a(b(i, j))
    print("a o b:", a_t)
    same = all(a_t((i, j)) == a((j, i)) for i in range(8) for j in range(4))
    print("a_t(i, j) == a(j, i):", same)
    # --8<-- [end:composition]

    section("tiling")
    # --8<-- [start:tiling]
    # Element (i, j) of an identity tensor holds its own coordinate (i, j).
    coords = cute.make_identity_tensor((8, 12))
    # The 4 x 4 tile in tile-row 1, tile-column 2:
    tile = cute.local_tile(coords, (4, 4), (1, 2))
    print("tile:", tile)
    print("tile[0, 0] =", tile[0, 0], "  tile[3, 3] =", tile[3, 3])
    print("zipped_divide:", cute.zipped_divide(cute.make_layout((8, 12)), (4, 4)))
    # --8<-- [end:tiling]

    section("slicing")
    # --8<-- [start:slicing]
    # [B, S, H, D] = [2, 300, 8, 64], contiguous
    bshd = cute.make_layout((2, 300, 8, 64), stride=(153600, 512, 64, 1))
    rows_dim = cute.select(bshd, mode=[1, 3, 2, 0])        # (S, D, H, B)
    one_head = cute.slice_(rows_dim, (None, None, 3, 1))  # None keeps a mode
    print("(S, D, H, B):", rows_dim)
    print("head 3, batch 1:", one_head)
    # --8<-- [end:slicing]

    section("partition")
    # --8<-- [start:partition]
    # Stage 1's first GEMM, S = Q K^T: two warpgroups stacked along M,
    # a 64 x 128 WGMMA each, fp16 in, fp32 accumulator.
    qk_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.Float16, cutlass.Float16,
        OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, (2, 1, 1), (64, 128),
    )
    cS = cute.make_identity_tensor((128, 128))  # (row, key) of each element of S
    cQ = cute.make_identity_tensor((128, 64))   # a Q tile: 128 rows, D = 64
    cK = cute.make_identity_tensor((128, 64))   # a K tile: 128 keys, D = 64
    for tidx in (0, 1, 4, 128):
        tScS = qk_mma.get_slice(tidx).partition_C(cS)
        first = ", ".join(str(tScS[i]) for i in range(4))
        print(f"thread {tidx:3}: shape", tScS.shape, " holds", first)
    thr = qk_mma.get_slice(0)
    print("partition_A of Q:", thr.partition_A(cQ).shape,
          "  partition_B of K:", thr.partition_B(cK).shape)
    # --8<-- [end:partition]

    section("fragments")
    # --8<-- [start:fragments]
    # Thread 0's registers of S, and the same registers as (rows, cols):
    acc_S = thr.make_fragment_C(thr.partition_shape_C((128, 128)))
    print("acc_S:", acc_S.layout, " (", cute.size(acc_S), "fp32 registers )")
    s = rows_cols_view(thr.partition_C(cS))
    print("rows x cols:", s.shape)
    print("row 0:", ", ".join(str(s[0, c]) for c in range(6)), "...")
    print("row 1:", ", ".join(str(s[1, c]) for c in range(6)), "...")
    print("as the A operand of P V:", acc_layout_as_operand_a(acc_S.layout))
    # --8<-- [end:fragments]

    section("swizzle")
    # --8<-- [start:swizzle]
    sQ_layout = sm90_utils.make_smem_layout_a(
        LayoutEnum.ROW_MAJOR, (128, 128, 64), cutlass.Float16, 1)
    print("Q in shared memory:", sQ_layout)
    # The swizzle acts on byte addresses: 8 rows of 128 bytes, 16-byte chunks.
    swizzle = cute.make_swizzle(3, 4, 3)
    chunks = cute.make_layout((8, 8), stride=(128, 16))
    swizzled = cute.make_composed_layout(swizzle, 0, chunks)
    for row in cutlass.range_constexpr(8):  # unrolled: row is a Python int
        slots = " ".join(str(swizzled((row, c)) % 128 // 16) for c in range(8))
        print(f"row {row}: chunk c is stored in slot", slots)
    # --8<-- [end:swizzle]

    section("identity")
    # --8<-- [start:identity]
    seqlen_k = 100  # keys 100..127 of the 128-key tile do not exist
    n_cols = cute.size(s, mode=[1])
    masked = [c for c in range(n_cols) if s[0, c][1] >= seqlen_k]
    print("thread 0 masks", len(masked), "of its", n_cols, "columns, keys",
          ", ".join(str(s[0, c][1]) for c in masked))
    # --8<-- [end:identity]
    section()


if __name__ == "__main__":
    examples()
