"""Stage 8: FA3-class prefill.

Compared with stage 6, this stage adds the scheduling that makes FlashAttention-3
fast on Hopper, because stage 6 keeps the tensor cores busy only part of the
time: each MMA warpgroup issues its two GEMMs, waits for them, and only then
runs its softmax, and while it exponentiates (the MUFU unit does 16 exp2 per
cycle per SM: a 128 x 128 tile of them takes about half as long as the tile's
two GEMMs) its share of the tensor cores has nothing to do. Five steps, each
a compile-time level (``Step``) so that the benchmark measures each one:

1. Ping-pong (``Step.PINGPONG``): the MMA warpgroups (three below D = 128)
   take turns at the tensor cores through a named barrier each, so one
   warpgroup's softmax runs while another's GEMMs run.
2. Intra-warpgroup overlap (``Step.OVERLAP``): each iteration issues
   S = Q K^T(j) and O += P V(j-1), waits for Q K^T(j) only
   (``wait_group(1)``), so that softmax(j) may run while P V(j-1) is still on
   the tensor cores (how much of it does is ptxas's choice: ``course sass 8``);
   P's registers are rewritten only after ``wait_group(0)``. The producer
   loads V one tile behind K to match.
3. The softmax tightened (``Step.SOFTMAX``): row maxima and sums over four
   independent chains instead of one, and the first tile without a
   correction; O is rescaled after the P V wait, outside the softmax.
4. The epilogue (``Step.EPILOGUE``): each warpgroup writes its 64 rows of O to
   a shared-memory buffer of its own with stmatrix, and one of its threads
   stores them with TMA; nobody waits for the store until that buffer is
   needed again, and the MMA warpgroups never wait for each other.
5. Tile scheduling (``Step.PERSISTENT``): the (Q tile, head, batch) tiles in
   one order that keeps the K and V of a group of heads in L2, the KV tiles of
   each visited last first. Without a causal mask one CTA per SM loops over
   its tiles, and the producer loads the next tile's K and Q while the
   consumers finish; under a causal mask each tile is a CTA of its own,
   longest first.

Every feature of stage 6 is kept (masks with tile skipping, both kinds of
sink, LSE, GQA, fp16/bf16, any lengths), and ``merge_attention_states`` is
stage 6's, unchanged. The head dims grow to those models use: 64, 80, 96, 128,
192, 256 and (192, 128) for (Q and K, V); ``TILES`` picks the KV tile of
each, as wide as shared memory allows (from D = 192 up with O's buffers in
Q's bytes, so the producer loads a CTA's next Q after its O stores) and, at
D = 80 and 96, as registers allow once P V reads P from shared memory.

Run it:
    python -m course check 8 --impl solutions    # this stage's tests
    python -m solutions.stage08_fa3_prefill      # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from course.runtime import launch, prefill

from .stage06_lse import (  # noqa: F401 (stage 6's merge)
    MERGE_CONFIGS,
    MERGE_HEAD_DIMS,
    cross_compile_merge,
    merge_attention_states,
)

STAGE = 8
KV_STAGES = 2  # buffers in each of the K and V rings
SMEM_BYTES = 227 * 1024  # the most shared memory one CTA may have on an H100


# --8<-- [start:tiles]
@dataclass(frozen=True)
class Tiles:
    """How this stage tiles one (D_qk, D_v): the MMA warpgroups (64 query rows each) and the keys per KV tile."""

    mma_warpgroups: int
    tile_n: int
    # O's buffers are the Q tile's bytes, each warpgroup's in its own 64 rows: no Q K^T reads them after the
    # tile's last one, and the producer loads the next Q once the O stores have read them (wide head dims).
    o_in_q: bool = False
    # P V reads P from shared memory instead of registers: P(j - 1) then holds no register while softmax(j)
    # runs, which leaves room for wider KV tiles at three warpgroups (SharedP).
    p_in_smem: bool = False


# By head dims (D_qk, D_v), chosen by measurement (course.tools.tile_variants; the page's "what decides the
# tiles"). Shared memory bounds tile_n: Q, the K and V rings and the O buffers must fit (shared_bytes), so the
# wider the rows, the fewer keys per tile. Registers bound the warpgroups: three (192-row Q tiles, FA3's choice
# below D = 128) have 160 each (REGISTERS), enough for S, P and O of a 128-key tile at D = 64; at D = 80 and 96
# a 128-key tile fits only with P in shared memory.
TILES = {
    (64, 64): Tiles(3, 128),
    (80, 80): Tiles(3, 128, p_in_smem=True),
    (96, 96): Tiles(3, 128, p_in_smem=True),
    (128, 128): Tiles(2, 128),
    (192, 128): Tiles(2, 128, o_in_q=True),
    (192, 192): Tiles(2, 112, o_in_q=True),
    (256, 256): Tiles(2, 80, o_in_q=True),
}
HEAD_DIMS = tuple(TILES)
# setmaxnreg per warpgroup count: 128 * producer + 128 * warpgroups * mma <= 64K registers.
REGISTERS = {2: (24, 240), 3: (24, 160)}  # (producer, MMA)
# Local memory a configuration may use. With three warpgroups ptxas keeps a few scalars (tile coordinates, mask
# bounds, stage 10's sequence offsets) in local memory, L1 hits reloaded a few times per tile, and how many moves
# with any reordering of the code. The same happens with two where O is 192 or 256 columns wide (96 or 128 of the
# 240 registers): a few values only the epilogue reads (its warpgroup's O buffer and rows), reloaded once per tile,
# and in stage 10's paged gather a few of the loop's scalars, reloaded once per KV tile.
# The same code compiles with two warpgroups at D = 128, where nothing may spill: that is where a loop that keeps
# values live it does not need shows.
SPILL_BYTES_ALLOWED = {2: 0, 3: 128}
WIDE_O_SPILL_BYTES_ALLOWED = 64  # two warpgroups, D_v >= 192


def spill_bytes_allowed(config: prefill.KernelConfig) -> int:
    if TILES[config.head_dim, config.dv].mma_warpgroups == 2 and config.dv >= 192:
        return WIDE_O_SPILL_BYTES_ALLOWED
    return SPILL_BYTES_ALLOWED[TILES[config.head_dim, config.dv].mma_warpgroups]


def shared_bytes(head_dim: int, head_dim_v: int, tiles: Tiles, dtype_bytes: int = 2) -> int:
    """The kernel's buffers: the Q tile, KV_STAGES K and V tiles, one 64-row O buffer per MMA warpgroup
    (none with ``o_in_q``: O takes Q's bytes) and, with ``p_in_smem``, P's tile."""
    tile_m = 64 * tiles.mma_warpgroups
    o_elements = 0 if tiles.o_in_q else tile_m * head_dim_v
    p_elements = tile_m * tiles.tile_n if tiles.p_in_smem else 0
    return (tile_m * head_dim + KV_STAGES * tiles.tile_n * (head_dim + head_dim_v) + o_elements
            + p_elements) * dtype_bytes
# --8<-- [end:tiles]
SCHEDULER_THREADS = 256  # a ping-pong barrier: the MMA warpgroup that waits and the one that passes
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
L2_BYTES = 50 * 1024 * 1024  # H100: the K and V of a group of heads stay in L2 while its Q tiles run


# --8<-- [start:steps]
class Step(IntEnum):
    """The steps of this stage, in the order the docs page and the ablation add them."""

    PINGPONG = 1
    OVERLAP = 2
    SOFTMAX = 3
    EPILOGUE = 4
    PERSISTENT = 5


class NamedBarrier(IntEnum):
    """Ids of the named barriers (bar.sync / bar.arrive); 0 is the CTA-wide barrier.

    The K, V and Q pipelines synchronize on mbarriers, not on these. The MMA
    warpgroups are numbered from 0 (``mma_wg``; the producer warpgroup is not
    one of them), the names below from 1: a ``*_WG1`` id belongs to MMA
    warpgroup 0, and MMA warpgroup ``mma_wg`` uses that id + ``mma_wg``.
    """

    EPILOGUE = 1       # all MMA threads around the shared O tile (before Step.EPILOGUE)
    EPILOGUE_WG1 = 2   # MMA warpgroup 0 around its own O buffer (Step.EPILOGUE); + mma_wg for the others
    SCHEDULER_WG1 = 5  # ping-pong: MMA warpgroup 0 may issue its GEMMs; + mma_wg for the others
# --8<-- [end:steps]


def acc_layout_as_rows_cols(acc_layout: cute.Layout) -> cute.Layout:
    """View a WGMMA accumulator fragment as (rows, cols) of this thread's values.

    A thread's fragment of an (M, N) accumulator has shape ((2, 2, N/8), MMA_M,
    MMA_N): 2 adjacent columns, 2 rows 8 apart, N/8 column groups. Regrouping
    the modes gives ((2, MMA_M), (2, N/8, MMA_N)) so that row r of the view is
    one query row and its columns are that row's keys held by this thread.
    """
    col_major = cute.make_layout(acc_layout.shape)
    rows_cols = cute.make_layout(
        (
            (col_major.shape[0][1], col_major.shape[1]),
            (col_major.shape[0][0], col_major.shape[0][2], col_major.shape[2]),
        ),
        stride=(
            (col_major.stride[0][1], col_major.stride[1]),
            (col_major.stride[0][0], col_major.stride[0][2], col_major.stride[2]),
        ),
    )
    return cute.composition(acc_layout, rows_cols)


def rows_cols_view(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(t.iterator, acc_layout_as_rows_cols(t.layout))


def acc_layout_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Reinterpret the S accumulator fragment as the A-operand fragment of P V.

    For 16-bit inputs the C fragment of S = Q K^T and the A fragment of
    O = P V hold the same (row, key) pairs in the same thread: only the
    grouping differs. ((2, 2, N/8), MMA_M, MMA_N) becomes ((2, 2, 2), MMA_M,
    (N/16, MMA_N)): every 16 keys form one k-block of the second GEMM.
    """
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )


