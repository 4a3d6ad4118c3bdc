"""Stage 4: in-kernel sliding-window and causal masking.

Compared with stage 3, this stage adds causal and sliding-window attention,
because most models restrict which keys a query may see, and a mask that is
only applied to the scores would still pay for every masked tile. Two things
change:

* which KV tiles are visited: each Q tile computes the range
  [n_block_min, n_block_max) of KV tiles that hold at least one visible key
  for any of its rows (``WindowMask.kv_block_range``), and the producer and the
  consumers loop over exactly that range, so a 512-key window over 16k keys
  costs about what 1k keys cost;
* which scores survive: on the tiles that straddle a boundary
  (``WindowMask.tile_is_partial``), every register of S gets its (row, key)
  from an identity tensor partitioned like the accumulator and is set to -inf
  when the key is outside [row + offset - left, row + offset + right] or
  beyond S_k (``WindowMask.apply``). Fully visible tiles run unmasked.

Semantics (docs/contract.md): bottom-right aligned, offset = S_k - S_q; causal means
right = 0; -1 leaves a side unbounded, and an unbounded side compiles out.
Rows that see no key at all (causal with S_q > S_k, or a window that ends
before key 0) produce O = 0: the softmax and the normalization guard the
-inf maximum and the zero sum.

Run it:
    python -m course check 4 --impl solutions    # this stage's tests
    python solutions/stage04_masking.py          # one launch against the reference (needs a Hopper GPU)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from course.runtime import prefill

STAGE = 4
TILE_M = 128  # query rows per CTA: two warpgroups of 64 rows (one WGMMA M each)
TILE_N = 128  # keys per KV tile
KV_STAGES = 2  # buffers in each of the K and V rings
MMA_WARPS = 8  # the two consumer warpgroups; each warp releases a buffer once
PRODUCER_REGS, MMA_REGS = 24, 240  # setmaxnreg: 128 * 24 + 256 * 240 <= 64K registers


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


# --8<-- [start:mask]
class WindowMask:
    """Which keys the rows of this CTA's Q tile may see (bottom-right aligned, docs/contract.md).

    With offset = S_k - S_q, row i sees key j iff j < S_k and
    i + offset - left <= j <= i + offset + right. An unbounded side (-1) is
    compiled out through ``has_left`` / ``has_right``.
    """

    def __init__(self, m_block, seqlen_q, seqlen_k, left, right, config):
        self.row0 = m_block * TILE_M
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.offset = seqlen_k - seqlen_q
        self.left, self.right = left, right
        self.has_left, self.has_right = config.has_left, config.has_right

    # --8<-- [start:block_range]
    @cute.jit
    def kv_block_range(self):
        """[n_block_min, n_block_max): the KV tiles with a visible key for some row of this tile."""
        # TODO(stage 4): n_block_max and n_block_min bound the half-open range of KV tiles that
        #   holds every key visible to some row of this Q tile (its rows stop at S_q in the tail
        #   tile), from the first row's first visible key to the last row's last. Too long is
        #   correct but slow; too short drops keys. Both lie in [0, number of KV tiles],
        #   n_block_min <= n_block_max (an empty range is fine), and an unbounded side compiles to
        #   no code. Int32 division truncates toward zero. (page: Skipping tiles: the block range)
        raise NotImplementedError("TODO(stage 4) in kv_block_range(): n_block_max and n_block_min bound the half-open range of KV tiles that holds every key visible to some row of this Q tile (its rows stop at S_q in the tail tile), from the first row's first visible key to the last row's last. Too long is correct but slow; too short drops keys. Both lie in [0, number of KV tiles], n_block_min <= n_block_max (an empty range is fine), and an unbounded side compiles to no code. Int32 division truncates toward zero. (page: Skipping tiles: the block range) Hints, one at a time: python -m course hint 4 (docs/stages/04-masking.md as raw markdown shows them all at once)")
        return n_block_min, n_block_max
    # --8<-- [end:block_range]

    @cute.jit
    def tile_is_partial(self, n_block: cutlass.Int32):
        """Does KV tile ``n_block`` hold a masked key for some row? Full tiles skip the mask."""
        partial = (n_block + 1) * TILE_N > self.seqlen_k
        if cutlass.const_expr(self.has_right):
            partial = partial | ((n_block + 1) * TILE_N - 1 > self.row0 + self.offset + self.right)
        if cutlass.const_expr(self.has_left):
            partial = partial | (n_block * TILE_N < self.row0 + TILE_M - 1 + self.offset - self.left)
        return partial

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32):
        """Set S to -inf outside each row's visible keys, from every register's (row, col)."""
        s = rows_cols_view(acc_S)
        coord = rows_cols_view(tScS)
        key0 = n_block * TILE_N
        # TODO(stage 4): Every s[r, c] whose key its row may not see (outside the row's window, or
        #   at or past S_k: the rule of The semantics) becomes -inf; visible scores stay as they
        #   are. coord gives each register's (row, col) inside this Q tile and KV tile, not in the
        #   sequence. An unbounded side compiles to no code. (page: Masking in registers)
        raise NotImplementedError("TODO(stage 4) in apply(): Every s[r, c] whose key its row may not see (outside the row's window, or at or past S_k: the rule of The semantics) becomes -inf; visible scores stay as they are. coord gives each register's (row, col) inside this Q tile and KV tile, not in the sequence. An unbounded side compiles to no code. (page: Masking in registers) Hints, one at a time: python -m course hint 4 (docs/stages/04-masking.md as raw markdown shows them all at once)")
# --8<-- [end:mask]


# --8<-- [start:softmax]
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
    #   (stage 3 page: From two passes to one; page: Rows with no visible key)
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
# --8<-- [end:softmax]


@cute.jit
def scores_to_operand_a(acc_S: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    """P in registers as the fp16/bf16 A operand of O = P V (no trip through shared memory)."""
    # [exercise 1] Return P as a NEW register tensor of dtype (fp16/bf16) holding acc_S's fp32
    #   values, laid out as the A operand of the P V WGMMA. No value moves between threads and
    #   nothing goes through shared memory; acc_S is left as it is.
    #   (stage 1 page: From S to P without shared memory)
    rP = cute.make_rmem_tensor_like(acc_S, dtype)
    rP.store(acc_S.load().to(dtype))
    return cute.make_tensor(rP.iterator, acc_layout_as_operand_a(rP.layout))
    # [/exercise]


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


# --8<-- [start:tile_scores]
@cute.jit
def tile_scores(qk_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                pipeline_k, k_state, tScS: cute.Tensor, n_block: cutlass.Int32, mask: WindowMask):
    """Consumer step: S = Q K_n^T for KV tile ``n_block``, invisible keys masked.

    Waits for the K buffer to be full and releases it as soon as the WGMMAs
    that read it have completed, so the producer can refill it early.
    """
    # [exercise 2] Consumer step: on return acc_S = Q K^T for the K tile in the ring buffer that
    #   k_state points at. Read the buffer only once it is full, and hand it back to the producer
    #   as soon as (and not before) the WGMMAs that read it have completed. The caller advances
    #   k_state. (stage 2 page: Producer and consumer steps)
    pipeline_k.consumer_wait(k_state)
    warpgroup_gemm(qk_mma, acc_S, tSrQ, tSrK[None, None, None, k_state.index])
    warpgroup.wait_group(0)
    pipeline_k.consumer_release(k_state)
    # [/exercise]
    # Only tiles that straddle a boundary pay for the mask. (A runtime `if` may not carry a
    # plain Python object such as `mask` across it; its bound method is fine.)
    apply_mask = mask.apply
    if mask.tile_is_partial(n_block):
        apply_mask(acc_S, tScS, n_block)
# --8<-- [end:tile_scores]


@cute.jit
def attend_kv_tiles(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, acc_S: cute.Tensor, acc_O: cute.Tensor,
                    tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrV: cute.Tensor, pipeline_k, k_state,
                    pipeline_v, v_state, tScS: cute.Tensor, n_block_min: cutlass.Int32,
                    n_block_max: cutlass.Int32, mask: WindowMask, row_max: cute.Tensor, row_sum: cute.Tensor,
                    scale_log2: cutlass.Float32, dtype: cutlass.Constexpr):
    """One pass over the visible KV tiles: online softmax, O += P V, row sums."""
    # [exercise 3] One pass over the KV tiles of the block range [n_block_min, n_block_max), in
    #   the producer's order: afterwards acc_O is the sum of P V relative to the final row_max
    #   (unnormalized) and row_max/row_sum are the online softmax's. Each K and V buffer is used
    #   only once full and released once the WGMMAs that read it have completed; O may be
    #   rescaled, and P's registers reused, only while no P V WGMMA that reads them is in flight.
    #   (stage 3 page: The loop)
    for n_block in cutlass.range(n_block_min, n_block_max, unroll=1):
        tile_scores(qk_mma, acc_S, tSrQ, tSrK, pipeline_k, k_state, tScS, n_block, mask)
        k_state.advance()
        online_softmax(acc_S, acc_O, row_max, row_sum, scale_log2)
        tOrP = scores_to_operand_a(acc_S, dtype)
        pipeline_v.consumer_wait(v_state)
        warpgroup_gemm(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()
    # [/exercise]


# --8<-- [start:normalize]
@cute.jit
def normalize_rows(acc_O: cute.Tensor, row_sum: cute.Tensor):
    """O /= row sum; a row with no visible key (sum 0) gets O = 0."""
    o = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        inv_sum = cute.arch.rcp_approx(row_sum[r])
        if row_sum[r] == 0.0:
            inv_sum = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] *= inv_sum
# --8<-- [end:normalize]


def bshd_as_rows_dim(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (S, D, H, B): rows and the contiguous K mode first, as TMA and WGMMA index them."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def bshd_as_dim_rows(t: cute.Tensor) -> cute.Tensor:
    """[B, S, H, D] -> (D, S, H, B): V seen as the (N, K) = (D, S_k) B operand of P V."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[3, 1, 2, 0]))


