"""Stage 2: multi-tile TMA loading.

Compared with stage 1, this stage adds a loop over KV tiles fed by a pipeline,
because real sequences have far more than 128 keys: K and V stream through a
ring of shared-memory buffers that TMA fills while the math warpgroups work on
the previous tile. The CTA now has three warpgroups with different jobs (warp
specialization):

* warpgroup 0 is the producer: one of its warps issues the TMA copies of Q and
  of every K and V tile; it needs few registers and gives them away
  (setmaxnreg);
* warpgroups 1 and 2 are the consumers: they wait for a tile to land, compute
  with it, and release the buffer so the producer can refill it.

Each buffer has two mbarriers: "full" (the TMA bytes arrived) and "empty" (all
consumer warps are done with it). The KV-tile index is the runtime loop
variable that selects the TMA source tile.

The softmax stays exact without any correction, in two passes: pass 1 streams
the K tiles to find every row's maximum; pass 2 streams K and V again, computes
P with that final maximum, accumulates P V and the row sums, and normalizes at
the end. That is correct and reads K twice, which is why stage 3 exists.

Run it:
    python -m course check 2 --impl solutions    # this stage's tests
    python solutions/stage02_multi_tile.py       # one launch against the reference (needs a Hopper GPU)
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

STAGE = 2
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


@cute.jit
def mask_keys_beyond(acc_S: cute.Tensor, tScS: cute.Tensor, seqlen_k: cutlass.Int32):
    """Set scores of keys at or beyond S_k to -inf (TMA filled them with zeros).

    ``tScS`` is an identity tensor partitioned like ``acc_S``: each register's
    (row, col) coordinate inside the tile. A thread's rows all hold the same
    columns, so each column is compared once and masked in every row.
    """
    s = rows_cols_view(acc_S)
    coord = rows_cols_view(tScS)
    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
        if coord[0, c][1] >= seqlen_k:
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                s[r, c] = -cutlass.Float32.inf


# --8<-- [start:softmax]
@cute.jit
def update_row_max(acc_S: cute.Tensor, row_max: cute.Tensor):
    """Pass 1: fold one tile's scores into this thread's running row maxima.

    The quad reduction waits until every tile has been seen: max is
    associative, so reducing once at the end gives the same answer.
    """
    s = rows_cols_view(acc_S)
    # TODO(stage 2): After the call row_max[r] is the larger of its old value and every score this
    #   thread holds in row r of this tile. This thread's columns only: the quad is reduced once,
    #   after the last tile. (page: Why two passes)
    raise NotImplementedError("TODO(stage 2) in update_row_max(): After the call row_max[r] is the larger of its old value and every score this thread holds in row r of this tile. This thread's columns only: the quad is reduced once, after the last tile. (page: Why two passes) Hints, one at a time: python -m course hint 2 (docs/stages/02-multi-tile.md as raw markdown shows them all at once)")


@cute.jit
def exponentiate_rows(acc_S: cute.Tensor, row_max: cute.Tensor, scale_log2: cutlass.Float32,
                      row_sum: cute.Tensor):
    """Pass 2: P = exp2(S * scale_log2 - max * scale_log2) in place with the final row max;
    add this tile's part of each row sum (this thread's columns only)."""
    s = rows_cols_view(acc_S)
    # TODO(stage 2): row_max is final (every tile, whole quad). On return S holds P against it, in
    #   the same units as stage 1's softmax_rows, and row_sum[r] has grown by this tile's P of
    #   this thread's columns (no quad reduction: that comes after the last tile).
    #   (page: Why two passes)
    raise NotImplementedError("TODO(stage 2) in exponentiate_rows(): row_max is final (every tile, whole quad). On return S holds P against it, in the same units as stage 1's softmax_rows, and row_sum[r] has grown by this tile's P of this thread's columns (no quad reduction: that comes after the last tile). (page: Why two passes) Hints, one at a time: python -m course hint 2 (docs/stages/02-multi-tile.md as raw markdown shows them all at once)")


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


# --8<-- [start:load_tile]
@cute.jit
def load_tile(pipe, state, tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, n_block: cutlass.Int32):
    """Producer step: wait for an empty buffer, then TMA KV tile ``n_block`` into it.

    The copy completes on the buffer's "full" barrier, which ``producer_acquire``
    armed with the tile's byte count; ``producer_commit`` is a no-op for TMA.
    """
    # TODO(stage 2): Producer step: KV tile n_block (the runtime index, never a trace-time constant)
    #   lands in the ring buffer that state points at. The copy may start only once that buffer is
    #   empty, and must complete on that buffer's full barrier, which the consumers wait on. The
    #   caller advances state. (page: Producer and consumer steps)
    raise NotImplementedError("TODO(stage 2) in load_tile(): Producer step: KV tile n_block (the runtime index, never a trace-time constant) lands in the ring buffer that state points at. The copy may start only once that buffer is empty, and must complete on that buffer's full barrier, which the consumers wait on. The caller advances state. (page: Producer and consumer steps) Hints, one at a time: python -m course hint 2 (docs/stages/02-multi-tile.md as raw markdown shows them all at once)")
# --8<-- [end:load_tile]


# --8<-- [start:tile_scores]
@cute.jit
def tile_scores(qk_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                pipeline_k, k_state, tScS: cute.Tensor, n_block: cutlass.Int32, seqlen_k: cutlass.Int32):
    """Consumer step: S = Q K_n^T for KV tile ``n_block``, keys beyond S_k masked.

    Waits for the K buffer to be full and releases it as soon as the WGMMAs
    that read it have completed, so the producer can refill it early.
    """
    # TODO(stage 2): Consumer step: on return acc_S = Q K^T for the K tile in the ring buffer that
    #   k_state points at. Read the buffer only once it is full, and hand it back to the producer
    #   as soon as (and not before) the WGMMAs that read it have completed. The caller advances
    #   k_state. (page: Producer and consumer steps)
    raise NotImplementedError('TODO(stage 2) in tile_scores(): Consumer step: on return acc_S = Q K^T for the K tile in the ring buffer that k_state points at. Read the buffer only once it is full, and hand it back to the producer as soon as (and not before) the WGMMAs that read it have completed. The caller advances k_state. (page: Producer and consumer steps) Hints, one at a time: python -m course hint 2 (docs/stages/02-multi-tile.md as raw markdown shows them all at once)')
    if (n_block + 1) * TILE_N > seqlen_k:  # only the last tile can hold keys beyond S_k
        mask_keys_beyond(acc_S, tScS, seqlen_k - n_block * TILE_N)
# --8<-- [end:tile_scores]


# --8<-- [start:passes]
@cute.jit
def first_pass_row_max(qk_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                       pipeline_k, k_state, tScS: cute.Tensor, n_blocks: cutlass.Int32,
                       seqlen_k: cutlass.Int32, row_max: cute.Tensor):
    """Pass 1: stream every K tile and fold its scores into the row maxima; return the K state."""
    # TODO(stage 2): Pass 1 over KV tiles 0 .. n_blocks - 1 (a runtime loop), in the order the
    #   producer loads them: afterwards row_max[r] is the max of row r over all S_k keys, the same
    #   in the 4 threads of a quad. Every K buffer waited for is released, and k_state ends past
    #   the last tile: pass 2 continues from it. (page: Why two passes)
    raise NotImplementedError('TODO(stage 2) in first_pass_row_max(): Pass 1 over KV tiles 0 .. n_blocks - 1 (a runtime loop), in the order the producer loads them: afterwards row_max[r] is the max of row r over all S_k keys, the same in the 4 threads of a quad. Every K buffer waited for is released, and k_state ends past the last tile: pass 2 continues from it. (page: Why two passes) Hints, one at a time: python -m course hint 2 (docs/stages/02-multi-tile.md as raw markdown shows them all at once)')
    return k_state


@cute.jit
def second_pass_accumulate(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, acc_S: cute.Tensor, acc_O: cute.Tensor,
                           tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrV: cute.Tensor, pipeline_k, k_state,
                           pipeline_v, v_state, tScS: cute.Tensor, n_blocks: cutlass.Int32,
                           seqlen_k: cutlass.Int32, row_max: cute.Tensor, row_sum: cute.Tensor,
                           scale_log2: cutlass.Float32, dtype: cutlass.Constexpr):
    """Pass 2: stream K and V again; P with the final row max, O += P V, row sums."""
    # TODO(stage 2): Pass 2 over the same tiles, again in the producer's order (K then V of each):
    #   afterwards acc_O is the sum over tiles of P V with P against the final row_max
    #   (accumulated, never overwritten) and row_sum this thread's share of the row sums. Each K
    #   and V buffer is used only once full and released once the WGMMAs that read it have
    #   completed; both states advance one buffer per tile. (page: Why two passes)
    raise NotImplementedError("TODO(stage 2) in second_pass_accumulate(): Pass 2 over the same tiles, again in the producer's order (K then V of each): afterwards acc_O is the sum over tiles of P V with P against the final row_max (accumulated, never overwritten) and row_sum this thread's share of the row sums. Each K and V buffer is used only once full and released once the WGMMAs that read it have completed; both states advance one buffer per tile. (page: Why two passes) Hints, one at a time: python -m course hint 2 (docs/stages/02-multi-tile.md as raw markdown shows them all at once)")
# --8<-- [end:passes]


# --8<-- [start:normalize]
@cute.jit
def normalize_rows(acc_O: cute.Tensor, row_sum: cute.Tensor):
    """O /= row sum (every row has at least one visible key until stage 4 adds masks)."""
    o = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        inv_sum = cute.arch.rcp_approx(row_sum[r])
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
    """One CTA = one 128-row Q tile x every KV tile, in two passes over K."""

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

        # --8<-- [start:smem]
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
        # --8<-- [end:smem]

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
        seqlen_k = mK.shape[0]
        n_blocks = (seqlen_k + TILE_N - 1) // TILE_N

        # GQA/MQA: a group of H_q / H_kv query heads shares one KV head.
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        load_bar = storage.load_bar.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # --8<-- [start:pipelines]
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
        # --8<-- [end:pipelines]
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_o)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(load_bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialized before anyone uses one

        # --8<-- [start:tiles]
        # The last mode of gK / gV is the KV-tile index: the loops below select the
        # tile with their runtime loop variable (pinning it to 0 would load tile 0 forever).
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, d), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, d), (None, 0))  # (TILE_N, d, n_blocks)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (d, TILE_N), (0, None))  # (d, TILE_N, n_blocks)
        one_cta = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        # --8<-- [end:tiles]

        if warpgroup_idx == 0:
            # --8<-- [start:producer]
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(load_bar, self.q_bytes)
                cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=load_bar)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
                for n_block in cutlass.range(n_blocks, unroll=1):  # pass 1: K only
                    load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, n_block)
                    k_state.advance()
                for n_block in cutlass.range(n_blocks, unroll=1):  # pass 2: K and V
                    load_tile(pipeline_k, k_state, tma_k, tKgK, tKsK, n_block)
                    k_state.advance()
                    load_tile(pipeline_v, v_state, tma_v, tVgV, tVsV, n_block)
                    v_state.advance()
                # Wait until the consumers released the last buffers before the CTA may exit.
                pipeline_k.producer_tail(k_state)
                pipeline_v.producer_tail(v_state)
            # --8<-- [end:producer]
        else:
            cute.arch.setmaxregister_increase(MMA_REGS)
            mma_tidx = tidx - 128
            # --8<-- [start:consumer]
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

            k_state = first_pass_row_max(qk_mma, acc_S, tSrQ, tSrK, pipeline_k, k_state, tScS,
                                         n_blocks, seqlen_k, row_max)
            second_pass_accumulate(qk_mma, pv_mma, acc_S, acc_O, tSrQ, tSrK, tOrV, pipeline_k, k_state,
                                   pipeline_v, v_state, tScS, n_blocks, seqlen_k, row_max, row_sum,
                                   scale_log2, self.dtype)
            quad_allreduce(row_sum, cute.arch.warp_reduction_sum)
            normalize_rows(acc_O, row_sum)
            # --8<-- [end:consumer]

            # --8<-- [start:epilogue]
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
            # --8<-- [end:epilogue]


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

    demo.prefill(attention, seqlen_q=300, seqlen_k=1000)