# --8<-- [start:shared_p]
class SharedP:
    """P when the P V WGMMA reads it from shared memory (``Tiles.p_in_smem``): ``store`` takes the place of
    ``rP.store``, so the loops read the same either way.

    It keeps the 16-bit P in registers, writes this thread's values to its rows of ``sP`` (P has the
    Q tile's rows) with stmatrix, and makes them visible to the WGMMA, which reads shared memory
    through the async proxy (a proxy fence). In practice each warp's share of a 64-row WGMMA reads
    only the 16 rows of A that warp wrote (PTX does not promise it; FA3 and FA4 rely on it), so a warp
    sync is all the ordering the warps need, not a warpgroup barrier. The registers are dead once
    written: softmax(j + 1) runs with no P held in them.
    """

    def __init__(self, registers: cute.Tensor, store_atom: cute.CopyAtom, thr_store, tPsP: cute.Tensor):
        self.registers, self.store_atom, self.thr_store, self.tPsP = registers, store_atom, thr_store, tPsP
        self.element_type = registers.element_type

    # The loops call rP.store under runtime branches and loops, so the DSL carries rP through them as it
    # does a tensor: by its two tensors' values. The copy atom and the thread's slice of it stay as they
    # are, which holds because store only retiles with the slice (a partition inside store would not).
    def __extract_mlir_values__(self):
        return [*cutlass.extract_mlir_values(self.registers), *cutlass.extract_mlir_values(self.tPsP)]

    def __new_from_mlir_values__(self, values):
        n = len(cutlass.extract_mlir_values(self.registers))
        return SharedP(cutlass.new_from_mlir_values(self.registers, values[:n]), self.store_atom, self.thr_store,
                       cutlass.new_from_mlir_values(self.tPsP, values[n:]))

    @cute.jit
    def store(self, p: cute.TensorSSA):
        self.registers.store(p)
        cute.copy(self.store_atom, self.thr_store.retile(self.registers), self.tPsP)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
# --8<-- [end:shared_p]


@cute.jit
def warpgroup_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                   zero_init: cutlass.Constexpr = True):
    """acc = A B (or acc += A B without ``zero_init``), as one group of asynchronous WGMMAs.

    With ``zero_init`` the first k-block runs with ACCUMULATE off, which
    zero-initializes acc. The caller waits with ``warpgroup.wait_group(0)``
    before reading acc.
    """
    # [exercise 1] acc = A B (acc += A B when zero_init is False) over every k-block of tCrA/tCrB,
    #   issued as ONE committed group of asynchronous WGMMAs. With zero_init, whatever acc held is
    #   discarded (no zero-fill needed); register writes made before the call must be ordered
    #   before the MMAs read them; nothing waits here (the caller does). tiled_mma is shared by
    #   every call: leave its fields alone. (stage 1 page: Warpgroups and WGMMA)
    mma_atom = cute.make_mma_atom(tiled_mma.op)  # a private atom: its ACCUMULATE field is ours to set
    warpgroup.fence()
    for k_block in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init or k_block != 0)
        cute.gemm(mma_atom, acc, tCrA[None, None, k_block], tCrB[None, None, k_block], acc)
    warpgroup.commit_group()
    # [/exercise]


# --8<-- [start:register_counts]
@cute.jit
def registers_before(columns: cutlass.Int32):
    """How many of a thread's registers in an accumulator row hold a column below ``columns``.

    Columns are counted from the thread's first one. A WGMMA accumulator gives each thread two
    adjacent columns of every eight: offsets 0, 1, 8, 9, 16, 17, ... in register order.
    """
    columns = cutlass.max(columns, 0)
    return columns // 8 * 2 + cutlass.min(columns % 8, 2)


@cute.jit
def low_bits(count: cutlass.Int32, chunk: cutlass.Constexpr):
    """The bits of registers [32 chunk, 32 chunk + 32) that lie below register ``count``: bit i for 32 chunk + i.

    A 32-bit shift by 32 is undefined, so the shift stops at 31 and an empty mask is a select.
    """
    n = count - 32 * chunk
    bits = cutlass.Uint32(0xFFFFFFFF) >> cutlass.Uint32(cutlass.min(cutlass.max(32 - n, 0), 31))
    return cutlass.Uint32(cutlass.select_(n > 0, bits, cutlass.Uint32(0)))
# --8<-- [end:register_counts]