class Attention:
    """One CTA = one 128-row Q tile x the KV tiles its rows can see, with in-kernel masks."""

    num_threads = 384  # warpgroup 0: TMA producer; warpgroups 1-2: MMA consumers

    def __init__(self, config: prefill.KernelConfig):
        self.config = config  # what this kernel is compiled for: a feature that is off compiles out
        self.dtype = config.cute_dtype
        self.head_dim = config.head_dim

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
        dtype, d = self.dtype, self.head_dim
        mQ, mK, mO = bshd_as_rows_dim(mQ), bshd_as_rows_dim(mK), bshd_as_rows_dim(mO)
        mV = bshd_as_dim_rows(mV)

        # S = Q K^T: both operands K-major (head_dim contiguous), from shared memory.
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (2, 1, 1), (64, TILE_N),
        )
        # O = P V: P from registers (K-major), V MN-major (head_dim contiguous).
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN,
            cutlass.Float32, (2, 1, 1), (64, d), warpgroup.OperandSource.RMEM,
        )

        one_stage = (None, None, 0)
        sQ_layout = cute.slice_(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), dtype, 1), one_stage
        )
        # K and V keep a stage mode: KV_STAGES buffers each.
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), dtype, KV_STAGES)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_M, d, TILE_N), dtype, KV_STAGES)

        @cute.struct
        class SharedStorage:
            load_bar: cute.struct.MemRange[cutlass.Int64, 1]
            k_bars: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]  # full + empty per buffer
            v_bars: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (TILE_M, d))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(sK_layout, one_stage), (TILE_N, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, cute.slice_(sV_layout, one_stage), (d, TILE_N))
        # O has Q's tile shape, so it is staged in Q's shared memory with Q's layout.
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (TILE_M, d))
        self.q_bytes = cute.size_in_bytes(dtype, sQ_layout)
        self.kv_bytes = cute.size_in_bytes(dtype, cute.slice_(sK_layout, one_stage))  # one K or V tile

        seqlen_q, num_heads_q, batch = mQ.shape[0], mQ.shape[2], mQ.shape[3]
        grid = ((seqlen_q + TILE_M - 1) // TILE_M, num_heads_q, batch)
        self.kernel(
            qk_mma, pv_mma, tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, tma_o, tma_mO,
            mLSE, mSinks, scale_log2, window_left, window_right, num_sink_tokens, write_lse, sQ_layout, sK_layout,
            sV_layout,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
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
    ):
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
        # --8<-- [start:range]
        mask = WindowMask(m_block, mQ.shape[0], mK.shape[0], window_left, window_right, self.config)
        n_block_min, n_block_max = mask.kv_block_range()  # producer and consumers walk the same tiles
        # --8<-- [end:range]

        # GQA/MQA: a group of H_q / H_kv query heads shares one KV head.
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        load_bar = storage.load_bar.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # A "full" barrier per buffer completes when its TMA bytes have landed (one
        # producer arrival + tx bytes); an "empty" barrier when all MMA warps released it.
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WARPS)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=producer, consumer_group=consumers,
            tx_count=self.kv_bytes, barrier_storage=storage.k_bars.data_ptr(), defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            num_stages=KV_STAGES, producer_group=producer, consumer_group=consumers,
            tx_count=self.kv_bytes, barrier_storage=storage.v_bars.data_ptr(), defer_sync=True,
        )
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_o)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(load_bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialized before anyone uses one

        # The last mode of gK / gV is the KV-tile index: the loops below select the
        # tile with their runtime loop variable (pinning it to 0 would load tile 0 forever).
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, d), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, d), (None, 0))  # (TILE_N, d, n_blocks)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (d, TILE_N), (0, None))  # (d, TILE_N, n_blocks)
        one_cta = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(load_bar, self.q_bytes)
                cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=load_bar)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
                for n_block in cutlass.range(n_block_min, n_block_max, unroll=1):  # only the visible tiles
                    load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, n_block)
                    k_state.advance()
                    load_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, n_block)
                    v_state.advance()
                # Wait until the consumers released the last buffers before the CTA may exit.
                pipeline_k.producer_tail(k_state)
                pipeline_v.producer_tail(v_state)
        else:
            cute.arch.setmaxregister_increase(MMA_REGS)
            mma_tidx = tidx - 128
            thr_qk = qk_mma.get_slice(mma_tidx)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, N, K, KV_STAGES)
            acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_M, TILE_N)))
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
            thr_pv = pv_mma.get_slice(mma_tidx)
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, N, K, KV_STAGES)
            sO = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # O is staged where Q was
            tOsO = thr_pv.partition_C(sO)  # (made before the loops, which rebind pv_mma's fields)
            acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE_M, d)))
            rows = cute.size(rows_cols_view(acc_S), mode=[0])
            row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
            row_sum = cute.make_rmem_tensor(rows, cutlass.Float32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)
            acc_O.fill(0.0)
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
            cute.arch.mbarrier_wait(load_bar, 0)

            attend_kv_tiles(qk_mma, pv_mma, acc_S, acc_O, tSrQ, tSrK, tOrV, pipeline_k, k_state,
                            pipeline_v, v_state, tScS, n_block_min, n_block_max, mask, row_max, row_sum,
                            scale_log2, self.dtype)
            quad_allreduce(row_sum, cute.arch.warp_reduction_sum)
            normalize_rows(acc_O, row_sum)

            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))
            # The producer warpgroup is not part of this: a named barrier over the 256 MMA threads.
            cute.arch.barrier(barrier_id=1, number_of_threads=2 * 128)  # all done reading Q
            cute.autovec_copy(rO, tOsO)
            # Make the generic-proxy stores visible to the TMA (async proxy) before it reads them.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=2 * 128)

            gO = cute.local_tile(mO[None, None, head, batch], (TILE_M, d), (m_block, 0))
            bOsO, bOgO = cpasync.tma_partition(tma_o, 0, one_cta, cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
            if warp_idx == 4:  # the first MMA warp
                with cute.arch.elect_one():  # one thread issues the store and waits for its group
                    cute.copy(tma_o, bOsO, bOgO)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)


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
    from course.testing import demo

    demo.prefill(attention, seqlen_q=300, seqlen_k=1000, causal=True)