class WindowMask:
    """Which keys the rows of this CTA's Q tile may see (bottom-right aligned, docs/contract.md).

    With offset = S_k - S_q, row i sees key j iff j < S_k and
    i + offset - left <= j <= i + offset + right. An unbounded side (-1) is
    compiled out through ``has_left`` / ``has_right``.
    """

    def __init__(self, m_block, seqlen_q, seqlen_k, left, right, num_sink_tokens, config, tile_m: int, tile_n: int):
        self.tile_m = tile_m  # query rows per tile (64 per MMA warpgroup)
        self.tile_n = tile_n  # keys per KV tile (TILES)
        self.row0 = m_block * tile_m
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.offset = seqlen_k - seqlen_q
        self.left, self.right = left, right
        self.num_sink_tokens = num_sink_tokens  # keys below it ignore the left bound
        self.has_left, self.has_right = config.has_left, config.has_right
        self.has_sink_tokens = config.has_sink_tokens

    @cute.jit
    def kv_block_range(self):
        """[n_block_min, n_block_max): the KV tiles with a visible key for some row of this tile."""
        # [exercise 4] n_block_max and n_block_min bound the half-open range of KV tiles that
        #   holds every key visible to some row of this Q tile (its rows stop at S_q in the tail
        #   tile), from the first row's first visible key to the last row's last. Too long is
        #   correct but slow; too short drops keys. Both lie in [0, number of KV tiles],
        #   n_block_min <= n_block_max (an empty range is fine), and an unbounded side compiles to
        #   no code. Int32 division truncates toward zero.
        #   (stage 4 page: Skipping tiles: the block range)
        n_block_max = (self.seqlen_k + self.tile_n - 1) // self.tile_n
        n_block_min = cutlass.Int32(0)
        if cutlass.const_expr(self.has_right):
            last_row = cutlass.min(self.row0 + self.tile_m, self.seqlen_q) - 1
            key_end = cutlass.max(cutlass.min(last_row + self.offset + self.right + 1, self.seqlen_k), 0)
            n_block_max = (key_end + self.tile_n - 1) // self.tile_n
        if cutlass.const_expr(self.has_left):
            key_start = cutlass.max(self.row0 + self.offset - self.left, 0)
            n_block_min = cutlass.min(key_start // self.tile_n, n_block_max)
        # [/exercise]
        return n_block_min, n_block_max

    @cute.jit
    def sink_block_count(self, n_block_min: cutlass.Int32):
        """How many tiles of sink tokens lie below the window's range (visited first)."""
        count = cutlass.Int32(0)
        if cutlass.const_expr(self.has_sink_tokens):
            # [exercise 5] Set count to the number of KV tiles that hold a sink token (key <
            #   num_sink_tokens) and lie below n_block_min: the tiles the loop visits before the
            #   window's range. A tile already in the range must not be visited twice.
            #   (stage 5 page: Sink tokens: visible despite the window)
            count = cutlass.min((self.num_sink_tokens + self.tile_n - 1) // self.tile_n, n_block_min)
            # [/exercise]
        return count

    # --8<-- [start:visit_order]
    @cute.jit
    def kv_block(self, i: cutlass.Int32, n_block_min: cutlass.Int32, n_block_max: cutlass.Int32):
        """The KV tile of loop step ``i``: the window's range from its last tile down, then the sink tiles.

        Stage 6 went the other way. Last first puts the tile that the diagonal
        (causal) or S_k cuts into the first step, which is not overlapped anyway,
        so that the overlapped loop that follows runs on full tiles.
        """
        n_window = n_block_max - n_block_min
        n_block = n_block_max - 1 - i
        if i >= n_window:
            n_block = i - n_window
        return n_block
    # --8<-- [end:visit_order]

    @cute.jit
    def tile_is_partial(self, n_block: cutlass.Int32):
        """Does KV tile ``n_block`` hold a masked key for some row? Full tiles skip the mask."""
        partial = (n_block + 1) * self.tile_n > self.seqlen_k
        if cutlass.const_expr(self.has_right):
            partial = partial | ((n_block + 1) * self.tile_n - 1 > self.row0 + self.offset + self.right)
        if cutlass.const_expr(self.has_left):
            partial = partial | (n_block * self.tile_n < self.row0 + self.tile_m - 1 + self.offset - self.left)
        return partial

    @cute.jit
    def unmasked_steps(self, n_block_min: cutlass.Int32, n_block_max: cutlass.Int32):
        """[first, end) of the loop steps whose KV tile needs no mask (tile_is_partial is False for all of them).

        The loop visits the window's tiles from the last down: those cut by the
        right bound or S_k, the full ones, those cut by the left bound; then the
        sink tiles (masked). A loop over the full ones has no branch on the mask and
        no select per score (a branch between the two waits makes ptxas wait for both
        WGMMAs at the branch's end; `course sass 8` shows what it makes of the loop).
        """
        lo = n_block_min
        hi = cutlass.min(n_block_max, self.seqlen_k // self.tile_n)
        if cutlass.const_expr(self.has_right):
            hi = cutlass.min(hi, cutlass.max(self.row0 + self.offset + self.right + 1, 0) // self.tile_n)
        if cutlass.const_expr(self.has_left):
            first_key = cutlass.max(self.row0 + self.tile_m - 1 + self.offset - self.left, 0)  # the last row's
            lo = cutlass.max(lo, (first_key + self.tile_n - 1) // self.tile_n)
        lo = cutlass.min(lo, n_block_max)
        hi = cutlass.max(hi, lo)
        return n_block_max - hi, n_block_max - lo  # step i visits tile n_block_max - 1 - i

    @cute.jit
    def outside_left_bound(self, key: cutlass.Int32, key_start: cutlass.Int32):
        """Is ``key`` left of its row's window? Sink tokens never are. (Stage 5's test, per score: stage 11's
        transposed mask uses it; ``apply`` below counts registers instead.)"""
        outside = key < key_start
        if cutlass.const_expr(self.has_sink_tokens):
            # [exercise 5] outside ends True only for a key that is left of its row's window AND
            #   is not a sink token (key < num_sink_tokens): sink tokens ignore the left bound,
            #   never the right one. Both conditions are runtime Booleans, which Python's
            #   and/or/not cannot combine. (stage 5 page: Sink tokens: visible despite the window)
            outside = outside & (key >= self.num_sink_tokens)
            # [/exercise]
        return outside

    # --8<-- [start:keep_bits]
    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32):
        """Set S to -inf outside each row's visible keys, from a 32-bit keep-mask per 32 registers of a row.

        Stage 4 compared every register's key with the row's bounds: a key index and a
        compare per score. Here each bound becomes a register count (registers_before), the
        counts a mask of bits (low_bits), and each score one select on a bit: per row a few
        integer operations, per score at most a bit test. The keys are counted from the thread's first
        column, so only that one column index is computed at run time.
        """
        s = rows_cols_view(acc_S)
        coord = rows_cols_view(tScS)
        first_key = n_block * self.tile_n + coord[0, 0][1]  # this thread's first column, as a key index
        columns = cute.size(s, mode=[1])
        if cutlass.const_expr(self.has_sink_tokens):
            sink_end = registers_before(self.num_sink_tokens - first_key)  # the same for every row
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            row = self.row0 + coord[r, 0][0]
            key_end = self.seqlen_k
            if cutlass.const_expr(self.has_right):
                key_end = cutlass.min(key_end, row + self.offset + self.right + 1)
            keep_end = registers_before(key_end - first_key)  # registers [0, keep_end) hold keys < key_end
            if cutlass.const_expr(self.has_left):
                drop_end = registers_before(row + self.offset - self.left - first_key)
            for chunk in cutlass.range_constexpr((columns + 31) // 32):
                keep = low_bits(keep_end, chunk)
                if cutlass.const_expr(self.has_left):
                    outside = low_bits(drop_end, chunk)
                    if cutlass.const_expr(self.has_sink_tokens):
                        outside = outside & ~low_bits(sink_end, chunk)  # sink tokens ignore the left bound
                    keep = keep & ~outside
                for i in cutlass.range_constexpr(min(32, columns - 32 * chunk)):
                    c = 32 * chunk + i
                    s[r, c] = cutlass.Float32(cutlass.select_((keep >> i) & 1 != 0, s[r, c], -cutlass.Float32.inf))
    # --8<-- [end:keep_bits]

    # A tile with no masked key keeps its scores: the loop over full tiles calls nothing. A mask that
    # changes every score (stage 10's ALiBi bias) sets this and gives apply_full its full-tile work.
    changes_full_tiles = False

    @cute.jit
    def apply_full(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32):
        """What a full tile (tile_is_partial False) needs: nothing, for a window."""


@cute.jit
def online_softmax(acc_S: cute.Tensor, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                   scale_log2: cutlass.Float32):
    """Fold one tile into the running statistics: S becomes P in place, and O and the
    row sums are rescaled to the new row maxima.

    ``row_max`` is quad-reduced (all 4 threads of a row agree on it);
    ``row_sum`` holds this thread's columns only until the final reduction.
    """
    s = rows_cols_view(acc_S)
    o = rows_cols_view(acc_O)
    # [exercise 3] For each row r: after this tile, row_max[r] is the max over every key seen so
    #   far (the same in the 4 threads of the quad), S holds P relative to it, and row_sum[r] and
    #   row r of O are relative to it too: what they held before was relative to the old max.
    #   row_max stays in raw score units (scale_log2 is applied once, inside the exponent);
    #   row_sum holds this thread's columns only. A row that has seen no visible key yet (max
    #   -inf) gets P = 0 and keeps O and its sum at 0, never NaN.
    #   (stage 3 page: From two passes to one; stage 4 page: Rows with no visible key)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        tile_max = s[r, 0]
        for c in cutlass.range_constexpr(1, cute.size(s, mode=[1])):
            tile_max = cute.arch.fmax(tile_max, s[r, c])
        new_max = cute.arch.fmax(row_max[r], cute.arch.warp_reduction_max(tile_max, threads_in_group=4))
        # A row that has seen no visible key yet has max -inf: exponentiate against 0
        # instead, so masked scores give exp2(-inf) = 0 and never inf - inf = NaN.
        ref_max = new_max
        if new_max == -cutlass.Float32.inf:
            ref_max = cutlass.Float32(0.0)
        # Raw units in, one multiply by scale_log2: the max is never kept pre-scaled.
        correction = cute.math.exp2((row_max[r] - ref_max) * scale_log2, fastmath=True)
        max_scaled = ref_max * scale_log2
        thread_sum = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - max_scaled, fastmath=True)
            thread_sum += s[r, c]
        row_sum[r] = row_sum[r] * correction + thread_sum
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] *= correction
        row_max[r] = new_max
    # [/exercise]


@cute.jit
def quad_allreduce(values: cute.Tensor, reduce):
    """Combine each row statistic over the 4 threads of a quad (they hold the same rows)."""
    for r in cutlass.range_constexpr(cute.size(values)):
        values[r] = reduce(values[r], threads_in_group=4)


@cute.jit
def load_tile(pipe, state, tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, n_block: cutlass.Int32):
    """Producer step: wait for an empty buffer, then TMA KV tile ``n_block`` into it.

    The copy completes on the buffer's "full" barrier, which ``producer_acquire``
    armed with the tile's byte count; ``producer_commit`` is a no-op for TMA.
    """
    # [exercise 2] Producer step: KV tile n_block (the runtime index, never a trace-time constant)
    #   lands in the ring buffer that state points at. The copy may start only once that buffer is
    #   empty, and must complete on that buffer's full barrier, which the consumers wait on. The
    #   caller advances state. (stage 2 page: Producer and consumer steps)
    pipe.producer_acquire(state)
    cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
    pipe.producer_commit(state)
    # [/exercise]


@cute.jit
def mask_scores(acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32, mask: WindowMask):
    """Invisible keys of KV tile ``n_block`` to -inf; only tiles that straddle a boundary pay for it."""
    # (A runtime `if` may not carry a plain Python object such as `mask` across it; its bound method is fine.)
    apply_mask, apply_full = mask.apply, mask.apply_full
    if mask.tile_is_partial(n_block):
        apply_mask(acc_S, tScS, n_block)
    elif cutlass.const_expr(mask.changes_full_tiles):
        apply_full(acc_S, tScS, n_block)


@cute.jit
def tile_scores(qk_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                pipeline_k, k_state, tScS: cute.Tensor, n_block: cutlass.Int32, mask: WindowMask):
    """Consumer step: S = Q K_n^T for KV tile ``n_block``, invisible keys masked (the WGMMAs waited for)."""
    pipeline_k.consumer_wait(k_state)
    warpgroup_gemm(qk_mma, acc_S, tSrQ, tSrK[None, None, None, k_state.index])
    warpgroup.wait_group(0)
    pipeline_k.consumer_release(k_state)
    mask_scores(acc_S, tScS, n_block, mask)


# --8<-- [start:pingpong]
@cute.jit
def pingpong_start(mma_wg: cutlass.Int32):
    """Let MMA warpgroup 0 issue first: its scheduler barrier gets the other half of its arrivals in advance.

    A scheduler barrier completes when SCHEDULER_THREADS = 256 threads have
    arrived: the 128 of the warpgroup that waits (bar.sync) and 128 that
    arrive for it (bar.arrive): the warpgroup before it in the turn order,
    once its GEMMs are issued, or this call, once, at the start.
    """
    # TODO(stage 8): MMA warpgroup 0 takes the first turn: before any warpgroup waits for its turn,
    #   MMA warpgroup 0's scheduler barrier already holds the arrivals that the warpgroup before it
    #   in the turn order would otherwise bring; no other barrier gets any. See 'Step 1: ping-pong'.
    raise NotImplementedError("TODO(stage 8) in pingpong_start(): MMA warpgroup 0 takes the first turn: before any warpgroup waits for its turn, MMA warpgroup 0's scheduler barrier already holds the arrivals that the warpgroup before it in the turn order would otherwise bring; no other barrier gets any. See 'Step 1: ping-pong'. Hints, one at a time: python -m course hint 8 (docs/stages/08-fa3-prefill.md as raw markdown shows them all at once)")


@cute.jit
def pingpong_wait(mma_wg: cutlass.Int32):
    """Block until it is this warpgroup's turn to issue GEMMs."""
    # TODO(stage 8): Returns only when it is this MMA warpgroup's turn: the warpgroup before it in the
    #   turn order has passed the turn (or pingpong_start gave it). Each MMA warpgroup waits on
    #   a scheduler barrier of its own. See 'Step 1: ping-pong'.
    raise NotImplementedError("TODO(stage 8) in pingpong_wait(): Returns only when it is this MMA warpgroup's turn: the warpgroup before it in the turn order has passed the turn (or pingpong_start gave it). Each MMA warpgroup waits on a scheduler barrier of its own. See 'Step 1: ping-pong'. Hints, one at a time: python -m course hint 8 (docs/stages/08-fa3-prefill.md as raw markdown shows them all at once)")


@cute.jit
def pingpong_pass(mma_wg: cutlass.Int32, num_wgs: cutlass.Constexpr):
    """This warpgroup's GEMMs are issued: hand the turn to the next warpgroup, without waiting."""
    # TODO(stage 8): The turn goes to the next MMA warpgroup in the turn order (after the last comes
    #   MMA warpgroup 0), and this warpgroup does not wait for anything: its softmax starts at once.
    #   See 'Step 1: ping-pong'.
    raise NotImplementedError("TODO(stage 8) in pingpong_pass(): The turn goes to the next MMA warpgroup in the turn order (after the last comes MMA warpgroup 0), and this warpgroup does not wait for anything: its softmax starts at once. See 'Step 1: ping-pong'. Hints, one at a time: python -m course hint 8 (docs/stages/08-fa3-prefill.md as raw markdown shows them all at once)")
# --8<-- [end:pingpong]


# --8<-- [start:pingpong_loop]
@cute.jit
def attend_kv_tiles_pingpong(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, acc_S: cute.Tensor,
                             acc_O: cute.Tensor, rP: cute.Tensor, tOrP: cute.Tensor, tSrQ: cute.Tensor,
                             tSrK: cute.Tensor, tOrV: cute.Tensor, pipeline_q, q_state, pipeline_k, k_state,
                             pipeline_v, v_state, tScS: cute.Tensor, n_tiles: cutlass.Int32,
                             n_block_min: cutlass.Int32, n_block_max: cutlass.Int32, mask: WindowMask,
                             row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: cutlass.Float32,
                             mma_wg: cutlass.Int32, num_wgs: cutlass.Constexpr):
    """Step 1: stage 6's loop with the ping-pong. Each warpgroup takes its turn for S = Q K^T, hands the
    tensor cores over while it waits for S and runs the softmax, then takes its turn again for O += P V.

    Returns the advanced K and V pipeline states: the DSL carries a state object
    through the caller's runtime loop only if the caller rebinds it.
    """
    kv_block = mask.kv_block
    pingpong_wait(mma_wg)
    for i in cutlass.range(n_tiles, unroll=1):
        n_block = kv_block(i, n_block_min, n_block_max)
        pipeline_k.consumer_wait(k_state)
        warpgroup_gemm(qk_mma, acc_S, tSrQ, tSrK[None, None, None, k_state.index])
        pingpong_pass(mma_wg, num_wgs)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(k_state)
        k_state.advance()
        mask_scores(acc_S, tScS, n_block, mask)
        online_softmax(acc_S, acc_O, row_max, row_sum, scale_log2)
        rP.store(acc_S.load().to(rP.element_type))
        pipeline_v.consumer_wait(v_state)
        pingpong_wait(mma_wg)
        warpgroup_gemm(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()
    pingpong_pass(mma_wg, num_wgs)
    pipeline_q.consumer_release(q_state)  # every Q K^T of this tile is done: the producer may load the next Q
    return k_state, v_state
# --8<-- [end:pingpong_loop]


# --8<-- [start:overlapped_step]
@cute.jit
def overlapped_step(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, acc_S: cute.Tensor, acc_O: cute.Tensor,
                    rP: cute.Tensor, tOrP: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrV: cute.Tensor,
                    pipeline_k, k_state, pipeline_v, v_state, tScS: cute.Tensor, n_block: cutlass.Int32, apply_mask,
                    row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor, scale_log2: cutlass.Float32,
                    mma_wg: cutlass.Int32, num_wgs: cutlass.Constexpr, tight: cutlass.Constexpr,
                    masked: cutlass.Constexpr):
    """One step of the overlapped loop: S(i) = Q K^T and O += P(i - 1) V(i - 1) on the tensor cores, softmax(i)
    under the P V. ``masked`` steps apply the mask to every score (a select each, no branch). The caller
    advances both pipeline states afterwards (a helper may not change the state objects)."""
    acc_S = cute.make_rmem_tensor_like(acc_S, cutlass.Float32)  # a fresh S each step: nothing flows into the next Q K^T
    # TODO(stage 8): Step j of the overlapped loop: afterwards O = (O + P_{j-1} V_{j-1}) * row_scale,
    #   P holds P_j, and row_max and row_sum include tile j (masked steps mask S_j first). Both
    #   GEMMs (S_j and P_{j-1} V_{j-1}) are in flight, issued in this warpgroup's ping-pong turn,
    #   before the softmax of tile j starts. A K or V buffer goes back to the producer only once
    #   the GEMM reading it is complete; P and O are what a WGMMA in flight still uses (registers;
    #   P also shared memory with SharedP), so they change only after the group that uses them is
    #   complete. See 'Step 2: intra-warpgroup overlap'.
    raise NotImplementedError("TODO(stage 8) in overlapped_step(): Step j of the overlapped loop: afterwards O = (O + P_{j-1} V_{j-1}) * row_scale, P holds P_j, and row_max and row_sum include tile j (masked steps mask S_j first). Both GEMMs (S_j and P_{j-1} V_{j-1}) are in flight, issued in this warpgroup's ping-pong turn, before the softmax of tile j starts. A K or V buffer goes back to the producer only once the GEMM reading it is complete; P and O are what a WGMMA in flight still uses (registers; P also shared memory with SharedP), so they change only after the group that uses them is complete. See 'Step 2: intra-warpgroup overlap'. Hints, one at a time: python -m course hint 8 (docs/stages/08-fa3-prefill.md as raw markdown shows them all at once)")
# --8<-- [end:overlapped_step]


# --8<-- [start:overlapped_loop]
@cute.jit
def attend_kv_tiles_overlapped(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, acc_S: cute.Tensor,
                               acc_O: cute.Tensor, rP: cute.Tensor, tOrP: cute.Tensor, tSrQ: cute.Tensor,
                               tSrK: cute.Tensor, tOrV: cute.Tensor, pipeline_q, q_state, pipeline_k, k_state,
                               pipeline_v, v_state, tScS: cute.Tensor, n_tiles: cutlass.Int32,
                               n_block_min: cutlass.Int32, n_block_max: cutlass.Int32, mask: WindowMask,
                               row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
                               scale_log2: cutlass.Float32, mma_wg: cutlass.Int32, num_wgs: cutlass.Constexpr,
                               tight: cutlass.Constexpr, release_q: cutlass.Constexpr = True):
    """Steps 2 and 3: softmax(j) runs while O += P V(j-1) is on the tensor cores.

    P(j-1) stays in registers (``rP``; in shared memory as well with
    ``Tiles.p_in_smem``) from one step to the next, as the A operand of the P V
    WGMMA that is still running while softmax(j) works on S(j) in ``acc_S``.
    The PTX rule that makes this correct: registers (or shared memory) that an
    in-flight WGMMA reads (P) or accumulates into (O) are not touched until a
    ``wait_group`` covers that WGMMA. So the softmax returns O's correction in
    ``row_scale`` instead of rescaling O, and P(j) is written over P(j-1) only
    after ``wait_group(0)``. The steps whose tile needs a mask and those that
    do not run in separate loops, so that the common ones have no branch.
    Q is released as soon as its last Q K^T is done (unless ``release_q`` is
    False: O's buffers are Q's rows, and the epilogue releases Q). Returns the
    advanced K and V pipeline states (the caller rebinds them: see attend_kv_tiles_pingpong).
    """
    kv_block, apply_mask, apply_full = mask.kv_block, mask.apply, mask.apply_full
    changes_full_tiles = mask.changes_full_tiles
    masked_end, unmasked_end = mask.unmasked_steps(n_block_min, n_block_max)
    if n_tiles > 0:  # the first tile: its scores and its P, no P V yet
        tile_scores(qk_mma, acc_S, tSrQ, tSrK, pipeline_k, k_state, tScS, kv_block(0, n_block_min, n_block_max),
                    mask)
        k_state.advance()
        softmax_step(acc_S, row_max, row_sum, row_scale, scale_log2, tight, tight)
        rP.store(acc_S.load().to(rP.element_type))
    for i in cutlass.range(1, masked_end, unroll=1):  # tiles cut by the right bound or S_k
        overlapped_step(qk_mma, pv_mma, acc_S, acc_O, rP, tOrP, tSrQ, tSrK, tOrV, pipeline_k, k_state, pipeline_v,
                        v_state, tScS, kv_block(i, n_block_min, n_block_max), apply_mask, row_max, row_sum,
                        row_scale, scale_log2, mma_wg, num_wgs, tight, True)
        k_state.advance()
        v_state.advance()
    for i in cutlass.range(cutlass.max(masked_end, 1), unmasked_end, unroll=1):  # full tiles: no mask
        overlapped_step(qk_mma, pv_mma, acc_S, acc_O, rP, tOrP, tSrQ, tSrK, tOrV, pipeline_k, k_state, pipeline_v,
                        v_state, tScS, kv_block(i, n_block_min, n_block_max), apply_full, row_max, row_sum,
                        row_scale, scale_log2, mma_wg, num_wgs, tight, changes_full_tiles)
        k_state.advance()
        v_state.advance()
    for i in cutlass.range(cutlass.max(unmasked_end, 1), n_tiles, unroll=1):  # cut by the left bound; sink tiles
        overlapped_step(qk_mma, pv_mma, acc_S, acc_O, rP, tOrP, tSrQ, tSrK, tOrV, pipeline_k, k_state, pipeline_v,
                        v_state, tScS, kv_block(i, n_block_min, n_block_max), apply_mask, row_max, row_sum,
                        row_scale, scale_log2, mma_wg, num_wgs, tight, True)
        k_state.advance()
        v_state.advance()
    if cutlass.const_expr(release_q):
        pipeline_q.consumer_release(q_state)  # every Q K^T of this tile is done: the producer may load the next Q
    if n_tiles > 0:  # the last tile's P V
        pipeline_v.consumer_wait(v_state)
        warpgroup_gemm(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()
    return k_state, v_state
# --8<-- [end:overlapped_loop]


# --8<-- [start:softmax_step]
@cute.jit
def row_max_of(s: cute.Tensor, r: cutlass.Constexpr, tight: cutlass.Constexpr) -> cutlass.Float32:
    """This thread's maximum of row ``r``: one chain of fmax, or (tight) four independent chains."""
    n = cute.size(s, mode=[1])
    if cutlass.const_expr(tight):
        chains = [s[r, c] for c in range(4)]
        for c in cutlass.range_constexpr(4, n):
            chains[c % 4] = cute.arch.fmax(chains[c % 4], s[r, c])
        return cute.arch.fmax(cute.arch.fmax(chains[0], chains[1]), cute.arch.fmax(chains[2], chains[3]))
    result = s[r, 0]
    for c in cutlass.range_constexpr(1, n):
        result = cute.arch.fmax(result, s[r, c])
    return result


@cute.jit
def exponentiate_row(s: cute.Tensor, r: cutlass.Constexpr, scale_log2: cutlass.Float32,
                     max_scaled: cutlass.Float32, tight: cutlass.Constexpr) -> cutlass.Float32:
    """P = exp2(S * scale_log2 - max_scaled) in place (one FFMA, one MUFU.EX2 each); return this thread's sum."""
    n = cute.size(s, mode=[1])
    chains = [cutlass.Float32(0.0) for _ in range(4 if tight else 1)]
    for c in cutlass.range_constexpr(n):
        s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - max_scaled, fastmath=True)
        chains[c % len(chains)] = chains[c % len(chains)] + s[r, c]
    total = chains[0]
    for k in cutlass.range_constexpr(1, len(chains)):
        total = total + chains[k]
    return total


@cute.jit
def softmax_step(acc_S: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
                 scale_log2: cutlass.Float32, first: cutlass.Constexpr, tight: cutlass.Constexpr):
    """Stage 6's online softmax without touching O: S becomes P in place, and ``row_scale[r]`` gets the
    factor O must be multiplied by once the P V WGMMA that still reads the old O is done.

    ``first`` (the first tile of a Q tile, with ``tight``): the running max is
    -inf and the sum 0, so there is no correction to compute.
    """
    s = rows_cols_view(acc_S)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        new_max = cute.arch.warp_reduction_max(row_max_of(s, r, tight), threads_in_group=4)
        if cutlass.const_expr(not first):
            new_max = cute.arch.fmax(row_max[r], new_max)
        # A row that has seen no visible key yet has max -inf: exponentiate against 0 instead.
        ref_max = new_max
        if new_max == -cutlass.Float32.inf:
            ref_max = cutlass.Float32(0.0)
        thread_sum = exponentiate_row(s, r, scale_log2, ref_max * scale_log2, tight)
        if cutlass.const_expr(first):
            row_sum[r] = thread_sum
        else:
            row_scale[r] = cute.math.exp2((row_max[r] - ref_max) * scale_log2, fastmath=True)
            row_sum[r] = row_sum[r] * row_scale[r] + thread_sum
        row_max[r] = new_max


@cute.jit
def rescale_rows(acc_O: cute.Tensor, row_scale: cute.Tensor):
    """O[r, :] *= row_scale[r]: the correction of the softmax step, applied after the P V wait."""
    o = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):  # up to 64 columns (D_v = 256)
            o[r, c] *= row_scale[r]
# --8<-- [end:softmax_step]


@cute.jit
def normalize_rows(acc_O: cute.Tensor, row_sum: cute.Tensor, row_max: cute.Tensor, scale_log2: cutlass.Float32,
                   sink_log2: cutlass.Float32, lse: cute.Tensor):
    """O /= the softmax denominator; ``lse[r]`` gets the row's natural-log LSE.

    In log2 units the denominator is 2^top * denominator, with top = max * scale_log2
    (and the sink logit, -inf without sink logits, brought to the common reference
    top = max(max * scale_log2, sink)). So LSE = (top + log2(denominator)) * ln 2,
    which is -inf for a row with no visible key and no sink (or a -inf one), and
    the sink logit for a row with only the sink.
    """
    o = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        max_scaled = row_max[r] * scale_log2
        top = cute.arch.fmax(max_scaled, sink_log2)
        # No visible key and a -inf sink: both terms are exp2(-inf) = 0 against 0, as the softmax
        # does for a -inf max, never exp2(-inf - (-inf)) = NaN; the row is empty: O = 0, LSE = -inf.
        if top == -cutlass.Float32.inf:
            top = cutlass.Float32(0.0)
        rescale = cute.math.exp2(max_scaled - top, fastmath=True)
        denominator = row_sum[r] * rescale + cute.math.exp2(sink_log2 - top, fastmath=True)
        inv_sum = rescale * cute.arch.rcp_approx(denominator)
        if denominator == 0.0:
            inv_sum = cutlass.Float32(0.0)
        # [exercise 6] lse[r] is the row's log-sum-exp in NATURAL-log units, from top and
        #   denominator above (what they mean: the docstring). A row with no visible key gets -inf
        #   and a row with only a sink the sink logit, without a special case.
        #   (page: The LSE is already in the kernel)
        lse[r] = (top + cute.math.log2(denominator, fastmath=False)) * LN_2
        # [/exercise]
        for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
            o[r, c] *= inv_sum


@cute.jit
def store_lse(lse: cute.Tensor, mLSE: cute.Tensor, tScS: cute.Tensor, row0: cutlass.Int32, seqlen_q: cutlass.Int32,
              head: cutlass.Int32, batch: cutlass.Int32, mma_tidx: cutlass.Int32):
    """Write every row's LSE to mLSE[batch, head, row]: each quad holds its rows 4 times, so its first thread writes."""
    coord = rows_cols_view(tScS)
    # [exercise 6] mLSE[batch, head, row] gets lse[r] for every row this thread holds that lies
    #   below seqlen_q (the tail tile), written by exactly one thread per row: the 4 threads of a
    #   quad all hold the same rows. coord gives each register's row inside the Q tile.
    #   (page: The LSE is already in the kernel)
    if mma_tidx % 4 == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = row0 + coord[r, 0][0]
            if row < seqlen_q:
                mLSE[batch, head, row] = lse[r]
    # [/exercise]


# --8<-- [start:scheduler]
class TileScheduler:
    """Which (Q tile, head, batch) tiles a CTA computes, and in which order.

    Without Step.PERSISTENT every CTA computes one tile, its block index, on
    stage 6's grid (Q tiles, heads, batch). With it the tiles follow one
    linear order: the (batch, head) pairs in groups whose K and V fit in L2
    together; inside a group, every pair at one Q tile before the next Q
    tile, so the CTAs that run at the same time share K and V. Then:

    * without a causal mask every tile costs the same, and the grid is one CTA
      per SM: CTA i computes tiles i, i + grid, i + 2 grid, ..., so that the
      producer loads the next tile while the consumers finish this one;
    * under a causal mask the tiles cost what their rows see, the last Q tile
      the most: one CTA per tile, the last Q tile first (longest processing
      time first), and the GPU's block scheduler hands each free SM the next
      one. A static round robin measured slower here: the CTAs that drew the
      long tiles of every round finish last.
    """

    def __init__(self, seqlen_q, num_heads, num_batch, seqlen_k, kv_tile_bytes: int, linear: bool,
                 longest_first: bool, l2_bytes: int, tile_m: int, tile_n: int):
        self.num_m_blocks = (seqlen_q + tile_m - 1) // tile_m
        self.num_heads, self.num_batch = num_heads, num_batch
        self.num_pairs = num_heads * num_batch
        self.kv_blocks = (seqlen_k + tile_n - 1) // tile_n
        self.l2_kv_blocks = l2_bytes // kv_tile_bytes  # KV tiles (a K and a V tile each) that fit in L2
        self.linear, self.longest_first = linear, longest_first  # the linear order of Step.PERSISTENT
        self.persistent = linear and not longest_first  # CTAs loop over tiles; else one CTA per tile

    def num_tiles(self):
        return self.num_m_blocks * self.num_pairs

    def grid(self, num_sms: int):
        if self.persistent:
            return (cutlass.min(self.num_tiles(), num_sms), 1, 1)
        if self.linear:
            return (self.num_tiles(), 1, 1)
        return (self.num_m_blocks, self.num_heads, self.num_batch)

    @cute.jit
    def l2_group(self) -> cutlass.Int32:
        """How many (batch, head) pairs share one pass over the Q tiles: the largest power of two
        whose K and V fit in L2 together (at least 1)."""
        group = cutlass.Int32(1)
        if cutlass.const_expr(self.linear):
            # TODO(stage 8): The largest power of two of (batch, head) pairs, never more pairs than
            #   there are, whose K and V tiles all fit in L2 together (self.l2_kv_blocks says how
            #   many fit; self.kv_blocks is one pair's). At least 1. See 'Step 5: tile scheduling'.
            raise NotImplementedError("TODO(stage 8) in l2_group(): The largest power of two of (batch, head) pairs, never more pairs than there are, whose K and V tiles all fit in L2 together (self.l2_kv_blocks says how many fit; self.kv_blocks is one pair's). At least 1. See 'Step 5: tile scheduling'. Hints, one at a time: python -m course hint 8 (docs/stages/08-fa3-prefill.md as raw markdown shows them all at once)")
        return group

    @cute.jit
    def tile_range(self):
        """(first, end, step) of this CTA's linear tile indices."""
        first, end, step = cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1)
        if cutlass.const_expr(self.linear):
            first = cute.arch.block_idx()[0]
            end = first + 1
        if cutlass.const_expr(self.persistent):
            end = self.num_tiles()
            step = cute.arch.grid_dim()[0]
        return first, end, step

    @cute.jit
    def coords(self, tile: cutlass.Int32, group: cutlass.Int32):
        """(m_block, head, batch) of linear tile index ``tile`` (the block index without Step.PERSISTENT)."""
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.linear):
            # TODO(stage 8): Each (Q tile, pair) exactly once over tile = 0 .. num_tiles() - 1. The
            #   pairs come in sections of `group` consecutive pairs (the last may hold fewer); a
            #   section's tiles are consecutive indices, and inside it all its pairs, in order, at
            #   one Q tile come before any at the next; longest_first walks the Q tiles last to
            #   first. Pairs are numbered batch by batch, heads in order. See 'Step 5: tile scheduling'.
            raise NotImplementedError("TODO(stage 8) in coords(): Each (Q tile, pair) exactly once over tile = 0 .. num_tiles() - 1. The pairs come in sections of `group` consecutive pairs (the last may hold fewer); a section's tiles are consecutive indices, and inside it all its pairs, in order, at one Q tile come before any at the next; longest_first walks the Q tiles last to first. Pairs are numbered batch by batch, heads in order. See 'Step 5: tile scheduling'. Hints, one at a time: python -m course hint 8 (docs/stages/08-fa3-prefill.md as raw markdown shows them all at once)")
        return m_block, head, batch
# --8<-- [end:scheduler]


# --8<-- [start:epilogue]
@cute.jit
def store_o_tile(acc_O: cute.Tensor, sO: cute.Tensor, tma_o: cute.CopyAtom, gO: cute.Tensor,
                 pv_mma: cute.TiledMma, mma_tidx: cutlass.Int32, dtype: cutlass.Constexpr, mma_threads: cutlass.Constexpr):
    """Before Step.EPILOGUE, stage 6's epilogue: all MMA threads write the O tile to shared memory,
    one thread stores it with TMA and waits until the store has read it."""
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    rO.store(acc_O.load().to(dtype))
    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=mma_threads)  # the last store read sO
    cute.autovec_copy(rO, pv_mma.get_slice(mma_tidx).partition_C(sO))
    # Make the generic-proxy stores visible to the TMA (async proxy) before it reads them.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=mma_threads)
    bOsO, bOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                       cute.group_modes(gO, 0, 2))
    if mma_tidx == 0:
        cute.copy(tma_o, bOsO, bOgO)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_o_rows(acc_O: cute.Tensor, sO: cute.Tensor, tma_o: cute.CopyAtom, gO: cute.Tensor,
                 pv_mma_wg: cute.TiledMma, mma_wg: cutlass.Int32, wg_tidx: cutlass.Int32, dtype: cutlass.Constexpr,
                 o_in_q: cutlass.Constexpr = False):
    """Step.EPILOGUE: this warpgroup's 64 rows of O to its own buffer ``sO`` with stmatrix, then a TMA
    store that nobody waits for here. Its thread 0 waits at the next call, before the buffer is
    written again (and once at the end of the kernel), so the store overlaps the next tile.

    With ``o_in_q`` the buffer is the warpgroup's rows of Q, and the next Q may land there only once
    the store has read them: thread 0 waits right after the store, and the caller releases Q."""
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    rO.store(acc_O.load().to(dtype))
    barrier = int(NamedBarrier.EPILOGUE_WG1) + mma_wg  # this warpgroup only: the others are a turn apart
    if wg_tidx == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous tile's store has read sO
    cute.arch.barrier(barrier_id=barrier, number_of_threads=128)
    # stmatrix: each instruction writes four 8x8 blocks of 16-bit values, one row of 16 bytes per lane.
    store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, cutlass.Float32)
    thr_store = cute.make_tiled_copy_C(store_atom, pv_mma_wg).get_slice(wg_tidx)
    cute.copy(store_atom, thr_store.retile(rO), thr_store.partition_D(sO))
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=barrier, number_of_threads=128)
    bOsO, bOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                       cute.group_modes(gO, 0, 2))
    if wg_tidx == 0:
        cute.copy(tma_o, bOsO, bOgO)
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(o_in_q):
            cute.arch.cp_async_bulk_wait_group(0, read=True)
# --8<-- [end:epilogue]


def bshd_as_rows_dim(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (S, D, H, B): rows and the contiguous K mode first, as TMA and WGMMA index them."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def bshd_as_dim_rows(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (D, S, H, B): V seen as the (N, K) = (D, S_k) B operand of P V."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[3, 1, 2, 0]))


class Attention:
    """Stage 6's kernel with FA3's scheduling: ``steps`` of this stage are on (all by default; the
    ablation benchmark compiles subclasses with fewer)."""

    steps = Step.PERSISTENT  # every step of this stage (Step is ordered: a level includes the ones before)
    l2_bytes = L2_BYTES  # the K and V a group of heads may keep in L2 (Step.PERSISTENT)
    forced_tiles = None  # a Tiles instead of TILES's (course.tools.tile_variants times the others)

    def __init__(self, config: prefill.KernelConfig):
        self.config = config  # what this kernel is compiled for: a feature that is off compiles out
        self.dtype = config.cute_dtype
        self.head_dim, self.head_dim_v = config.head_dim, config.dv
        tiles = self.forced_tiles or TILES[self.head_dim, self.head_dim_v]
        self.num_wgs = tiles.mma_warpgroups  # MMA warpgroups: 64 query rows each
        self.tile_n = tiles.tile_n
        self.tile_m = 64 * self.num_wgs
        self.mma_threads = 128 * self.num_wgs
        self.num_threads = 128 + self.mma_threads  # producer warpgroup, then MMA warpgroups 0, 1, ...
        # The O tile's rows per shared-memory buffer, and its buffers (smem_layouts)
        self.o_rows, self.o_buffers = (64, self.num_wgs) if self.steps >= Step.EPILOGUE else (self.tile_m, 1)
        self.o_in_q = tiles.o_in_q and self.steps >= Step.EPILOGUE  # (a warpgroup's rows of Q: Step.EPILOGUE's)
        self.p_in_smem = tiles.p_in_smem

    # Every prefill stage has this signature, so one host function (course.runtime.prefill) compiles and
    # launches them all; a stage ignores the arguments of features it does not have yet.
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        num_sink_tokens: cutlass.Int32,
        write_lse: cutlass.Int32,
        stream,
    ):
        mQ, mK, mO = bshd_as_rows_dim(mQ), bshd_as_rows_dim(mK), bshd_as_rows_dim(mO)
        mV = bshd_as_dim_rows(mV)
        qk_mma, pv_mma, pv_mma_wg = self.tiled_mmas()
        sQ_layout, sK_layout, sV_layout, sO_layout = self.smem_layouts()
        self.define_shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)
        one_stage = (None, None, 0)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (self.tile_m, self.head_dim))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(sK_layout, one_stage),
                                                    (self.tile_n, self.head_dim))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, cute.slice_(sV_layout, one_stage),
                                                    (self.head_dim_v, self.tile_n))
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                    cute.slice_(sO_layout, one_stage), (self.o_rows, self.head_dim_v))

        scheduler = self.scheduler(mQ, mK)
        self.kernel(
            qk_mma, pv_mma, pv_mma_wg, tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, tma_o, tma_mO,
            mLSE, mSinks, scale_log2, window_left, window_right, num_sink_tokens, write_lse,
            sQ_layout, sK_layout, sV_layout, sO_layout,
        ).launch(grid=scheduler.grid(launch.sm_count()), block=[self.num_threads, 1, 1], stream=stream)

    def tiled_mmas(self):
        """(S = Q K^T, O = P V, one warpgroup's share of P V) as tiled WGMMAs over the MMA warpgroups."""
        dtype, dv, n = self.dtype, self.head_dim_v, self.tile_n
        # S = Q K^T: both operands K-major (head_dim contiguous), from shared memory.
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (self.num_wgs, 1, 1), (64, n),
        )
        # O = P V: P from registers (K-major; from shared memory with p_in_smem), V MN-major (head_dim contiguous).
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32, (self.num_wgs, 1, 1), (64, dv),
            warpgroup.OperandSource.SMEM if self.p_in_smem else warpgroup.OperandSource.RMEM,
        )
        # One warpgroup's share of P V: how its threads hold their 64 rows of O (for the epilogue).
        pv_mma_wg = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (64, dv), warpgroup.OperandSource.RMEM,
        )
        return qk_mma, pv_mma, pv_mma_wg

    def smem_layouts(self):
        """The swizzled shared-memory layouts of Q, the K and V rings, and the O buffers."""
        dtype, d, dv, n = self.dtype, self.head_dim, self.head_dim_v, self.tile_n
        sQ_layout = cute.slice_(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, n, d), dtype, 1), (None, None, 0)
        )
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile_m, n, d), dtype, KV_STAGES)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.tile_m, dv, n), dtype, KV_STAGES)
        # O gets buffers of its own, so that the producer may load the next tile's Q meanwhile:
        # with Step.EPILOGUE one of 64 rows per warpgroup, else one for the whole tile.
        sO_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.o_rows, n, dv), dtype, self.o_buffers)
        if cutlass.const_expr(self.o_in_q):
            # (64 rows, D_v columns, warpgroup) of Q's layout: warpgroup w's buffer is Q's rows 64 w .. 64 w + 63.
            tiles = cute.zipped_divide(sQ_layout, (64, dv))  # ((64, D_v), (warpgroups, D // D_v))
            sO_layout = cute.make_composed_layout(tiles.inner, 0, cute.append(
                cute.get(tiles.outer, mode=[0]), cute.get(tiles.outer, mode=[1, 0])))
        return sQ_layout, sK_layout, sV_layout, sO_layout

    def p_layout(self):
        """P's tile in shared memory (``p_in_smem``): the A operand of P V, K-major like Q."""
        tile = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.head_dim_v, self.tile_n),
                                             self.dtype, 1)
        return cute.slice_(tile, (None, None, 0))

    @cute.jit  # (traced: the struct's annotations are evaluated, which `from __future__ import annotations` defers)
    def define_shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The CTA's shared memory (``self.shared_storage``) and the bytes one Q, K and V tile load brings."""
        dtype = self.dtype

        @cute.struct
        class SharedStorage:
            q_bars: cute.struct.MemRange[cutlass.Int64, 2]  # full + empty: Q is loaded once per tile
            k_bars: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            v_bars: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dtype, 0 if self.o_in_q else cute.cosize(sO_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.p_layout()) if self.p_in_smem else 0],
                                  1024]

        self.shared_storage = SharedStorage
        one_stage = (None, None, 0)
        self.q_bytes = cute.size_in_bytes(dtype, sQ_layout)
        self.k_bytes = cute.size_in_bytes(dtype, cute.slice_(sK_layout, one_stage))  # one K tile
        self.v_bytes = cute.size_in_bytes(dtype, cute.slice_(sV_layout, one_stage))  # one V tile

    def scheduler(self, mQ: cute.Tensor, mK: cute.Tensor) -> TileScheduler:
        kv_tile_bytes = self.tile_n * (self.head_dim + self.head_dim_v) * self.dtype.width // 8
        return TileScheduler(mQ.shape[0], mQ.shape[2], mQ.shape[3], mK.shape[0], kv_tile_bytes,
                             self.steps >= Step.PERSISTENT, self.config.has_right, self.l2_bytes, self.tile_m,
                             self.tile_n)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        pv_mma_wg: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        scale_log2: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        num_sink_tokens: cutlass.Int32,
        write_lse: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)

        storage = SmemAllocator().allocate(self.shared_storage)
        sQ, sK, sV, sO, sP = self.shared_tensors(storage, sQ_layout, sK_layout, sV_layout, sO_layout)
        pipeline_q, pipeline_k, pipeline_v = self.make_pipelines(storage)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_o)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialized before anyone uses one

        # Each role builds its scheduler after changing its register count: values computed before the
        # change and used after it may be spilled to local memory.
        if warpgroup_idx > 0:
            cute.arch.setmaxregister_increase(REGISTERS[self.num_wgs][1])
            self.mma(self.scheduler(mQ, mK), qk_mma, pv_mma, pv_mma_wg, tma_o, mQ, mK, mO, mLSE, mSinks, sQ, sK, sV, sO,
                     sP, pipeline_q, pipeline_k, pipeline_v, scale_log2, window_left, window_right, num_sink_tokens,
                     write_lse)
        else:
            cute.arch.setmaxregister_decrease(REGISTERS[self.num_wgs][0])
            if warp_idx == 0:
                self.load(self.scheduler(mQ, mK), tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, pipeline_q, pipeline_k,
                          pipeline_v, window_left, window_right, num_sink_tokens)

    def shared_tensors(self, storage, sQ_layout, sK_layout, sV_layout, sO_layout):
        """sQ, sK, sV, sO, sP: the buffers of ``storage`` with their swizzled layouts (sO in sQ's bytes with
        ``o_in_q``; sP None without ``p_in_smem``)."""
        sP = None
        if cutlass.const_expr(self.p_in_smem):
            p_layout = self.p_layout()
            sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        return (*(buffer.get_tensor(layout.outer, swizzle=layout.inner) for buffer, layout in (
            (storage.sQ, sQ_layout), (storage.sK, sK_layout), (storage.sV, sV_layout),
            (storage.sQ if self.o_in_q else storage.sO, sO_layout))), sP)

    def mma_operands(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor,
                     sV: cute.Tensor, sP, mma_tidx: cutlass.Int32, mma_wg: cutlass.Int32):
        """An MMA thread's view of both GEMMs: (tSrQ, tSrK, tOrV) from shared memory (K and V per ring stage:
        (MMA, N, K, KV_STAGES)), S's accumulator and its (row, key) coordinates (acc_S, tScS), O's accumulator
        (acc_O), and P (rP, tOrP: ``p_operand``)."""
        # Operands in shared memory are a whole warpgroup's. Sliced at the warpgroup's first thread, a warp-uniform
        # index, their WGMMA descriptors stay in uniform registers; that pays with P in shared memory (P V then
        # has two descriptors, P's and V's) and not with P in registers, where ptxas schedules the loop worse.
        operand_thread = mma_wg * 128 if self.p_in_smem else mma_tidx
        wg_qk, wg_pv = qk_mma.get_slice(operand_thread), pv_mma.get_slice(operand_thread)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        thr_qk = qk_mma.get_slice(mma_tidx)
        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc_O = wg_pv.make_fragment_C(wg_pv.partition_shape_C((self.tile_m, self.head_dim_v)))
        # P lives here (and in sP with p_in_smem) from its softmax to its P V, one iteration later (Step.OVERLAP).
        rP, tOrP = self.p_operand(qk_mma, wg_pv, acc_S, sP, mma_tidx)
        return tSrQ, tSrK, tOrV, acc_S, tScS, acc_O, rP, tOrP

    def p_operand(self, qk_mma: cute.TiledMma, wg_pv, acc_S: cute.Tensor, sP, mma_tidx: cutlass.Int32):
        """(rP, tOrP): where the softmax leaves P (``rP.store``) and the A operand the P V WGMMA reads. Both are
        the same registers, viewed as S's fragment and as P V's; with ``p_in_smem``, rP is a ``SharedP`` that
        also writes sP, and tOrP is the WGMMA's view of sP."""
        registers = cute.make_rmem_tensor_like(acc_S, self.dtype)
        if cutlass.const_expr(not self.p_in_smem):
            return registers, cute.make_tensor(registers.iterator, acc_layout_as_operand_a(registers.layout))
        # stmatrix, as the epilogue writes O: P has the layout of S's accumulator.
        store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, cutlass.Float32)
        thr_store = cute.make_tiled_copy_C(store_atom, qk_mma).get_slice(mma_tidx)
        shared = SharedP(registers, store_atom, thr_store, thr_store.partition_D(sP))
        return shared, wg_pv.make_fragment_A(wg_pv.partition_A(sP))

    def make_pipelines(self, storage):
        """The Q, K and V pipelines, on the mbarriers of ``storage``."""
        # --8<-- [start:pipelines]
        # A "full" barrier per buffer completes when its TMA bytes have landed (one producer
        # arrival + tx bytes); an "empty" barrier when all MMA warps released it. Q has a
        # pipeline of its own now: one buffer, refilled for every tile.
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32)  # a release per MMA warp
        pipeline_q = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=producer, consumer_group=consumers,
            tx_count=self.q_bytes, barrier_storage=storage.q_bars.data_ptr(), defer_sync=True,
        )
        pipeline_k = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=producer, consumer_group=consumers,
            tx_count=self.k_bytes, barrier_storage=storage.k_bars.data_ptr(), defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=producer, consumer_group=consumers,
            tx_count=self.v_bytes, barrier_storage=storage.v_bars.data_ptr(), defer_sync=True,
        )
        # --8<-- [end:pipelines]
        return pipeline_q, pipeline_k, pipeline_v

    # --8<-- [start:producer]
    @cute.jit
    def load(self, scheduler: TileScheduler, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom,
             mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
             sV: cute.Tensor, pipeline_q, pipeline_k, pipeline_v, window_left: cutlass.Int32,
             window_right: cutlass.Int32, num_sink_tokens: cutlass.Int32):
        """The producer warp: Q, K and V of every tile of this CTA, in the order the consumers use them."""
        d, dv, n = self.head_dim, self.head_dim_v, self.tile_n
        one_cta = cute.make_layout(1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        group = scheduler.l2_group()
        first, end, step = scheduler.tile_range()
        coords = scheduler.coords  # (a runtime loop may not carry the scheduler object; its bound method is fine)
        for tile in cutlass.range(first, end, step, unroll=1):
            m_block, head, batch = coords(tile, group)
            mask = WindowMask(m_block, mQ.shape[0], mK.shape[0], window_left, window_right, num_sink_tokens,
                              self.config, self.tile_m, self.tile_n)
            n_block_min, n_block_max = mask.kv_block_range()
            n_sink_blocks = mask.sink_block_count(n_block_min)  # sink tiles below the window's range
            n_tiles = n_sink_blocks + n_block_max - n_block_min  # producer and consumers walk the same tiles
            kv_block = mask.kv_block
            head_kv = head // (mQ.shape[2] // mK.shape[2])  # GQA/MQA
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, d), (m_block, 0))
            gK = cute.local_tile(mK[None, None, head_kv, batch], (n, d), (None, 0))  # (tile_n, d, n_blocks)
            gV = cute.local_tile(mV[None, None, head_kv, batch], (dv, n), (0, None))  # (d_v, tile_n, n_blocks)
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
            # K of the first tile, then Q: the K copy starts while the consumers still hold the last Q.
            if n_tiles > 0:
                load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, kv_block(0, n_block_min, n_block_max))
                k_state.advance()
            pipeline_q.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            q_state.advance()
            if cutlass.const_expr(self.steps >= Step.OVERLAP):
                # V one tile behind K: the consumers use K(i) and V(i - 1) in the same iteration.
                for i in cutlass.range(1, n_tiles, unroll=1):
                    load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, kv_block(i, n_block_min, n_block_max))
                    k_state.advance()
                    load_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, kv_block(i - 1, n_block_min, n_block_max))
                    v_state.advance()
                if n_tiles > 0:
                    load_tile(pipeline_v, v_state, tma_v, tVgV, tVsV,
                              kv_block(n_tiles - 1, n_block_min, n_block_max))
                    v_state.advance()
            else:
                for i in cutlass.range(n_tiles, unroll=1):
                    if i > 0:
                        load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, kv_block(i, n_block_min, n_block_max))
                        k_state.advance()
                    load_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, kv_block(i, n_block_min, n_block_max))
                    v_state.advance()
        # Wait until the consumers released the last buffers before the CTA may exit.
        pipeline_q.producer_tail(q_state)
        pipeline_k.producer_tail(k_state)
        pipeline_v.producer_tail(v_state)
    # --8<-- [end:producer]

    # --8<-- [start:consumer]
    @cute.jit
    def mma(self, scheduler: TileScheduler, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pv_mma_wg: cute.TiledMma,
            tma_o: cute.CopyAtom, mQ: cute.Tensor, mK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
            mSinks: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor, sP,
            pipeline_q, pipeline_k, pipeline_v, scale_log2: cutlass.Float32, window_left: cutlass.Int32,
            window_right: cutlass.Int32, num_sink_tokens: cutlass.Int32, write_lse: cutlass.Int32):
        """An MMA warpgroup: 64 rows of every tile of this CTA."""
        dv = self.head_dim_v
        tidx, _, _ = cute.arch.thread_idx()
        mma_tidx = tidx - 128
        mma_wg = cute.arch.make_warp_uniform(mma_tidx // 128)
        wg_tidx = mma_tidx % 128
        tSrQ, tSrK, tOrV, acc_S, tScS, acc_O, rP, tOrP = self.mma_operands(qk_mma, pv_mma, sQ, sK, sV, sP,
                                                                            mma_tidx, mma_wg)
        rows = cute.size(rows_cols_view(acc_S), mode=[0])
        row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(rows, cutlass.Float32)
        row_scale = cute.make_rmem_tensor(rows, cutlass.Float32)
        lse = cute.make_rmem_tensor(rows, cutlass.Float32)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)

        pingpong_start(mma_wg)
        group = scheduler.l2_group()
        first, end, step = scheduler.tile_range()
        coords = scheduler.coords  # (a runtime loop may not carry the scheduler object; its bound method is fine)
        for tile in cutlass.range(first, end, step, unroll=1):
            m_block, head, batch = coords(tile, group)
            mask = WindowMask(m_block, mQ.shape[0], mK.shape[0], window_left, window_right, num_sink_tokens,
                              self.config, self.tile_m, self.tile_n)
            n_block_min, n_block_max = mask.kv_block_range()
            n_sink_blocks = mask.sink_block_count(n_block_min)
            n_tiles = n_sink_blocks + n_block_max - n_block_min
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)
            acc_O.fill(0.0)
            pipeline_q.consumer_wait(q_state)
            # The K and V states are rebound: a state that a helper advances is carried through
            # this runtime loop only that way (a helper's changes to the object itself are lost).
            if cutlass.const_expr(self.steps >= Step.OVERLAP):
                k_state, v_state = attend_kv_tiles_overlapped(
                    qk_mma, pv_mma, acc_S, acc_O, rP, tOrP, tSrQ, tSrK, tOrV, pipeline_q, q_state, pipeline_k,
                    k_state, pipeline_v, v_state, tScS, n_tiles, n_block_min, n_block_max, mask, row_max, row_sum,
                    row_scale, scale_log2, mma_wg, self.num_wgs, self.steps >= Step.SOFTMAX, not self.o_in_q)
            else:
                k_state, v_state = attend_kv_tiles_pingpong(
                    qk_mma, pv_mma, acc_S, acc_O, rP, tOrP, tSrQ, tSrK, tOrV, pipeline_q, q_state, pipeline_k,
                    k_state, pipeline_v, v_state, tScS, n_tiles, n_block_min, n_block_max, mask, row_max, row_sum,
                    scale_log2, mma_wg, self.num_wgs)

            quad_allreduce(row_sum, cute.arch.warp_reduction_sum)
            # Natural-log units, never scaled by softmax_scale; -inf without sink logits: no term at all.
            sink_log2 = mSinks[head] * LOG2_E
            normalize_rows(acc_O, row_sum, row_max, scale_log2, sink_log2, lse)
            if write_lse != 0:  # a runtime choice: one uniform branch at the end of the tile
                store_lse(lse, mLSE, tScS, m_block * self.tile_m, mQ.shape[0], head, batch, mma_tidx)
            if cutlass.const_expr(self.steps >= Step.EPILOGUE):
                gO = cute.local_tile(mO[None, None, head, batch], (64, dv), (m_block * self.num_wgs + mma_wg, 0))
                store_o_rows(acc_O, sO[None, None, mma_wg], tma_o, gO, pv_mma_wg, mma_wg, wg_tidx, self.dtype,
                             self.o_in_q)
                if cutlass.const_expr(self.o_in_q):
                    # Lane 0 of each warp arrives; warp 0's is the thread that waited for the store to read O.
                    pipeline_q.consumer_release(q_state)
            else:
                gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, dv), (m_block, 0))
                store_o_tile(acc_O, sO[None, None, 0], tma_o, gO, pv_mma, mma_tidx, self.dtype, self.mma_threads)
            q_state.advance()
        if cutlass.const_expr(self.steps >= Step.EPILOGUE):
            if wg_tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last store has read sO before the CTA exits
    # --8<-- [end:consumer]


# --8<-- [start:ablation]
def _after(step: Step) -> type:
    return type(f"AttentionUpTo{step.name.title()}", (Attention,), {"steps": step})


# The kernel after each step, in order: what the benchmark's ablation table times (stage 6 is the row before).
ABLATION = {f"+{step.name.lower()}": _after(step) for step in Step}
# --8<-- [end:ablation]


KERNEL_CONFIGS = prefill.kernel_configs(STAGE)  # each combination of this stage's features, compiled on its own


def cross_compile_config(config: prefill.KernelConfig, keep: bool = False):
    """Compile for sm_90a on any machine (no GPU needed) and report registers, smem, spills."""
    return prefill.cross_compile_config(Attention, config, stage=STAGE, keep=keep)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              sink_logits=None, num_sink_tokens=0, return_lse=False, out=None):
    """Attention over [B, S, H, D] fp16/bf16 CUDA tensors; the contract is docs/contract.md.

    ``out`` (optional) receives O; tests pass a NaN-poisoned buffer to prove
    every element is written. With ``return_lse`` returns (O, LSE [B, H_q, S_q] float32).
    """
    return prefill.attention(STAGE, Attention, q, k, v, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, sink_logits=sink_logits, num_sink_tokens=num_sink_tokens,
                             return_lse=return_lse, out=out)


if __name__ == "__main__":
    import torch

    from course.testing import demo

    demo.prefill(attention, seqlen_q=300, seqlen_k=1000, window_size=(128, 0), num_sink_tokens=4,
                 sink_logits=torch.linspace(-2, 2, 8, device="cuda"), return_lse=True)
